"""Tensor parallelism (`jaxmodel.sharding`) on 2 and 4 CPU devices against one device: logits, the collectives of
the compiled steps, and greedy output through the engine for plain decoding and every drafter and rollback mode.

The suite's process keeps one device, so the checks run in one subprocess with 4 forced host devices
(--xla_force_host_platform_device_count) and report back as JSON; the tests below read its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmodel.config import from_gguf
from jaxmodel.gguf_layout import open_gguf
from jaxmodel.sharding import check_divides

DATA = Path(__file__).parent / "data"
N_DEVICES = 4
MODELS = ("tiny-qwen35-mtp", "tiny-qwen35moe", "tiny-qwen3next")
LAYOUTS = (2, 4)
# A sharded model sums each row-split product over the shards, in another order than one device does; at these
# models' logits (|logit| up to about 4.5, after 4 to 8 layers) that moves them by up to about 4e-5. One device
# under the same code (a mesh of one) gives the same bits (checked below), so the difference is that order alone.
LOGITS_TOLERANCE = 1e-4
# The engine check: the model with repeated KV and key heads (2 each over 4 devices), MoE FFNs and an MTP head.
ENGINE_MODEL, ENGINE_DEVICES = "tiny-qwen3next", 4
MAX_TOKENS = 12
# Drafters, n_max, rollback; one n_max and prompts of one chunk (ENGINE's 16 tokens) keep the compiled shapes few.
SPECS = {"plain": None, "mtp-snapshot": (("mtp",), 3, "snapshot"), "mtp-checkpoint": (("mtp",), 3, "checkpoint"),
         "mtp-ngram-replay": (("mtp", "ngram"), 3, "replay"), "ngram": (("ngram",), 3, "auto")}


def _checks() -> dict:
    """Run in the subprocess: every check's raw results."""
    import anyio
    import jax
    import numpy as np
    from conftest import ENGINE, plain_greedy

    from jaxmodel import load_model
    from jaxmodel.requests import SpeculativeConfig
    from jaxmodel.sharding import count_collectives, state_specs
    from jaxmodel.state import Row, pack_batch
    from jaxmodel.executor.host_io import pack
    from scheduler import DoneEvent, Engine, GenerationRequest, TokensEvent

    report: dict = {"devices": len(jax.devices()), "logits": {}, "skipped": {}}
    tokens = list(range(3, 19))
    models = {name: load_model(DATA / f"{name}.gguf") for name in MODELS}
    for name, model in models.items():
        logits, hidden = model.score(tokens)
        for n in ((1,) if name == MODELS[0] else ()) + LAYOUTS:
            try:
                sharded = model.sharded(n)
            except ValueError as exc:
                report["skipped"][f"{name}/{n}"] = str(exc)
                continue
            got, _ = sharded.score(tokens)
            report["logits"][f"{name}/{n}"] = [float(np.abs(got - logits).max()), float(np.abs(logits).max())]
            if n == 2 and name == "tiny-qwen35-mtp":
                state = sharded.new_state(n_pages=4, n_planes=3)
                batch = pack_batch([Row([1, 2, 3], 0, [1], 0, [-1, -1, 1], [2])])
                text = sharded.step.lower(sharded.weights, batch=batch, state=state).compile().as_text()
                report["forward_collectives"] = count_collectives(text)
                report["n_layer"] = sharded.cfg.n_layer

    model = models[ENGINE_MODEL]
    rng = np.random.default_rng(0)
    # The last two: the model's first greedy token follows the prompt's last one earlier in the prompt (486 281;
    # 472 66), so the n-gram lookup drafts (wrongly) after it.
    prompts = [tuple(int(t) for t in rng.integers(0, 500, 9)),
               (43, 486, 281, 486, 480, 486, 385, 486, 344, 486, 32, 486, 419, 486, 92, 486),
               (354, 472, 388, 472, 54, 472, 66, 472, 214, 472, 5, 472, 221, 472, 337, 472)]
    report["references"] = [plain_greedy(model, p, MAX_TOKENS) for p in prompts]
    # Every request at once, in steps of one compiled batch size: few shapes to compile.
    engine = Engine(model, **{**ENGINE, "max_running": 16, "budget_bytes": 4 << 20}, row_buckets=(16,), adaptive=False,
                    max_call_seconds=None, tensor_parallel=ENGINE_DEVICES)
    engine.iterations = 4
    runtime = engine.runtime
    placed = jax.tree.map(lambda x: x.sharding, runtime.state)
    wanted = jax.tree.map(lambda x: jax.sharding.NamedSharding(engine.model.cfg.tensor_parallel.mesh, x),
                          state_specs(runtime.state), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    report["state_specs_match"] = _same_placement(runtime.state, wanted)
    B, T, inputs, static = next(call for call in runtime._warmup_calls() if call[1] == 1)
    buffer, layout = pack(inputs)
    text = runtime._step._jitted.lower(runtime.model.weights, runtime.state, buffer, layout=layout,
                                       **static).compile().as_text()  # fmt: skip
    report["step_collective_sources"] = sorted({_collective_source(line) for line in text.splitlines()} - {None})

    async def collect(request):
        out, done = [], None
        async for event in engine.generate(request):
            if isinstance(event, TokensEvent):
                out += event.token_ids
            elif isinstance(event, DoneEvent):
                done = event
        return out, dict(done.rollback_steps), sum(s.drafted for s in done.drafters.values())

    async def main():
        results = {label: [None] * len(prompts) for label in SPECS}

        async def run(label, i):
            spec = SPECS[label] and SpeculativeConfig(SPECS[label][0], n_max=SPECS[label][1], rollback=SPECS[label][2])
            results[label][i] = await collect(GenerationRequest(prompts[i], MAX_TOKENS, speculative=spec))

        async with engine:
            async with anyio.create_task_group() as group:
                for label in SPECS:
                    for i in range(len(prompts)):
                        group.start_soon(run, label, i)
        return results

    report["engine"] = anyio.run(main)
    report["state_kept_sharding"] = _same_placement(runtime.state, placed)
    return report


def _same_placement(state, shardings) -> list[str]:
    """The leaves of state (as key paths) not placed as `shardings` says; empty when all are."""
    import jax

    wrong = jax.tree_util.tree_map_with_path(
        lambda path, x, want: None if x.sharding.is_equivalent_to(want, x.ndim) else jax.tree_util.keystr(path),
        state, shardings)
    return [path for path in jax.tree.leaves(wrong) if path]


def _collective_source(line: str) -> str | None:
    """For an HLO line holding a collective, the JAX operation it comes from (the end of its op_name)."""
    import re

    from jaxmodel.sharding import COLLECTIVES

    if not re.search(r"= [^=]*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line):
        return None
    name = re.search(r'op_name="([^"]*)"', line)
    return name.group(1).split("/")[-1].rstrip(")") if name else "?"


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_heads_of_each_layout_divide_or_the_layout_is_refused():
    """Layouts whose heads do not split are refused by name: the tiny qwen35moe's 6 attention and GDN value heads
    over 4 devices. KV and GDN key heads fewer than the devices (2 over 4) are repeated instead."""
    cfg = from_gguf(open_gguf(str(DATA / "tiny-qwen35moe.gguf")))
    with pytest.raises(ValueError, match="6 heads do not split over 4 devices"):
        check_divides(cfg, 4)
    check_divides(cfg, 2)
    check_divides(from_gguf(open_gguf(str(DATA / "tiny-qwen3next.gguf"))), 4)


def test_sharded_logits_match_one_device(report):
    assert report["devices"] == N_DEVICES
    assert set(report["skipped"]) == {"tiny-qwen35moe/4"}, report["skipped"]
    for layout, (difference, scale) in report["logits"].items():
        if layout.endswith("/1"):
            assert difference == 0.0, layout  # a mesh of one device: the same bits
        else:
            assert difference <= LOGITS_TOLERANCE, (layout, difference, scale)
    assert len(report["logits"]) == 1 + 3 * 2 - 1


def test_each_block_ends_in_one_all_reduce_and_nothing_else_communicates(report):
    """The forward: one all-reduce per attention, GDN and FFN block and one for the embedding lookup, one
    all-gather of the logits, no other collective. The speculative step (forward, verification, MTP chain, the
    iteration loop): every collective is one of those, none inserted by XLA's partitioner."""
    counts = report["forward_collectives"]
    assert counts.pop("all-reduce") == 1 + 2 * report["n_layer"]
    assert counts.pop("all-gather") == 1
    assert not any(counts.values()), counts
    assert set(report["step_collective_sources"]) <= {"psum", "all_gather"}, report["step_collective_sources"]


def test_sharded_engine_is_lossless_for_every_drafter_and_rollback_mode(report):
    """Plain decoding and drafting (MTP with snapshot, checkpoint and replay rollback, n-gram lookup) on 4 devices
    give the tokens plain greedy decoding gives on one, fifteen requests at once; the state keeps its placement."""
    assert report["state_specs_match"] == [] and report["state_kept_sharding"] == [], report["state_kept_sharding"]
    references = report["references"]
    for label, outs in report["engine"].items():
        for prompt, ((tokens, rollback_steps, drafted), want) in enumerate(zip(outs, references, strict=True)):
            assert tokens == want, (label, prompt)
            mode = SPECS[label] and SPECS[label][2]
            if mode not in (None, "auto") and drafted:
                assert sum(rollback_steps.values()) == rollback_steps[mode] > 0, (label, prompt, rollback_steps)
        if label != "plain":
            assert sum(drafted for _, _, drafted in outs) > 0, label


if __name__ == "__main__":
    print(json.dumps(_checks()))
