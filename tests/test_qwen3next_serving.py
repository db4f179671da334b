"""qwen3next through the engine and the websocket server: greedy speculative decoding with every drafter (MTP,
n-gram, a draft model) and both rollback modes, many sequences at once, equals plain greedy decoding."""

from __future__ import annotations

import dataclasses

import anyio
import numpy as np
import pytest
from conftest import DATA, plain_greedy
from test_engine import collect

from api.client import Client
from api.protocol import Defaults, Limits, ServerSettings, Speculative
from api.server import Server, listening
from drafters.policy import SpeculativeConfig
from jaxmodel import Model, load_model
from jaxmodel.gguf_io import read_gguf
from jaxmodel.tokenizer import load_tokenizer
from scheduler import Engine, GenerationRequest

NEXT = DATA / "tiny-qwen3next.gguf"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def target():
    return load_model(NEXT)


@pytest.fixture(scope="module")
def draft():
    """The target's trunk with its output head perturbed: same vocabulary and architecture, drafts often but
    not always right."""
    cfg, weights, _ = read_gguf(NEXT, load_mtp=False)
    rng = np.random.default_rng(0)
    noisy = weights.output * (1 + 0.2 * rng.standard_normal(weights.output.shape).astype(np.float32))
    return Model(cfg, dataclasses.replace(weights, output=noisy))


@pytest.fixture(scope="module")
def prompts(target):
    rng = np.random.default_rng(3)
    random = [tuple(int(t) for t in rng.integers(0, 509, n)) for n in (4, 11, 19, 7)]
    # n-gram material: A, A's greedy continuation, A again; for these A the target then repeats that
    # continuation, so the n-gram drafter finds matches (a random model's output rarely repeats otherwise).
    repeating = [a + tuple(plain_greedy(target, a, 6)) + a for a in ((40, 152, 244, 215), (37, 475, 270, 182))]
    return [repeating[0], random[0], repeating[1], *random[1:]]  # the n-gram jobs (2 and 6) get the repeats


@pytest.fixture(scope="module")
def references(target, prompts):
    return {p: plain_greedy(target, p, MAX_TOKENS) for p in prompts}


# Both tests' engines have the same shapes and pools, so the second can reuse the first one's compiled steps.
ENGINE = dict(budget_bytes=700_000, max_running=4, max_model_len=48, chunk_size=16, n_max=3, adaptive=False)


def test_engine_is_lossless_for_every_drafter_and_rollback_mode(target, draft, prompts, references):
    """8 sequences, at most 4 running (drafters MTP, n-gram, the draft model and none; snapshot, checkpoint,
    replay and auto). The random MTP head's drafts are almost never right; the draft model's often are, so
    rollbacks after partial acceptance happen in every mode."""
    drafter_sets = [None, ("mtp",), ("ngram",), ("draft_model",)]
    modes = ["snapshot", "checkpoint", "replay", "auto"]
    jobs = []
    for i in range(8):
        prompt = prompts[i % len(prompts)]
        drafters = drafter_sets[i % len(drafter_sets)]
        spec = SpeculativeConfig(drafters, n_max=3, rollback=modes[(i + i // 4) % 4]) if drafters else None
        jobs.append((prompt, GenerationRequest(prompt, MAX_TOKENS, speculative=spec)))
    results = {}

    async def main():
        engine = Engine(target, draft_model=draft, token_budget=48, **ENGINE)
        free = (engine.memory.free_pages, engine.memory.free_planes)
        async with engine:
            async def run(i, request):
                await anyio.sleep(0.01 * (i % 4))
                results[i] = await collect(engine, request)

            async with anyio.create_task_group() as tg:
                for i, (_, request) in enumerate(jobs):
                    tg.start_soon(run, i, request)
        assert (engine.memory.free_pages, engine.memory.free_planes) == free

    anyio.run(main)
    steps = {"snapshot": 0, "checkpoint": 0, "replay": 0}
    drafted, accepted = {}, {}
    for i, (prompt, request) in enumerate(jobs):
        tokens, done, _ = results[i]
        assert tokens == references[prompt], f"job {i}: {request.speculative}"
        for mode, n in done.rollback_steps.items():
            steps[mode] += n
        for name, stats in done.drafters.items():
            drafted[name] = drafted.get(name, 0) + stats.drafted
            accepted[name] = accepted.get(name, 0) + stats.accepted
    assert all(n > 0 for n in steps.values()), (steps, drafted)
    assert all(drafted.get(name, 0) > 0 for name in ("mtp", "ngram", "draft_model")), drafted
    assert 0 < accepted["draft_model"] < drafted["draft_model"], (accepted, drafted)


def test_server_streams_plain_greedy_for_every_drafter_and_every_mode(target, draft):
    tokenizer = load_tokenizer(NEXT)
    settings = ServerSettings(
        defaults=Defaults(drafters=("mtp",), max_tokens=MAX_TOKENS, n_max=3),
        limits=Limits(max_prompt_tokens=40, max_max_tokens=24, max_in_flight=16,
                      known_drafters=("ngram", "mtp", "draft_model"), vocab_size=target.cfg.n_vocab),
    )  # fmt: skip
    prompts = ["a b a b a b"]
    expected = {p: plain_greedy(target, tokenizer.encode(p), MAX_TOKENS, tokenizer.eog_ids) for p in prompts}
    # Every drafter once over the wire, the modes alternating (the engine test above covers every pair).
    specs = [None] + [Speculative(drafters=list(d), n_max=3, rollback=mode)
                      for d, mode in ((["mtp"], "snapshot"), (["ngram"], "checkpoint"), (["draft_model"], "replay"),
                                      (["mtp"], "checkpoint"))]  # fmt: skip

    async def main():
        engine = Engine(target, tokenizer=tokenizer, draft_model=draft, token_budget=48, **ENGINE)
        out = {}
        async with engine, listening(Server(engine, tokenizer, settings)) as (url, _):
            async with Client(url) as client:
                async def one(prompt, spec, key):
                    stream = await client.generate(prompt, max_tokens=MAX_TOKENS, speculative=spec)
                    out[key] = (prompt, await stream.collect())

                async with anyio.create_task_group() as tg:
                    for p in prompts:
                        for j, spec in enumerate(specs):
                            tg.start_soon(one, p, spec, (p, j))
        return out

    out = anyio.run(main)
    assert len(out) == len(prompts) * len(specs)
    for prompt, result in out.values():
        assert list(result.token_ids) == expected[prompt], prompt
        assert result.text == tokenizer.decode(expected[prompt])
