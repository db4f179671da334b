"""Tensor and expert parallelism (`jaxmodel.sharding`) on 2 and 4 CPU devices against one device: logits of float
and block-quantized models (their blocks split, not dequantized), the collectives of the compiled steps, and greedy
output through the engine for plain decoding and every drafter and rollback mode, on a block-quantized model whose
routed experts split over two groups of two tensor-parallel devices, then next turns from its prefix cache; and two
processes (`jaxmodel.multiprocess`) serving as one.

The suite's process keeps one device, so the checks run in one subprocess with 4 forced host devices
(--xla_force_host_platform_device_count) and report back as JSON; the tests below read its report. The two
processes are servers of their own, one host device each."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import long_test

from bench import free_port, wait_listening
from jaxmodel.config import from_gguf
from jaxmodel.gguf_layout import open_gguf
from jaxmodel.sharding import check_divides, check_experts_divide, ffn_columns

DATA = Path(__file__).parent / "data"
N_DEVICES = 4
MODELS = ("tiny-qwen35-mtp", "tiny-qwen35moe", "tiny-qwen3next")
# Block-quantized: llama-quantize's Q4_K_M of the bundled target (FFN down in 256-input K blocks: at 4 devices its
# 512 columns pad to one block each), and two tiny models written as Q4_0 by the checks (GDN heads of 16 inputs,
# narrower than a 32-input block: GDN out is held whole where a device's heads are not whole blocks; the tiny
# qwen3next's out keeps the file's head order).
BLOCK_MODELS = ("bundled-target-q4_k_m", "tiny-qwen35-mtp-q4_0", "tiny-qwen3next-q4_0")
LAYOUTS = (2, 4)
# A sharded float model sums each row-split product over the shards, in another order than one device does; at
# these models' logits (|logit| up to about 4.5, after 4 to 8 layers) that moves them by up to about 4e-5. One
# device under the same code (a mesh of one) gives the same bits (checked below), so the difference is that order
# alone. A block-quantized model's products sum per block, and a block is never split: within the 1e-5.
LOGITS_TOLERANCE = 1e-4
BLOCK_LOGITS_TOLERANCE = 1e-5
# The engine check: a block-quantized model with MoE FFNs and an MTP head, its routed experts in two groups of two
# tensor-parallel devices (both axes at once; its 2 KV heads each repeated within a group).
ENGINE_MODEL = "tiny-qwen3next-q4_0"
SHORT_STEP_MODEL = "tiny-qwen3next"
MAX_TOKENS = 12
# Drafters, n_max, rollback; one n_max and prompts of one chunk (ENGINE's 16 tokens) keep the compiled shapes few.
SPECS = {"plain": None, "mtp-snapshot": (("mtp",), 3, "snapshot"), "mtp-checkpoint": (("mtp",), 3, "checkpoint"),
         "mtp-ngram-replay": (("mtp", "ngram"), 3, "replay"), "ngram": (("ngram",), 3, "auto")}
# Expert parallelism: (expert groups, tensor-parallel devices per group) on the MoE models; each pair's sums run in
# another order than one device's too, hence the same tolerance. The engine runs both axes at once.
EXPERT_LAYOUTS = {"tiny-qwen35moe": ((4, 1),), "tiny-qwen3next": ((4, 1), (2, 2))}
EXPERT_ENGINE_LAYOUT = (2, 2)


def write_q4_0(name: str, folder: Path) -> Path:
    """tests/data/{name}.gguf's weights written as Q4_0 (`gguf_io.write_gguf`), into folder."""
    from jaxmodel.gguf_io import read_gguf, write_gguf

    cfg, weights, _ = read_gguf(DATA / f"{name}.gguf")
    path = folder / f"{name}-q4_0.gguf"
    write_gguf(path, cfg, weights, dtype="q4_0")
    return path


def _device_bytes(weights) -> int:
    """The bytes of weights one device (the first) holds, each array once."""
    import jax

    return sum({id(x): x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(weights)}.values())


def _float_matrices(weights) -> list[str]:
    """The paths of weights' float matrices (2-D float32 leaves wider than 64 both ways)."""
    import jax
    import numpy as np

    return [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(weights)
            if x.dtype == np.float32 and x.ndim == 2 and min(x.shape) > 64]


def _fused(weights) -> int:
    """How many `Fused` products weights hold."""
    import jax

    from jaxmodel.weights import Fused

    return sum(isinstance(x, Fused) for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, Fused)))


def _checks(folder: Path) -> dict:
    """Run in the subprocess: every check's raw results. folder: where the Q4_0 models are written."""
    import jax
    import numpy as np
    from conftest import ENGINE, plain_greedy

    from jaxmodel import load_model
    from jaxmodel.executor import executables
    from jaxmodel.executor import runtime as runtime_module
    from jaxmodel.sharding import count_collectives, state_specs
    from jaxmodel.state import Row, pack_batch
    from jaxmodel.executor.host_io import pack
    from scheduler import Engine

    report: dict = {"devices": len(jax.devices()), "logits": {}, "skipped": {}, "expert_logits": {},
                    "expert_collectives": {}, "expert_n_layer": {}, "block_logits": {}, "block_layout": {}}
    tokens = list(range(3, 19))
    paths = {name: DATA / f"{name}.gguf" for name in MODELS + BLOCK_MODELS[:1]}
    paths.update({f"{name}-q4_0": write_q4_0(name, folder) for name in ("tiny-qwen35-mtp", "tiny-qwen3next")})
    report["paths"] = {name: str(path) for name, path in paths.items()}
    models = {name: load_model(path) for name, path in paths.items()}
    for name in BLOCK_MODELS:
        model = models[name]
        logits, _ = model.score(tokens)
        for n in LAYOUTS:
            sharded = model.sharded(n)
            got, _ = sharded.score(tokens)
            report["block_logits"][f"{name}/{n}"] = [float(np.abs(got - logits).max()), float(np.abs(logits).max())]
            laid = sharded.layout_report
            report["block_layout"][f"{name}/{n}"] = {
                "kept": laid.blocks_kept, "gathered": laid.gathered, "padding_bytes": laid.padding_bytes,
                "device_bytes": _device_bytes(sharded.weights), "one_device_bytes": model.weights_bytes,
                "float_matrices": _float_matrices(sharded.weights), "one_device_float": _float_matrices(model.weights),
                "fused": _fused(sharded.weights), "one_device_fused": _fused(model.weights)}
    # The Pallas kernels (interpreted here) per shard: the fused GDN decode kernel and the paged attention kernel,
    # forced on, in a 3-token step of the tiny qwen35 on 2 devices against one device under the same kernels.
    from jaxmodel import attention, gdn

    gdn.FORCE_FUSED, attention.FORCE_IMPL = True, "pallas"
    try:
        want, _ = _short_step(models[MODELS[0]], tokens[:3])
        got, text = _short_step(models[MODELS[0]].sharded(2), tokens[:3])
    finally:
        gdn.FORCE_FUSED, attention.FORCE_IMPL = None, None
    report["pallas_logits"] = [float(np.abs(got - want).max()), float(np.abs(want).max())]
    report["pallas_kernels"] = {name: name in text for name in ("gdn_decode", "paged_attention")}
    for name in MODELS:
        model = models[name]
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
        if name not in EXPERT_LAYOUTS:
            continue
        short_logits, _ = model.score(tokens[:3]) if name == SHORT_STEP_MODEL else (None, None)
        for groups, n in EXPERT_LAYOUTS[name]:
            sharded = model.sharded(n, expert_parallel=groups)
            layout = f"{name}/ep{groups}xtp{n}"
            got, _ = sharded.score(tokens)
            report["expert_logits"][layout] = [float(np.abs(got - logits).max()), float(np.abs(logits).max())]
            if name == SHORT_STEP_MODEL:
                got, text = _short_step(sharded, tokens[:3])
                report["expert_logits"][f"{layout}/short"] = [float(np.abs(got - short_logits).max()),
                                                              float(np.abs(short_logits).max())]
                report["expert_collectives"][layout] = count_collectives(text)
                report["expert_n_layer"][layout] = sharded.cfg.n_layer

    model = models[ENGINE_MODEL]
    rng = np.random.default_rng(0)
    # The last two: the model's first greedy token follows the prompt's last one earlier in the prompt (486 71;
    # 472 27), so the n-gram lookup drafts (wrongly) after it.
    prompts = [tuple(int(t) for t in rng.integers(0, 500, 9)),
               (43, 486, 71, 486, 480, 486, 385, 486, 344, 486, 32, 486, 419, 486, 92, 486),
               (354, 472, 27, 472, 54, 472, 66, 472, 214, 472, 5, 472, 221, 472, 337, 472)]
    report["prompts"], report["references"] = prompts, [plain_greedy(model, p, MAX_TOKENS) for p in prompts]
    # Next turns: each prompt, its greedy answer and one more token, which start from the first round's cached state.
    next_turns = [p + tuple(r) + (7,) for p, r in zip(prompts, report["references"], strict=True)]
    report["next_turn_references"] = [plain_greedy(model, p, MAX_TOKENS) for p in next_turns]
    # Every request at once, in steps of one compiled batch size: few shapes to compile. The step executables are
    # kept on disk (`executor.executables`), for the second engine below.
    store = executables.keep_executables(folder / "steps")
    groups, n = EXPERT_ENGINE_LAYOUT
    engine_args = dict(**{**ENGINE, "max_running": 16, "budget_bytes": 4 << 20}, row_buckets=(16,), adaptive=False,
                       max_call_seconds=None, tensor_parallel=n, expert_parallel=groups, prefix_cache=True)
    engine = Engine(model, **engine_args)
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

    report["engine"], report["next_turns"] = _serve_all(engine, prompts, SPECS, next_turns)
    report["state_kept_sharding"] = _same_placement(runtime.state, placed)

    # A second engine of the same layout on the model loaded again, with no jitted call in memory (as a restarted
    # server): its sharded steps come from the store.
    saved = store.counts.saved
    runtime_module._compiled = functools.lru_cache(maxsize=None)(runtime_module._compiled.__wrapped__)
    again = Engine(load_model(paths[ENGINE_MODEL]), **engine_args)
    again.iterations = 4
    report["stored_engine"] = _serve_all(again, prompts, ["plain", "mtp-snapshot"], [])[0]
    report["stored_counts"] = {"saved_first": saved, "shapes_again": len(again.runtime._executables),
                               **dataclasses.asdict(store.counts)}
    return report


def _serve_all(engine, prompts, labels, next_turns) -> tuple[dict, list]:
    """Every prompt under each of labels (keys of SPECS) through engine at once: per label, per prompt, the tokens,
    the rollback steps and the tokens drafted; then the next_turns at once, plain: their tokens and the prompt
    tokens each took from the prefix cache."""
    import anyio

    from jaxmodel.requests import SpeculativeConfig
    from scheduler import DoneEvent, GenerationRequest, TokensEvent

    async def collect(request):
        out, done = [], None
        async for event in engine.generate(request):
            if isinstance(event, TokensEvent):
                out += event.token_ids
            elif isinstance(event, DoneEvent):
                done = event
        return out, dict(done.rollback_steps), sum(s.drafted for s in done.drafters.values()), done.cached_tokens

    async def main():
        results = {label: [None] * len(prompts) for label in labels}
        again = [None] * len(next_turns)

        async def next_turn(i):
            tokens, _, _, cached = await collect(GenerationRequest(next_turns[i], MAX_TOKENS))
            again[i] = (tokens, cached)

        async def run(label, i):
            spec = SPECS[label] and SpeculativeConfig(SPECS[label][0], n_max=SPECS[label][1], rollback=SPECS[label][2])
            results[label][i] = (await collect(GenerationRequest(prompts[i], MAX_TOKENS, speculative=spec)))[:3]

        async with engine:
            async with anyio.create_task_group() as group:
                for label in labels:
                    for i in range(len(prompts)):
                        group.start_soon(run, label, i)
            async with anyio.create_task_group() as group:
                for i in range(len(next_turns)):
                    group.start_soon(next_turn, i)
        return results, again

    return anyio.run(main)


def _short_step(model, tokens: list[int]):
    """The logits [T, V] of a few tokens (so few that the routed experts are read by index, not grouped) through
    the forward step `Model.score` runs, compiled ahead (`lower`), and that step's HLO text."""
    import numpy as np

    from jaxmodel.state import Row, pack_batch

    state = model.new_state(n_pages=2, n_planes=3)
    batch = pack_batch([Row(tokens, 0, [1], 0, [-1] * (len(tokens) - 1) + [1], range(len(tokens)))])
    compiled = model.step.lower(model.weights, batch=batch, state=state).compile()
    out, _ = compiled(model.weights, batch=batch, state=state)
    return np.asarray(out.logits[0, : len(tokens)]), compiled.as_text()


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
def report(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    folder = tmp_path_factory.mktemp("q4_0")
    done = subprocess.run([sys.executable, __file__, str(folder)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=root)
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


def test_ffn_columns_deal_whole_blocks_as_evenly_as_they_go_and_pad_the_rest():
    """An FFN's hidden columns per device: whole blocks of the down projection, zero columns (-1) where a device
    gets fewer, so every device holds the same width."""
    assert ffn_columns(512, 2, 256) == [list(range(256)), list(range(256, 512))]
    assert ffn_columns(512, 4, 256) == [list(range(256)), list(range(256, 512)), [-1] * 256, [-1] * 256]
    assert ffn_columns(96, 2, 32) == [list(range(64)), list(range(64, 96)) + [-1] * 32]
    assert ffn_columns(128, 4) == [list(range(32 * d, 32 * d + 32)) for d in range(4)]  # float: no padding
    assert ffn_columns(6, 4) == [[0, 1], [2, 3], [4, -1], [5, -1]]


def test_expert_parallelism_needs_experts_that_divide():
    """The tiny qwen3next's 4 experts split over 2 and 4 groups, not 8; a dense model has none to split."""
    moe = from_gguf(open_gguf(str(DATA / "tiny-qwen3next.gguf")))
    check_experts_divide(moe, 4)
    with pytest.raises(ValueError, match="4 experts do not split over 8 groups"):
        check_experts_divide(moe, 8)
    with pytest.raises(ValueError, match="has no routed experts"):
        check_experts_divide(from_gguf(open_gguf(str(DATA / "tiny-qwen35-mtp.gguf"))), 2)


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
    """Plain decoding and drafting (MTP with snapshot, checkpoint and replay rollback, n-gram lookup) on 4 devices,
    the routed experts in two groups of two tensor-parallel devices, give the tokens plain greedy decoding gives on
    one, fifteen requests at once; the state keeps its placement."""
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


def test_sharded_next_turns_start_from_the_prefix_cache_and_decode_plain_greedy(report):
    """The sharded engine with the prefix cache: after the first round, each prompt's next turn (the prompt, its
    answer and one token more) starts from a cached state, a copy of the sharded planes and pages, and decodes one
    device's plain greedy tokens."""
    for (tokens, cached), want in zip(report["next_turns"], report["next_turn_references"], strict=True):
        assert tokens == want
        assert cached > 0
    assert report["state_kept_sharding"] == []


def test_a_second_sharded_engine_loads_the_stored_steps_and_decodes_the_same(report):
    """The sharded engine's step executables, saved as it compiled them, are what a second engine of the same layout
    runs (loaded, none compiled), and its plain and MTP rows give one device's plain greedy tokens."""
    counts = report["stored_counts"]
    assert counts["saved_first"] > 0 and counts["saved"] == counts["saved_first"]
    assert counts["hits"] == counts["shapes_again"] > 0 and counts["unreadable"] == 0
    for label, outs in report["stored_engine"].items():
        assert [tokens for tokens, _, _ in outs] == report["references"], label


def test_pallas_kernels_run_per_shard(report):
    """The GPU's Pallas kernels (the fused GDN decode kernel, paged attention; interpreted on CPU) inside the
    sharded blocks, each on its shard's heads: one device's logits within the float tolerance."""
    assert report["pallas_kernels"] == {"gdn_decode": True, "paged_attention": True}
    difference, scale = report["pallas_logits"]
    assert difference <= LOGITS_TOLERANCE, (difference, scale)


def test_block_quantized_logits_match_one_device(report):
    """Block-quantized models on 2 and 4 devices give one device's logits within 1e-5 (these machines give the same
    bits): no block is split, so each block's product, the activation's quantization included, is one device's."""
    assert set(report["block_logits"]) == {f"{name}/{n}" for name in BLOCK_MODELS for n in LAYOUTS}
    for layout, (difference, scale) in report["block_logits"].items():
        assert difference <= BLOCK_LOGITS_TOLERANCE, (layout, difference, scale)


def test_block_weights_are_split_along_their_blocks_not_dequantized(report):
    """Each device holds its share of the file's blocks: no float matrix appears that one device does not hold (the
    Q4_K_M target's float embedding tables are the file's own), and the first device's bytes shrink with the
    devices; products that share an input stay fused, each device's parts side by side. Where heads are narrower
    than a block, GDN out is held whole (the tiny models' 16-input heads in 32-input Q4_0 blocks: at 2 devices
    the tiny qwen35's tiled heads, at 4 both models'; the tiny qwen3next's out at 2 keeps the file's head order,
    each device's heads whole blocks). FFN widths pad to whole blocks only where they must: the Q4_K_M target's
    512 down-projection inputs (two 256-input blocks) at 4 devices."""
    layouts = report["block_layout"]
    for layout, laid in layouts.items():
        assert laid["kept"] > 0 and laid["float_matrices"] == laid["one_device_float"], (layout, laid)
        assert laid["fused"] == laid["one_device_fused"] > 0, (layout, laid)  # fused on each device as on one
    q4_k_m = "bundled-target-q4_k_m"
    assert not layouts[f"{q4_k_m}/2"]["gathered"] and not layouts[f"{q4_k_m}/4"]["gathered"]
    assert layouts[f"{q4_k_m}/2"]["padding_bytes"] == 0 < layouts[f"{q4_k_m}/4"]["padding_bytes"]
    for name in BLOCK_MODELS:
        one = layouts[f"{name}/2"]["one_device_bytes"]
        two, four = (layouts[f"{name}/{n}"]["device_bytes"] for n in LAYOUTS)
        assert four < two < 0.75 * one, (name, one, two, four)
    gathered = {layout: len(laid["gathered"]) for layout, laid in layouts.items() if "q4_0" in layout}
    assert gathered == {"tiny-qwen35-mtp-q4_0/2": 3, "tiny-qwen35-mtp-q4_0/4": 3, "tiny-qwen3next-q4_0/2": 0,
                        "tiny-qwen3next-q4_0/4": 3}, gathered


def test_expert_parallel_logits_match_one_device(report):
    """Routed experts split over 2 and 4 groups (alone, and with tensor parallelism in each group), for steps of
    many tokens (grouped expert products) and, on the tiny qwen3next, of few (gathered)."""
    want = {f"{name}/ep{groups}xtp{n}{label}" for name, layouts in EXPERT_LAYOUTS.items() for groups, n in layouts
            for label in ("", "/short") if not label or name == SHORT_STEP_MODEL}
    assert set(report["expert_logits"]) == want
    for layout, (difference, scale) in report["expert_logits"].items():
        assert difference <= LOGITS_TOLERANCE, (layout, difference, scale)


def test_expert_parallelism_adds_one_all_reduce_per_moe_layer_and_no_all_to_all(report):
    """The tiny qwen3next's forward. Experts alone (tp 1): one all-reduce per MoE layer (every layer) and nothing
    else. With
    tensor parallelism: the experts' sum is the FFN's own all-reduce, over both axes, so the count is tensor
    parallelism's."""
    for layout, counts in report["expert_collectives"].items():
        counts, n_layer = dict(counts), report["expert_n_layer"][layout]
        if layout.endswith("xtp1"):
            assert counts.pop("all-reduce") == n_layer, (layout, counts)
        else:
            assert counts.pop("all-reduce") == 1 + 2 * n_layer, (layout, counts)
            assert counts.pop("all-gather") == 1, (layout, counts)
        assert not any(counts.values()), (layout, counts)


@long_test
def test_two_processes_serve_a_request_as_one_does_and_end_when_a_follower_dies(report, tmp_path):
    """Two processes on loopback (`jax.distributed`, gloo CPU collectives), one host device each, one mesh of two
    (tensor parallel 2) over a block-quantized model: both warm up (`--warmup-first`: every step shape run once and
    the policy's calibration, in lockstep, before they meet), then process 0 serves a request over the websocket
    with the tokens one device's plain greedy decoding gives; then the follower is killed, and process 0 ends with
    FOLLOWER_GONE_EXIT and a line naming it rather than waiting on its collectives. One iteration per call, the
    fewest step shapes; drafting through the sharded step is checked on one process above."""
    import anyio

    from api.client import Client

    from jaxmodel.multiprocess import FOLLOWER_GONE_EXIT

    model_path = report["paths"][ENGINE_MODEL]
    prompt, want = report["prompts"][1], report["references"][1]  # one device's plain greedy tokens
    coordinator, port = free_port(), free_port()
    root = Path(__file__).parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GDNSPEC_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)  # one host device each
    command = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_path), "--tensor-parallel", "2",
               "--num-processes", "2", "--coordinator", f"127.0.0.1:{coordinator}", "--port", str(port),
               "--budget-mb", "4", "--max-seqs", "2", "--max-model-len", "64", "--default-drafters", "none",
               "--iterations", "1", "--warmup-first"]
    processes = [subprocess.Popen(command + ["--process-id", str(i)], env=env, cwd=root, text=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    try:
        wait_listening(port, processes, time.monotonic() + 300)

        async def generate():
            with anyio.fail_after(120):
                return await _generate()

        async def _generate():
            async with Client(f"ws://127.0.0.1:{port}") as client:
                stream = await client.generate(None, prompt_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
                tokens, done = [], None
                async for frame in stream:
                    if frame.__class__.__name__ == "Tokens":
                        tokens += frame.token_ids
                    else:
                        done = frame
                return tokens, done.finish_reason

        tokens, finish_reason = anyio.run(generate)
        assert finish_reason == "length" and tokens == want, (finish_reason, tokens, want)

        processes[1].send_signal(signal.SIGKILL)
        assert processes[0].wait(timeout=60) == FOLLOWER_GONE_EXIT
        log = processes[0].stderr.read()
        assert "follower process 1 ended" in log and "step shapes ready" in log, log[-4000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


if __name__ == "__main__":
    print(json.dumps(_checks(Path(sys.argv[1]))))
