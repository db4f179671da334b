"""Replicas: engines of one model serving side by side (scheduler/replicas.py). Requests spread over the engines,
every sequence's tokens stay its plain greedy decode (a row's tokens do not depend on the engine whose batch it
shares), and the server's limits and counts cover all the engines."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import numpy as np
import pytest
from conftest import ENGINE, plain_greedy
from test_engine import collect, collect_staggered
from test_server import SETTINGS

from api.client import Client
from api.server import Server, listening
from jaxmodel.requests import SpeculativeConfig
from scheduler import Engine, GenerationRequest, Replicas

MAX_TOKENS = 12


def two_engines(model, **options) -> Replicas:
    # ENGINE's sizes for each, so that their steps are the shapes the other modules compiled.
    return Replicas([Engine(model, **ENGINE, **options) for _ in range(2)])


def test_requests_spread_over_the_engines_and_stay_lossless(model):
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(0, 509, n)) for n in (4, 11, 19, 27, 6, 15)]
    prompts += [tuple([7, 8, 9, 10] * 5)]
    references = {p: plain_greedy(model, p, MAX_TOKENS) for p in prompts}
    drafter_sets = [None, ("mtp",), ("ngram",), ("ngram", "mtp")]
    modes = ["auto", "snapshot", "checkpoint", "replay"]
    jobs = []
    for i in range(14):
        prompt, drafters = prompts[i % len(prompts)], drafter_sets[i % len(drafter_sets)]
        spec = SpeculativeConfig(drafters, n_max=2 + i % 3, rollback=modes[i // 4 % 4]) if drafters else None
        jobs.append(GenerationRequest(prompt, MAX_TOKENS, speculative=spec))
    replicas = two_engines(model, adaptive=False)
    free = [(e.memory.free_pages, e.memory.free_planes) for e in replicas.engines]

    async def main():
        async with replicas:
            return await collect_staggered(replicas, [(request, 0.01 * (i % 3)) for i, request in enumerate(jobs)])

    results = anyio.run(main)
    for i, (request, (tokens, done, _)) in enumerate(zip(jobs, results)):
        assert tokens == references[request.prompt_ids], f"job {i}: {request.speculative}"
        assert done.finish_reason == "length"
    assert all(engine.steps > 0 for engine in replicas.engines)  # both served
    assert replicas.steps == sum(engine.steps for engine in replicas.engines)
    assert [(e.memory.free_pages, e.memory.free_planes) for e in replicas.engines] == free


def sent_one_by_one(replicas: Replicas, n: int) -> list[tuple[tuple[int, ...], int]]:
    """Each engine's requests in flight and the requests waiting, after each of n requests is sent in turn to engines
    that are not running (so requests stay where they were sent)."""

    async def drain(stream):
        async for _ in stream:
            pass

    async def main():
        seen = []
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(drain, replicas.generate(GenerationRequest((5, 6, 7), 4)))
                await anyio.wait_all_tasks_blocked()
                seen.append((tuple(engine.n_in_flight for engine in replicas.engines), replicas.load().waiting))
            tg.cancel_scope.cancel()
        return seen

    return anyio.run(main)


def test_a_request_goes_to_the_engine_with_the_fewest_in_flight(model):
    assert sent_one_by_one(two_engines(model), 3) == [((1, 0), 0), ((1, 1), 0), ((2, 1), 0)]


def test_a_request_goes_to_the_engine_that_cached_the_start_of_its_prompt(model):
    """Of the engines with a free row, the one whose prefix cache holds the longest start of the prompt (a
    conversation's next turn goes where its last turn's state is), however busy; without one, the least busy."""
    from scheduler.prefix_cache import CachedPrefix, chain_hashes

    replicas = Replicas([Engine(model, prefix_cache=True, **ENGINE) for _ in range(2)])
    first, second = replicas.engines
    turn = tuple(range(1, 40))
    scheduler, memory = second.scheduler, second.memory
    pages = memory.take_pages(3)
    scheduler.prefix_cache.put(CachedPrefix(turn[:36], memory.take_planes(1)[0], tuple(pages)),
                               chain_hashes(turn, memory.page_size))
    assert replicas.least_busy(turn) is second and replicas.least_busy(turn[:36]) is first
    assert second.scheduler.cached_length(turn) == 36 and first.scheduler.cached_length(turn) == 0
    assert replicas.least_busy(tuple(range(50, 90))) is first  # no cached start: the most free pages


def test_requests_beyond_the_rows_wait_in_one_queue(model):
    # One row each: the third request holds no engine's row, and waits in the replicas' queue, counted as waiting.
    replicas = Replicas([Engine(model, **{**ENGINE, "max_running": 1}) for _ in range(2)])
    assert sent_one_by_one(replicas, 3) == [((1, 0), 0), ((1, 1), 0), ((1, 1), 1)]


def test_a_waiting_request_takes_the_first_row_to_free(model):
    """One row per engine: a long request on the first, a short one on the second; a third request must run on the
    second as soon as the short one ends, not queue behind the long one on the engine it would have been sent to
    when it arrived."""
    replicas = Replicas([Engine(model, **{**ENGINE, "max_running": 1}) for _ in range(2)])
    for engine in replicas.engines:
        engine.iterations = 1  # one token a step: the long request takes many steps
    ended = []

    async def run(name, request):
        tokens, done, _ = await collect(replicas, request)
        assert done.finish_reason == "length" and len(tokens) == request.max_tokens
        ended.append(name)

    async def main():
        async with replicas, anyio.create_task_group() as tg:
            for name, max_tokens in (("long", 48), ("short", 2), ("third", 2)):  # they arrive in this order
                tg.start_soon(run, name, GenerationRequest((11, 12, 13), max_tokens))

    anyio.run(main)
    assert ended == ["short", "third", "long"]


def test_leaving_a_stream_cancels_the_request_on_its_engine(model):
    replicas = two_engines(model)
    for engine in replicas.engines:
        engine.iterations = 1  # one event per step, to leave mid-way
    free = [(e.memory.free_pages, e.memory.free_planes) for e in replicas.engines]

    async def main():
        async with replicas:
            seen = []
            async with aclosing(replicas.generate(GenerationRequest((11, 12, 13, 14), 40))) as events:
                async for event in events:
                    seen.append(event)
                    if len(seen) == 2:
                        break
            in_flight = [engine.n_in_flight for engine in replicas.engines]
            tokens, done, _ = await collect(replicas, GenerationRequest((5, 6, 7), 4))
            assert done.finish_reason == "length" and len(tokens) == 4
        return seen, in_flight

    seen, in_flight = anyio.run(main)
    assert len(seen) == 2 and in_flight == [0, 0]
    assert [(e.memory.free_pages, e.memory.free_planes) for e in replicas.engines] == free


def test_build_shares_the_budget_and_the_rows(model):
    replicas = Replicas.build(model, 2, budget_bytes=1_400_000, max_running=6, max_model_len=64, chunk_size=16,
                              token_budget=48, n_max=6)  # fmt: skip
    single = Engine(model, budget_bytes=700_000, max_running=3, max_model_len=64, chunk_size=16, token_budget=48,
                    n_max=6)  # fmt: skip
    for engine in replicas.engines:
        assert engine.max_running == 3
        assert engine.runtime.shapes.row_buckets == (1, 3)  # three rows, not padded to 4
        assert engine.memory.usable_pages == single.memory.usable_pages
    assert replicas.max_running == 6 and replicas.max_model_len == 64
    load = replicas.load()
    assert load.pages_total == 2 * single.memory.usable_pages and load.planes_total == 2 * single.memory.usable_planes
    assert (load.running, load.waiting) == (0, 0)
    with pytest.raises(ValueError, match="at least one"):
        Replicas.build(model, 0)
    with pytest.raises(ValueError, match="no engines"):
        Replicas([])


def test_the_server_serves_replicas_and_counts_all_their_memory(model, tokenizer):
    prompts = ["import os\n", "class A:", "for i in range(10):", "x = 1\ny = 2\n"]
    expected = {p: plain_greedy(model, tokenizer.encode(p), 10, tokenizer.eog_ids) for p in prompts}
    replicas = Replicas([Engine(model, tokenizer=tokenizer, **ENGINE) for _ in range(2)])

    async def main():
        results = {}
        async with replicas, listening(Server(replicas, tokenizer, SETTINGS)) as (url, _):
            async with Client(url) as client:
                async def one(p):
                    results[p] = await (await client.generate(p, max_tokens=10)).collect()

                async with anyio.create_task_group() as tg:
                    for p in prompts:
                        tg.start_soon(one, p)
                stats = await client.stats()
        return results, stats

    results, stats = anyio.run(main)
    for p in prompts:
        assert list(results[p].token_ids) == expected[p], p
    assert stats.pages_total == sum(e.memory.usable_pages for e in replicas.engines)
    assert stats.pages_free == stats.pages_total and stats.planes_free == stats.planes_total
    assert stats.steps == replicas.steps > 0
    assert all(engine.steps > 0 for engine in replicas.engines)
