"""qwen3next through the engine behind the websocket server: greedy speculative decoding with every drafter (MTP,
n-gram, a draft model) and every rollback mode, many sequences at once, equals plain greedy decoding."""

from __future__ import annotations

import dataclasses

import anyio
import msgspec
import numpy as np
import pytest
from conftest import DATA, plain_greedy

from api.client import Client
from api.protocol import Defaults, Limits, ServerSettings, Speculative
from api.server import Server, listening
from jaxmodel import Model, load_model
from jaxmodel.gguf_io import read_gguf
from jaxmodel.tokenizer import load_tokenizer
from scheduler import Engine

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


ENGINE = dict(budget_bytes=700_000, max_running=4, max_model_len=48, chunk_size=16, n_max=3, adaptive=False)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(NEXT)


@pytest.fixture(scope="module")
def references(target, prompts, tokenizer):
    return {p: plain_greedy(target, p, MAX_TOKENS, tokenizer.eog_ids) for p in prompts}


def test_server_is_lossless_for_every_drafter_and_rollback_mode(target, draft, prompts, references, tokenizer):
    """8 requests over one websocket, at most 4 running (drafters MTP, n-gram, the draft model and none; snapshot,
    checkpoint, replay and auto), and one text prompt asking for the server's default drafter. The random MTP
    head's drafts are almost never right (p_min 0, where the server's default would stop them); the draft model's
    often are, so rollbacks after partial acceptance happen in every mode. Every request streams plain greedy's
    tokens (and, for the text prompt, their text), and the engine ends with every page and plane free."""
    settings = ServerSettings(
        defaults=Defaults(drafters=("mtp",), max_tokens=MAX_TOKENS, n_max=3),
        limits=Limits(max_prompt_tokens=40, max_max_tokens=24, max_in_flight=16,
                      known_drafters=("ngram", "mtp", "draft_model"), vocab_size=target.cfg.n_vocab),
    )  # fmt: skip
    drafter_sets = [None, ("mtp",), ("ngram",), ("draft_model",)]
    modes = ["snapshot", "checkpoint", "replay", "auto"]
    jobs = []
    for i in range(8):
        drafters = drafter_sets[i % len(drafter_sets)]
        spec = (Speculative(drafters=list(drafters), n_max=3, p_min=0.0, rollback=modes[(i + i // 4) % 4])
                if drafters else None)
        jobs.append((prompts[i % len(prompts)], spec))
    text = "a b a b a b"
    text_expected = plain_greedy(target, tokenizer.encode(text), MAX_TOKENS, tokenizer.eog_ids)
    results = {}

    async def main():
        # One batch size compiled (steps of fewer rows pad to it): the point is the drafters, not the shapes.
        engine = Engine(target, tokenizer=tokenizer, draft_model=draft, token_budget=48, row_buckets=(4,), **ENGINE)
        free = (engine.memory.free_pages, engine.memory.free_planes)
        async with engine, listening(Server(engine, tokenizer, settings)) as (url, _):
            async with Client(url) as client:
                async def run(i, prompt, spec):
                    await anyio.sleep(0.01 * (i % 4))
                    stream = await client.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, speculative=spec)
                    results[i] = await stream.collect()

                async def run_text():
                    results["text"] = await (await client.generate(text, max_tokens=MAX_TOKENS)).collect()

                async with anyio.create_task_group() as tg:
                    for i, (prompt, spec) in enumerate(jobs):
                        tg.start_soon(run, i, prompt, spec)
                    tg.start_soon(run_text)
        assert (engine.memory.free_pages, engine.memory.free_planes) == free

    anyio.run(main)
    steps = {"snapshot": 0, "checkpoint": 0, "replay": 0}
    drafted, accepted = {}, {}
    for i, (prompt, spec) in enumerate(jobs):
        result = results[i]
        assert list(result.token_ids) == references[prompt], f"job {i}: {spec}"
        rollback = msgspec.structs.asdict(result.spec.rollback)
        for mode, n in rollback.items():
            steps[mode] += n
        if spec is not None and spec.rollback != "auto":
            assert sum(rollback.values()) == rollback[spec.rollback], (i, rollback)
        for name, stats in result.spec.drafters.items():
            drafted[name] = drafted.get(name, 0) + stats.drafted
            accepted[name] = accepted.get(name, 0) + stats.accepted
    assert all(n > 0 for n in steps.values()), (steps, drafted)
    assert all(drafted.get(name, 0) > 0 for name in ("mtp", "ngram", "draft_model")), drafted
    assert 0 < accepted["draft_model"] < drafted["draft_model"], (accepted, drafted)
    assert list(results["text"].token_ids) == text_expected
    assert results["text"].text == tokenizer.decode(text_expected)
