"""The engine end to end on the fixture models: the lossless invariant under concurrency for every drafter and
rollback mode, budget accounting, cancellation."""

from __future__ import annotations

import dataclasses
import gc

import anyio
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import DATA, ENGINE, plain_greedy

from drafters.synthetic import SyntheticDrafter
from jaxmodel import load_model
from jaxmodel.model import Model
from jaxmodel.requests import SpeculativeConfig
from jaxmodel.tokenizer import load_tokenizer
from scheduler import DoneEvent, Engine, GenerationRequest, TokensEvent
from scheduler.step_times import StepTimes

MAX_TOKENS = 16
# The most iterations one device call runs: fewer than MAX_TOKENS, so a request takes several. Set on engines built
# with the default bound, whose compiled steps the other tests' engines share.
ITERATIONS = 8


def engine_of(target, **options) -> Engine:
    engine = Engine(target, **ENGINE, **options)
    engine.iterations = ITERATIONS
    return engine


@pytest.fixture(scope="module")
def target():
    return load_model(DATA / "tiny-qwen35-mtp.gguf")


@pytest.fixture(scope="module")
def draft():
    # Same vocabulary, other weights: a draft model whose drafts are sometimes right.
    return load_model(DATA / "tiny-qwen35-f16.gguf", load_mtp=False)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    out = [tuple(int(t) for t in rng.integers(0, 509, n)) for n in (3, 9, 17, 33, 5, 21)]
    out += [tuple([7, 8, 9, 10] * 5), tuple([100, 200, 300] * 7 + [100])]  # n-gram material
    return out


@pytest.fixture(scope="module")
def references(target, prompts):
    return {p: plain_greedy(target, p, MAX_TOKENS) for p in prompts}


async def collect_staggered(engine, timed) -> list:
    """`collect` of each (request, delay) in `timed`, all at once, each starting after its delay."""
    results = [None] * len(timed)

    async def run(i, request, delay):
        await anyio.sleep(delay)
        results[i] = await collect(engine, request)

    async with anyio.create_task_group() as tg:
        for i, (request, delay) in enumerate(timed):
            tg.start_soon(run, i, request, delay)
    return results


async def collect(engine, request):
    tokens, done, n_from_drafts = [], None, 0
    async for event in engine.generate(request):
        if isinstance(event, TokensEvent):
            tokens += event.token_ids
            n_from_drafts += event.n_from_drafts
        else:
            done = event
    return tokens, done, n_from_drafts


@pytest.mark.parametrize("drafting_rate", [2.0, 0.5])
def test_the_policy_declines_a_batch_whose_measured_rate_falls_with_drafting(target, prompts, references,
                                                                            drafting_rate):
    """Four sequences whose drafter is always right. Where the engine's calls that drafted committed twice the
    tokens per second of its calls that did not, the policy drafts; where they committed half (the step's time
    follows its longest row), no row of the batch drafts but in the gate's one batch probe. Either way the tokens
    are plain greedy's."""
    chosen = prompts[:4]
    synthetic = SyntheticDrafter([list(p) + references[p] for p in chosen], alpha=1.0, vocab=target.cfg.n_vocab,
                                 seed=1)  # fmt: skip
    spec = SpeculativeConfig(("synthetic",), n_max=3)

    async def main():
        engine = engine_of(target, extra_drafters=[synthetic])
        rates = {(B, name): 1000.0 * (drafting_rate if name else 1.0)
                 for B in (1, 4, 6) for name in (None, "synthetic")}  # fmt: skip
        engine.speculator.step_times = StepTimes(decay=1.0, rates=rates)  # these rates only, whatever the calls measure
        async with engine:
            return await collect_staggered(engine, [(GenerationRequest(p, MAX_TOKENS, speculative=spec), 0.0)
                                                    for p in chosen])  # fmt: skip

    results = anyio.run(main)
    for prompt, (tokens, _, _) in zip(chosen, results):
        assert tokens == references[prompt]
    drafted = sum(s.drafted for _, done, _ in results for s in done.drafters.values())
    one_batch_probe = len(chosen) * spec.n_max  # a closed gate lets one step draft, then waits 16 steps
    assert drafted > one_batch_probe if drafting_rate > 1 else drafted <= one_batch_probe


def test_lossless_under_concurrency_for_every_drafter_and_mode(target, draft, prompts, references):
    """24 sequences with different prompts, drafters (synthetic at acceptance 0, 0.5 and 1, n-gram, MTP, the draft
    model, mixes) and forced modes join at different times under a budget small enough to force checkpoint or
    replay mode and queueing. Every sequence's greedy tokens equal its plain greedy decode alone."""
    full = [list(p) + references[p] for p in prompts]
    synthetic = {
        f"synthetic{int(a * 100)}": SyntheticDrafter(full, alpha=a, vocab=target.cfg.n_vocab, seed=1)
        for a in (0.0, 0.5, 1.0)
    }
    for name, drafter in synthetic.items():
        drafter.name = name
    drafter_sets = [None, ("synthetic100",), ("synthetic50",), ("synthetic0",), ("ngram",), ("mtp",),
                    ("draft_model",), ("ngram", "mtp"), ("synthetic50", "draft_model")]  # fmt: skip
    modes = ["auto", "snapshot", "checkpoint", "replay"]
    jobs = []
    for i in range(24):
        prompt = prompts[i % len(prompts)]
        drafters = drafter_sets[i % len(drafter_sets)]
        spec = SpeculativeConfig(drafters, n_max=3 + i % 4, rollback=modes[(i + i // 12) % 4]) if drafters else None
        jobs.append((i, prompt, GenerationRequest(prompt, MAX_TOKENS, speculative=spec)))
    results = []

    async def main():
        engine = Engine(target, draft_model=draft, extra_drafters=list(synthetic.values()), adaptive=False, **ENGINE)
        free = (engine.memory.free_pages, engine.memory.free_planes)
        async with engine:
            results.extend(await collect_staggered(engine, [(request, 0.02 * (i % 5)) for i, _, request in jobs]))
        assert (engine.memory.free_pages, engine.memory.free_planes) == free
        return engine

    engine = anyio.run(main)
    modes_used = {"snapshot": 0, "checkpoint": 0, "replay": 0}
    accepted_total = 0
    for i, prompt, request in jobs:
        tokens, done, n_from_drafts = results[i]
        assert tokens == references[prompt], f"job {i}: {request.speculative}"
        assert done.finish_reason == "length" and done.completion_tokens == MAX_TOKENS
        for mode, steps in done.rollback_steps.items():
            modes_used[mode] += steps
        accepted_total += n_from_drafts
        if request.speculative and request.speculative.rollback != "auto":
            rollback = request.speculative.rollback
            assert sum(done.rollback_steps.values()) == done.rollback_steps.get(rollback, 0)
    assert all(steps > 0 for steps in modes_used.values()), modes_used
    assert accepted_total > 0
    assert engine.steps > 0


def test_cancel_mid_stream_frees_pages_and_planes(target, prompts):
    async def main():
        engine = Engine(target, **ENGINE)
        engine.iterations = 1  # a step's iterations reach the stream as one event: one per step, to leave mid-way
        free = (engine.memory.free_pages, engine.memory.free_planes)
        async with engine:
            seen = []
            async for event in engine.generate(GenerationRequest(prompts[2], 40)):
                seen.append(event)
                if len(seen) == 3:
                    break  # leaving the stream cancels the request
            tokens, done, _ = await collect(engine, GenerationRequest(prompts[0], 4))
            assert done.finish_reason == "length" and len(tokens) == 4
        assert (engine.memory.free_pages, engine.memory.free_planes) == free
        assert all(isinstance(e, TokensEvent) for e in seen)

    anyio.run(main)


def test_stop_strings_and_end_of_generation(target, prompts, references):
    tokenizer = load_tokenizer(DATA / "tiny-qwen35-mtp.gguf")
    prompt = prompts[1]
    ref_text = tokenizer.decode(references[prompt])
    stop = ref_text[len(ref_text) // 2 : len(ref_text) // 2 + 3]

    async def main():
        async with Engine(target, tokenizer=tokenizer, **ENGINE) as e:
            texts = []
            done = None
            async for event in e.generate(GenerationRequest(prompt, MAX_TOKENS, stop=(stop,))):
                if isinstance(event, TokensEvent):
                    texts.append(event.text)
                else:
                    done = event
            return "".join(texts), done

    text, done = anyio.run(main)
    assert done.finish_reason == "stop"
    assert text == ref_text[: ref_text.index(stop)]
    assert isinstance(done, DoneEvent)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 508), min_size=1, max_size=12),
    drafters=st.sampled_from([("synthetic",), ("ngram",), ("mtp",), ("draft_model",), ("synthetic", "mtp")]),
    alpha=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    rollback=st.sampled_from(["auto", "snapshot", "checkpoint", "replay"]),
    n_max=st.integers(1, 5),
)
def test_lossless_for_generated_prompts(target, draft, prompt, drafters, alpha, rollback, n_max):
    expected = plain_greedy(target, prompt, 8)
    synthetic = SyntheticDrafter([list(prompt) + expected], alpha=alpha, vocab=target.cfg.n_vocab, seed=len(prompt))
    request = GenerationRequest(tuple(prompt), 8, speculative=SpeculativeConfig(drafters, n_max=n_max,
                                                                                 rollback=rollback))  # fmt: skip

    async def main():
        engine = Engine(target, draft_model=draft, extra_drafters=[synthetic], adaptive=False, **ENGINE)
        async with engine:
            return await collect(engine, request)

    tokens, done, _ = anyio.run(main)
    assert tokens == expected
    assert done.completion_tokens == 8


@pytest.mark.parametrize("drafters,rollback", [(None, "auto"), (("mtp",), "snapshot"), (("mtp",), "replay")])
def test_several_iterations_per_device_call_are_lossless(target, prompts, references, drafters, rollback):
    """One request at a time: decoding steps run up to 8 iterations per device call (fewer calls than tokens),
    with the same tokens as plain greedy decoding, rolling back in the mode asked for (replay rows alternate
    between their two planes inside the call). The MTP head drafts for every prompt, those whose last prefill
    chunk is a single token included (17 and 33 tokens in chunks of 16): that chunk carries no draft, and the
    plain decoding loop it starts hands the head's drafts to the next call."""
    spec = SpeculativeConfig(drafters, n_max=3, rollback=rollback) if drafters else None
    chosen = prompts[:4]
    assert any(len(prompt) % ENGINE["chunk_size"] == 1 for prompt in chosen)

    async def main():
        engine = engine_of(target, adaptive=False, max_call_seconds=None)
        async with engine:
            for prompt in chosen:
                tokens, done, _ = await collect(engine, GenerationRequest(prompt, MAX_TOKENS, speculative=spec))
                assert tokens == references[prompt], prompt
                assert done.finish_reason == "length" and done.completion_tokens == MAX_TOKENS
                if spec is not None:
                    assert done.rollback_steps[rollback] > 0, prompt
                    assert sum(done.rollback_steps.values()) == done.rollback_steps[rollback]
                    assert done.drafters["mtp"].drafted > 0, prompt
        return engine.steps

    steps = anyio.run(main)
    # Per prompt: its prefill chunks (the last commits a token), then calls committing at least ITERATIONS tokens
    # each (one per iteration).
    chunks = sum(-(-len(prompt) // ENGINE["chunk_size"]) for prompt in chosen)
    assert steps <= chunks + len(chosen) * -(-(MAX_TOKENS - 1) // ITERATIONS)


def test_a_float16_kv_cache_holds_twice_the_pages_and_speculation_stays_lossless(target, prompts):
    """kv_dtype float16: the same budget gives twice the KV pages (the GDN planes are float32 either way), and in
    one engine four sequences at once, drafting with the MTP head (snapshot, checkpoint), n-grams, and both
    (replay), get the greedy tokens that plain decoding gives with that cache."""
    full = Engine(target, **ENGINE)
    half = engine_of(target, adaptive=False, max_call_seconds=None, kv_dtype="float16")
    assert half.runtime.state.k_pages[0].dtype == jnp.float16
    assert half.memory.sizes.n_pages >= 2 * full.memory.sizes.n_pages - 2
    assert half.memory.sizes.n_planes == full.memory.sizes.n_planes
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        Engine(target, **ENGINE, kv_dtype="bfloat16")
    chosen = prompts[4:8]  # 5 and 21 random tokens and the two n-gram prompts
    specs = [SpeculativeConfig(("mtp",), n_max=3, rollback="snapshot"), SpeculativeConfig(("ngram",), n_max=4),
             SpeculativeConfig(("mtp", "ngram"), n_max=3, rollback="replay"),
             SpeculativeConfig(("mtp",), n_max=2, rollback="checkpoint")]  # fmt: skip

    async def main():
        async with half:
            plain = await collect_staggered(half, [(GenerationRequest(p, MAX_TOKENS), 0.0) for p in chosen])
            jobs = [(GenerationRequest(p, MAX_TOKENS, speculative=spec), 0.0) for p, spec in zip(chosen, specs)]
            speculative = await collect_staggered(half, jobs)
        return plain, speculative

    plain, speculative = anyio.run(main)
    drafted = 0
    for prompt, (want, _, _), (got, done, _) in zip(chosen, plain, speculative, strict=True):
        assert got == want, prompt
        assert done.completion_tokens == MAX_TOKENS
        drafted += sum(stats.drafted for stats in done.drafters.values())
    assert drafted > 0


def test_a_bound_on_call_time_runs_fewer_iterations_per_call(target, prompts, references):
    """With max_call_seconds below any iteration's time, a call runs one iteration once the engine has timed a
    decoding call at that many rows: the first call after the prompt may loop, every later one commits one
    token. Without the bound the same request takes two calls after its prompt. Tokens are the same either way."""
    prompt = prompts[1]  # 9 tokens: one prefill chunk

    async def run(max_call_seconds):
        engine = engine_of(target, max_call_seconds=max_call_seconds)
        async with engine:
            tokens, done, _ = await collect(engine, GenerationRequest(prompt, MAX_TOKENS))
        assert tokens == references[prompt] and done.completion_tokens == MAX_TOKENS
        return engine.steps

    unbounded, bounded = anyio.run(run, None), anyio.run(run, 1e-9)
    assert unbounded <= 1 + -(-(MAX_TOKENS - 1) // ITERATIONS)
    # the prefill step commits 1 token, the first decoding call up to ITERATIONS, each later call 1
    assert bounded >= 1 + 1 + (MAX_TOKENS - 1 - ITERATIONS) > unbounded


def test_a_request_waiting_for_a_row_does_not_shorten_the_calls(target, prompts, references):
    """One row, two requests: the second waits until the first ends, and nothing can start before then, so the first's
    calls loop as if it were alone (up to its end by length), instead of one iteration a call while a request waits.
    Each request then takes its prefill step and two decoding calls (8 and 7 iterations)."""
    prompt = prompts[1]  # 9 tokens: one prefill chunk

    async def main():
        engine = Engine(target, **{**ENGINE, "max_running": 1})
        engine.iterations = ITERATIONS
        async with engine:
            results = await collect_staggered(engine, [(GenerationRequest(prompt, MAX_TOKENS), 0.0)] * 2)
        for tokens, done, _ in results:
            assert tokens == references[prompt] and done.completion_tokens == MAX_TOKENS
        return engine.steps

    assert anyio.run(main) == 2 * (1 + -(-(MAX_TOKENS - 1) // ITERATIONS))  # 6; one iteration a call: 19


def test_calls_that_traced_are_not_priced(target, prompts, references):
    """A device call that traced (and so compiled, or loaded from a cache) is no measure of a step: the policy's cost
    lines and the call-time bound take only calls that did not. `jax.clear_caches()` makes the request's calls trace
    again, as when jit's cache lets their executables go; with one decoding call per request, the first request
    reports nothing and the second, whose calls are cached, reports its decoding call."""
    prompt = prompts[1]  # 9 tokens: one prefill chunk, then one decoding call of MAX_TOKENS - 1 iterations

    async def run(engine):
        async with engine:
            tokens, _, _ = await collect(engine, GenerationRequest(prompt, MAX_TOKENS))
        assert tokens == references[prompt]

    engine = Engine(target, **ENGINE, iterations=MAX_TOKENS)
    jax.clear_caches()
    anyio.run(run, engine)
    assert engine.steps == 2
    assert not engine.policy.costs.target and not engine.policy.costs.single and not engine.speculator._iteration_seconds
    anyio.run(run, engine)
    assert engine.steps == 4
    assert sum(line.w for line in engine.policy.costs.target.values()) == 1.0 and engine.speculator._iteration_seconds


@pytest.mark.parametrize("rollback", ["snapshot", "replay"])
def test_ngram_lookup_drafts_inside_device_calls(target, prompts, rollback):
    """With the output head zeroed every logit is 0 and greedy decoding emits token 0 forever, so once two zeros
    are out the n-gram lookup always matches and every draft is right: one token, since the most recent occurrence
    of the longest match ends one token before the newest. An `ngram` request beside a plain one then drafts by
    lookup on device inside each call (2 tokens per iteration, rolling back in the mode asked for); both get plain
    greedy's tokens."""
    zeroed = Model(target.cfg, dataclasses.replace(target.weights, output=jnp.zeros_like(target.weights.output)))
    max_tokens = 40
    spec = SpeculativeConfig(("ngram",), n_max=3, rollback=rollback)
    chosen = prompts[1], prompts[4]  # one prefill chunk each
    expected = [[0] * max_tokens] * 2
    for prompt in chosen:  # plain greedy's tokens, checked in one pass: every position's argmax is 0
        logits, _ = zeroed.score(list(prompt) + [0] * (max_tokens - 1))
        assert (logits[len(prompt) - 1 :].argmax(-1) == 0).all()

    async def main():
        engine = engine_of(zeroed, adaptive=False, max_call_seconds=None)
        assert engine.runtime.lookup_width == 4
        async with engine:
            results = [None, None]

            async def run(i, request):
                results[i] = await collect(engine, request)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0, GenerationRequest(chosen[0], max_tokens, speculative=spec))
                tg.start_soon(run, 1, GenerationRequest(chosen[1], max_tokens))
        return results, engine.steps

    (drafted, plain), steps = anyio.run(main)
    assert [drafted[0], plain[0]] == expected
    stats = drafted[1].drafters["ngram"]
    assert stats.accepted == stats.drafted >= max_tokens // 2 - 2 and drafted[2] == stats.accepted
    assert drafted[1].rollback_steps[rollback] > 0
    assert sum(drafted[1].rollback_steps.values()) == drafted[1].rollback_steps[rollback]
    assert steps <= 2 + 2 * -(-max_tokens // ITERATIONS)  # the prefills, then calls of at least ITERATIONS tokens


def test_end_of_generation_id_ends_a_sequence_inside_a_device_loop(target, prompts, references):
    prompt = prompts[0]
    stop_id = references[prompt][6]
    expected = references[prompt][: references[prompt].index(stop_id)]

    async def main():
        engine = engine_of(target, stop_token_ids=[stop_id])
        free = (engine.memory.free_pages, engine.memory.free_planes)
        async with engine:
            result = await collect(engine, GenerationRequest(prompt, MAX_TOKENS))
        assert (engine.memory.free_pages, engine.memory.free_planes) == free
        return result

    tokens, done, _ = anyio.run(main)
    assert tokens == expected
    assert done.finish_reason == "stop" and done.completion_tokens == len(expected) + 1


def test_a_one_token_prompt_leaves_the_null_plane_alone(target, prompts, references):
    """A one-token prompt's first row reads the null plane (the zeros every new sequence starts from) and feeds one
    token, the shape of a decoding row; its later iterations in the call must not write the null plane, or every
    later sequence starts from its state. The first row runs one iteration; the prompt's own tokens and a later
    request's are their greedy ones, and the null plane stays zero."""

    async def main():
        engine = engine_of(target)
        async with engine:
            one = await collect(engine, GenerationRequest((15,), MAX_TOKENS))
            later = await collect(engine, GenerationRequest(prompts[0], MAX_TOKENS))
        return engine, one, later

    engine, one, later = anyio.run(main)
    assert one[0] == plain_greedy(target, (15,), MAX_TOKENS)
    assert later[0] == references[prompts[0]]
    state = engine.runtime.state
    for plane_pool in (*state.conv, *state.ssm, state.hidden):
        assert not np.asarray(plane_pool[0]).any()


def test_requests_are_served_while_shapes_compile_in_the_background(target, prompts, references):
    """With background warm-up the engine serves at once: a request arriving before any shape has compiled gets
    plain greedy's tokens (its steps compile what they need), and the warm-up then finishes with the policy's
    calibration and freezes the heap it leaves."""

    async def main():
        engine = Engine(target, budget_bytes=700_000, max_running=1, max_model_len=64, chunk_size=4, n_max=1,
                        iterations=1, background_warmup=True)  # fmt: skip
        async with engine:
            assert not engine.warmed.is_set()
            tokens, done, _ = await collect(engine, GenerationRequest(prompts[0], MAX_TOKENS))
            with anyio.fail_after(300):
                await engine.warmed.wait()
        return tokens, engine

    gc.unfreeze()  # an earlier engine's warm-up may have frozen the heap
    tokens, engine = anyio.run(main)
    assert tokens == references[prompts[0]]
    assert set(engine.runtime.costs.chain_seconds) == {1}  # calibrated: one batch bucket, the MTP head chains
    assert set(engine.runtime.costs.plane_write_seconds) == {1}  # in planes lent while idle, and given back:
    assert engine.memory.free_planes == engine.memory.usable_planes
    assert gc.get_freeze_count() > 0  # what the warm-up left is out of the collector's way (`freeze_heap`)


def test_prompt_chunks_joining_running_sequences_run_in_calls_of_their_own(target, prompts, references):
    """Prompts of 17-33 tokens (one chunk each, longer than a loop step) arrive while other sequences decode, with
    and without drafts: on CPU such steps run the chunks and the short rows as separate calls
    (`Runtime.split_chunks`), and every sequence's tokens still equal its plain greedy decode."""
    jobs = [(i, prompts[i % 6], SpeculativeConfig(drafters, n_max=3) if drafters else None)
            for i, drafters in enumerate([None, ("mtp",), ("ngram",), None, ("mtp",), None, ("ngram", "mtp"), None])]
    results, calls_per_step = [], []

    async def main():
        engine = Engine(target, adaptive=False, **{**ENGINE, "chunk_size": 40, "token_budget": 96})
        engine.iterations = ITERATIONS
        step, call = engine.runtime.step, engine.runtime._call
        calls = []
        engine.runtime._call = lambda rows, iterations: calls.append(len(rows)) or call(rows, iterations)

        def counted_step(rows, iterations=1):
            before = len(calls)
            out = step(rows, iterations)
            calls_per_step.append(len(calls) - before)
            return out

        engine.runtime.step = counted_step
        async with engine:
            results.extend(await collect_staggered(
                engine, [(GenerationRequest(prompt, MAX_TOKENS, speculative=spec), 0.03 * i) for i, prompt, spec in jobs]))

    anyio.run(main)
    for i, prompt, _ in jobs:
        assert results[i][0] == references[prompt], f"job {i}"
    if jax.default_backend() == "cpu":
        assert max(calls_per_step) > 1  # some step ran as split calls


def test_a_looping_call_is_priced_by_the_tokens_its_later_iterations_verified():
    """Two rows whose first iteration is plain; in the second one row verifies three drafts (one rejected, fed as
    -1) and the other none; the third runs the first row alone. The call verified 8 tokens in 3 iterations, not
    2 per iteration as its first iteration alone says."""
    from jaxmodel.executor import Iteration, RowResult
    from scheduler.step_costs import tokens_per_iteration

    first = RowResult(0, [5], [], more=[Iteration([6, 7, -1], 2, [6, 7, 9]), Iteration([], 0, [10])])
    second = RowResult(0, [8], [], more=[Iteration([], 0, [11])])
    assert tokens_per_iteration(2, [first, second], 3) == pytest.approx(8 / 3)
    assert tokens_per_iteration(2, [RowResult(0, [5], []), RowResult(0, [8], [])], 1) == 2
