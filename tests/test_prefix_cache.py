"""The prefix cache (`scheduler.prefix_cache`): a conversation's next turn starts from the state its previous turn
finished with, requests sharing a system prompt start from the state at its end, and both decode exactly what a
full prefill would (plain greedy), for every drafter and rollback mode, with requests running at once and under a
budget small enough that cached states are evicted; what the cache holds comes back when it is dropped."""

import anyio
import numpy as np
import pytest

from api.client import Client
from api.protocol import Defaults, Limits, ServerSettings
from api.server import Server, listening
from bench.prefix_cache import corpus_ids, run_conversations, summarize
from conftest import DATA, ENGINE, long_test, plain_greedy
from jaxmodel import load_model
from jaxmodel.requests import SpeculativeConfig
from jaxmodel.tokenizer import load_tokenizer
from scheduler import DoneEvent, Engine, GenerationRequest, TokensEvent

# The suite's engine with room for the cache's planes (10), shared by every test here (one set of compiled shapes).
CACHE_ENGINE = ENGINE | dict(budget_bytes=1_400_000)
USER_TURNS = ("def area(r):\n", "    return", "\n\nclass A:")
ANSWER = 8
_greedy: dict = {}


def greedy(model, tokenizer, prompt) -> list[int]:
    """`plain_greedy` of ANSWER tokens, computed once per model and prompt for the whole module."""
    key = (id(model), tuple(prompt))
    if key not in _greedy:
        _greedy[key] = plain_greedy(model, prompt, ANSWER, tokenizer.eog_ids)
    return _greedy[key]


async def converse(engine, first: str, tokenizer, speculative) -> list[tuple[list[int], list[int], DoneEvent]]:
    """Three turns, each prompt the conversation so far (prompts and answers) and a new message."""
    history, turns = [], []
    for k, text in enumerate((first,) + USER_TURNS[1:]):
        prompt = history + tokenizer.encode(text if k else first)
        answer, done = [], None
        async for event in engine.generate(GenerationRequest(tuple(prompt), ANSWER, speculative=speculative)):
            if isinstance(event, TokensEvent):
                answer += event.token_ids
            else:
                done = event
        turns.append((prompt, answer, done))
        history = prompt + answer
    return turns


def run(model, tokenizer, speculative, firsts, **engine_options):
    async def main():
        engine = Engine(model, tokenizer=tokenizer, prefix_cache=True, **(CACHE_ENGINE | engine_options))
        results = [None] * len(firsts)
        async with engine:
            async def one(i):
                results[i] = await converse(engine, firsts[i], tokenizer, speculative)

            async with anyio.create_task_group() as tg:
                for i in range(len(firsts)):
                    tg.start_soon(one, i)
        return engine, results

    return anyio.run(main)


def check_lossless(model, tokenizer, results):
    for conversation in results:
        for prompt, answer, done in conversation:
            assert done.finish_reason in ("stop", "length"), done
            assert answer == greedy(model, tokenizer, prompt), prompt


@pytest.mark.parametrize("drafters,rollback", [(None, None), (("ngram",), "snapshot"), (("mtp",), "checkpoint"),
                                               (("mtp", "ngram"), "replay"), (("mtp",), "auto")])
def test_a_next_turn_takes_over_the_last_turns_state_and_decodes_plain_greedy(model, tokenizer, drafters, rollback):
    speculative = SpeculativeConfig(drafters, n_max=3, rollback=rollback) if drafters else None
    engine, results = run(model, tokenizer, speculative, ["import os\n", "def f(x):\n"])
    check_lossless(model, tokenizer, results)
    for conversation in results:
        for (prompt, answer, _), (_, _, done) in zip(conversation, conversation[1:]):
            # the last turn computed its prompt and all but its last answer token
            assert done.cached_tokens == len(prompt) + len(answer) - 1
        assert conversation[0][2].cached_tokens == 0
    scheduler = engine.scheduler
    assert scheduler.prefix_hits == 4
    check_memory(engine)


def check_memory(engine):
    """All memory not free is held by the cache, and is free once the cache is dropped."""
    memory, cache = engine.memory, engine.scheduler.prefix_cache
    load = engine.load()
    assert (load.cached_prefixes, load.cached_pages, load.cached_planes) == (len(cache), cache.pages, cache.planes)
    assert memory.free_pages + cache.pages == memory.usable_pages
    assert memory.free_planes + cache.planes == memory.usable_planes
    engine.scheduler.clear_prefix_cache()
    assert (memory.free_pages, memory.free_planes) == (memory.usable_pages, memory.usable_planes)


SYSTEM_TOKENS = 34  # two blocks of 16 and two tokens: prompts starting with it part at position 32


@pytest.mark.parametrize("drafters,rollback", [(None, None), (("mtp", "ngram"), "replay")])
def test_requests_sharing_a_system_prompt_start_from_its_state(model, tokenizer, drafters, rollback):
    """A system prompt of two blocks and then some: the first two requests compute it and keep the state at its
    blocks' end; the four that follow, arriving while those run, start there, sharing the first block's pages, and
    decode plain greedy."""
    speculative = SpeculativeConfig(drafters, n_max=3, rollback=rollback) if drafters else None
    system = tokenizer.encode("def main(argv):\n    parser = make_parser()\n    args = parser.parse(argv)\n" * 4)
    system = system[:SYSTEM_TOKENS]
    tails = [tokenizer.encode(text) for text in ("x = 1", "print(", "import sys", "# a", "return", "class")]
    prompts = [tuple(system + tail) for tail in tails]

    async def main():
        engine = Engine(model, tokenizer=tokenizer, prefix_cache=True, **CACHE_ENGINE)
        results, running = {}, anyio.Event()

        async def one(i):
            answer = []
            async for event in engine.generate(GenerationRequest(prompts[i], ANSWER, speculative=speculative)):
                if isinstance(event, TokensEvent):
                    answer += event.token_ids
                    if i == 1:
                        running.set()
                else:
                    results[i] = (answer, event)

        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
            await running.wait()
            for i in range(2, len(prompts)):
                tg.start_soon(one, i)
        return engine, results

    engine, results = anyio.run(main)
    for i, prompt in enumerate(prompts):
        answer, done = results[i]
        assert done.finish_reason in ("stop", "length")
        assert answer == greedy(model, tokenizer, prompt), prompt
        assert done.cached_tokens == (0 if i < 2 else 32)
    assert engine.scheduler.prefix_hits == len(prompts) - 2
    check_memory(engine)


def test_cached_prefixes_are_evicted_when_sequences_need_the_memory(model, tokenizer):
    """Four conversations at once, keeping two states a turn, more than the cache has planes for: cached states are
    evicted (least recently used first); the turns that still find theirs start there, and every answer is plain
    greedy."""
    firsts = ["import os\n", "def f(x):\n", "class B:\n", "x = ["]
    engine, results = run(model, tokenizer, SpeculativeConfig(("mtp",), n_max=3), firsts)
    check_lossless(model, tokenizer, results)
    assert engine.scheduler.prefix_evictions > 0 and engine.scheduler.prefix_hits > 0
    check_memory(engine)


@long_test
def test_a_qwen3next_next_turn_decodes_plain_greedy():
    """The same on qwen3next's tiny model (grouped value heads, its own MoE layers), drafting by n-gram lookup."""
    path = DATA / "tiny-qwen3next.gguf"
    target, tokenizer = load_model(path), load_tokenizer(path)
    engine, results = run(target, tokenizer, SpeculativeConfig(("ngram",), n_max=3), ["import os\n", "x = ["])
    check_lossless(target, tokenizer, results)
    assert engine.scheduler.prefix_hits == 4


def test_the_server_reports_cached_tokens_and_the_caches_counts(model, tokenizer):
    """Over loopback with `bench.prefix_cache`'s client: each turn resends the conversation so far (the earlier
    prompts and the server's answers) and a new message; a next turn's done frame counts the prompt tokens it took
    from the cache, and `stats` the cache's counts; the bench's summary sums each turn's tokens."""
    settings = ServerSettings(defaults=Defaults(drafters=(), max_tokens=4),
                              limits=Limits(max_prompt_tokens=63, max_max_tokens=64, known_drafters=("ngram", "mtp")))
    system, user, answer, turns = 10, 5, 4, 3

    async def main():
        engine = Engine(model, tokenizer=tokenizer, prefix_cache=True, **CACHE_ENGINE)
        async with engine, listening(Server(engine, tokenizer, settings)) as (url, _):
            results = await run_conversations(url, tokenizer, conversations=2, turns=turns, system_tokens=system,
                                              user_tokens=user, max_tokens=answer)
            async with Client(url) as client:
                return results, await client.stats()

    results, stats = anyio.run(main)
    assert len(results) == 2 and all(len(conversation) == turns for conversation in results)
    for conversation in results:
        expected = system
        for turn in conversation:
            expected += user
            assert turn["prompt_tokens"] == expected  # everything before it, then the new message
            assert 1 <= turn["answer_tokens"] <= answer and turn["ttft_ms"] > 0
            expected += turn["answer_tokens"]
        assert conversation[0]["cached_tokens"] == 0
        for before, turn in zip(conversation, conversation[1:]):
            assert turn["cached_tokens"] == before["prompt_tokens"] + before["answer_tokens"] - 1
            assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
    summary = summarize(results)
    assert [t["prompt_tokens"] for t in summary] == [sum(c[k]["prompt_tokens"] for c in results) for k in range(turns)]
    assert len(corpus_ids(tokenizer, 300, 1000)) == 300  # the corpus repeats as far as asked
    assert stats.cached_prefixes == stats.cached_planes >= 2 and stats.prefix_hits == 4
    assert stats.prefix_tokens == sum(turn["cached_tokens"] for conversation in results for turn in conversation)
    assert stats.pages_free + stats.cached_pages == stats.pages_total
    assert stats.planes_free + stats.cached_planes == stats.planes_total


@long_test
@pytest.mark.parametrize("drafters,rollback", [(("mtp",), "checkpoint"), (("mtp", "ngram"), "snapshot")])
def test_the_0_8b_preset_decodes_the_same_from_cached_states(drafters, rollback):
    """Qwen3.5-0.8B's shapes (24 layers, 19 MiB planes; random weights, no tokenizer): conversations of three turns
    sharing a system prompt, two at once, decode the same tokens with the prefix cache as without it, and the later
    turns start from cached states."""
    from jaxmodel.model import Model
    from jaxmodel.random_model import PRESETS, random_weights

    cfg = PRESETS["qwen35-0.8b"]
    model = Model(cfg, random_weights(cfg, seed=0))
    speculative = SpeculativeConfig(drafters, n_max=3, rollback=rollback)
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(100, cfg.n_vocab, 40)]
    users = [[[int(t) for t in rng.integers(100, cfg.n_vocab, 5)] for _ in range(3)] for _ in range(2)]

    async def conversations(prefix_cache: bool):
        engine = Engine(model, tokenizer=None, prefix_cache=prefix_cache, stop_token_ids=(),
                        budget_bytes=400 << 20, max_running=2, max_model_len=96, chunk_size=32, token_budget=64,
                        n_max=3)  # fmt: skip
        results = [[], []]

        async def one(c):
            history = list(system)
            for user in users[c]:
                prompt, answer = history + user, []
                async for event in engine.generate(GenerationRequest(tuple(prompt), 6, speculative=speculative)):
                    if isinstance(event, TokensEvent):
                        answer += event.token_ids
                    else:
                        results[c].append((answer, event.cached_tokens))
                history = prompt + answer

        async with engine, anyio.create_task_group() as tg:
            for c in range(2):
                tg.start_soon(one, c)
        return engine, results

    _, plain = anyio.run(conversations, False)
    engine, cached = anyio.run(conversations, True)
    assert [[a for a, _ in c] for c in cached] == [[a for a, _ in c] for c in plain]
    assert all(n > 0 for c in cached for _, n in c[1:])
    check_memory(engine)
