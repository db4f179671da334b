"""The model-based drafters against direct computations with the same models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DATA, plain_greedy

from drafters.base import DraftRequest
from drafters.draft_model import DraftModelDrafter, check_same_vocab
from jaxmodel import load_model
from jaxmodel.assets import default_model_path
from jaxmodel.kernels import cpu_matmul
from jaxmodel.model import Model
from jaxmodel.executor import RowLoop, Runtime, Shapes, StepRow, calibrate, plane_write_cost, share_buckets
from jaxmodel.state import Row, pack_batch


@pytest.fixture(scope="module")
def target():
    return load_model(DATA / "tiny-qwen35-mtp.gguf")


def runtime_of(model: Model) -> Runtime:
    """A runtime with fresh pools, of the one configuration the tests below share (but those whose point needs
    another): each distinct pool size, bound or padded shape is another set of compilations."""
    return Runtime(model, n_pages=9, n_planes=11, n_chain_max=3, replay_tokens=3, max_iterations=6, lookup_drafts=3,
                   shapes=Shapes(max_rows=2, max_tokens=64, max_logit_rows=4, pages_per_row=2), backlog_slots=2,
                   backlog_tokens=BACKLOG_TOKENS)  # fmt: skip


BACKLOG_TOKENS = 16


@pytest.mark.parametrize("chunks", [(19,), (7, 12), (1, 17, 1)])
def test_mtp_drafts_follow_the_mtp_chain(target, chunks):
    """In the target's step the MTP head catches up with the target's hidden states (over prompt chunks, whose
    boundaries take h_{s-1} from the hidden pool), then chains on its own hidden state."""
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 509, sum(chunks))]
    runtime = runtime_of(target)
    pages, start, read = [1, 2], 0, 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        write = 1 + i % 3
        row = Row(tokens[start : start + n], start, pages, read, [-1] * (n - 1) + [write], [n - 1] if last else [])
        result = runtime.step([StepRow(row, n_chain=3 if last else 0)])[0]
        start, read = start + n, write
    bonus = result.committed[0]

    logits, hidden = target.score(tokens)
    assert bonus == int(logits[-1].argmax())
    chain_tokens = tokens + [bonus]
    chain_hidden = np.concatenate([np.zeros_like(hidden[:1]), hidden])  # h_{t-1} for t = 0..n
    expected = []
    for _ in range(3):
        mtp_logits, mtp_hidden = target.score_mtp(chain_tokens, chain_hidden)
        expected.append(int(mtp_logits[-1].argmax()))
        chain_tokens = chain_tokens + [expected[-1]]
        chain_hidden = np.concatenate([chain_hidden, mtp_hidden[-1:]])
    assert result.next_drafts == expected


def test_mtp_catch_up_without_a_chain_writes_what_a_chain_reads(target):
    """Decoding steps whose head only catches up (n_chain 0: it writes its KV and nothing else) leave it where a
    chain after them drafts exactly what the MTP head drafts over the whole sequence."""
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, 509, 12)]
    runtime = runtime_of(target)
    pages = [1, 2]
    result = runtime.step([StepRow(Row(prompt, 0, pages, 0, [-1] * 11 + [1], [11]), n_chain=0)])[0]
    tokens, read = list(prompt), 1
    for i in range(4):
        assert result.next_drafts == []
        tokens.append(result.committed[0])
        write = 1 + (read % 3)
        row = Row(tokens[-1:], len(tokens) - 1, pages, read, [write], [0])
        result = runtime.step([StepRow(row, n_chain=3 if i == 3 else 0)])[0]
        read = write
    _check_head_caught_up(target, runtime, tokens, pages, result)
    assert len(result.next_drafts) == 3


def _check_head_caught_up(target, runtime, tokens, pages, result):
    """`result` is a step that fed tokens[-1] and chained: its bonus is the target's greedy token after `tokens`,
    the head's KV pages (`pages`) hold what one MTP pass over `tokens` writes, and its first draft is the head's
    own over the whole sequence."""
    bonus = result.committed[0]
    logits, hidden = target.score(tokens)
    assert bonus == int(logits[-1].argmax())
    n = len(tokens)
    batch = pack_batch([Row(tokens, 0, pages, 0, [-1] * n, range(n))])
    hidden_in = np.zeros(batch.tokens.shape + (target.cfg.n_embd,), np.float32)
    hidden_in[0, 1:n] = hidden[:-1]
    _, state = target.mtp_step(target.weights, batch=batch, hidden_in=hidden_in,
                               state=target.new_state(max(pages) + 1, 1))  # fmt: skip
    for ours, expected in [(runtime.state.k_pages[-1], state.k_pages[-1]), (runtime.state.v_pages[-1], state.v_pages[-1])]:
        ours, expected = (np.asarray(p)[pages].reshape((-1,) + p.shape[2:])[:n] for p in (ours, expected))
        np.testing.assert_allclose(ours, expected, atol=1e-4)
    mtp_logits, _ = target.score_mtp(tokens + [bonus], np.concatenate([np.zeros_like(hidden[:1]), hidden]))
    assert result.next_drafts[0] == int(mtp_logits[-1].argmax())


def _head_kv(runtime) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(runtime.state.k_pages[-1]).copy(), np.asarray(runtime.state.v_pages[-1]).copy()


@pytest.mark.parametrize("beside", [None, "chain", "lookup"])
def test_a_held_catch_up_runs_no_head_pass_and_writes_what_a_chain_reads(target, beside):
    """After a prompt caught up as it goes (no slot), a row whose head only catches up, with a backlog slot, decodes
    5 later iterations in one call beside a row
    that chains MTP drafts, or one that drafts by lookup (whose head only catches up, iteration by iteration), or
    alone: its catch-up is held (`state.HeadBacklog`), and alone no head pass runs at all (the head's KV pages are
    untouched). The next call that chains writes the held KV first: its chain drafts exactly what the MTP head
    drafts over the whole sequence, for the holding row and the lookup row, and the head's KV pages hold what one
    MTP pass over it writes."""
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 509, n)] for n in (12, 8)]
    runtime = runtime_of(target)
    pages, planes = ([1, 2], [3, 4]), ((1, 2), (3, 4, 5, 6, 7))
    n_rows = 1 if beside is None else 2
    rows = []
    for i in range(n_rows):
        n = len(prompts[i])
        first = runtime.step([StepRow(Row(prompts[i], 0, pages[i], 0, [-1] * (n - 1) + [planes[i][0]], [n - 1]),
                                      n_chain=0)])[0]  # fmt: skip
        prompts[i] = prompts[i] + first.committed
        if i == 0:
            loop, n_chain = RowLoop(0, planes[0], budget=6), 0
        else:
            continuation = plain_greedy(target, prompts[1][:-1], 13)  # the lookup's drafts are right
            lookup = dict(lookup=(2, 8), history=prompts[1][-7:-1] + continuation + [7] + prompts[1])
            loop = RowLoop(3, planes[1], budget=12, **(lookup if beside == "lookup" else {}))
            n_chain = 3
        rows.append(StepRow(Row(first.committed, n, pages[i], planes[i][0], [planes[i][1]], [0]), n_chain=n_chain,
                            loop=loop, backlog_slot=-1 if i else 0))  # fmt: skip
    mtp_kv = _head_kv(runtime)
    results = runtime.step(rows, iterations=6)
    assert len(results[0].more) == 5 and results[0].next_drafts == []
    assert runtime.backlog_held[0] == 6  # `last` and the bonus of 5 later iterations, all held
    if beside is None:
        for before, after in zip(mtp_kv, _head_kv(runtime)):
            np.testing.assert_array_equal(before, after)
    if beside == "chain":  # its head chained in every iteration (a call of one-token rows feeds no drafts)
        assert len(results[1].next_drafts) == 3 and len(results[1].more) == 5
    if beside == "lookup":  # until 12 tokens (its budget) are in
        assert [later.n_accepted for later in results[1].more] == [3, 3, 3] and results[1].next_drafts == []
    for i in range(n_rows if beside == "lookup" else 1):
        tokens = prompts[i] + results[i].committed + [t for later in results[i].more for t in later.committed]
        live = planes[i][1]  # the planes rule of `speculative.LoopInputs`: after a accepted drafts, the a-th of the
        for later in results[i].more:  # row's planes other than the live one becomes live
            live = [plane for plane in planes[i] if plane != live][later.n_accepted]
        others = [plane for plane in planes[i] if plane != live]
        result = runtime.step([StepRow(Row(tokens[-1:], len(tokens) - 1, pages[i], live, others[:1], [0]),
                                       n_chain=3, backlog_slot=i)])[0]  # fmt: skip
        assert runtime.backlog_held[i] == 0
        _check_head_caught_up(target, runtime, tokens, pages[i], result)


@pytest.mark.parametrize(("n_prompt", "expected_held"), [(12, [12, 5, 10, 15]), (17, [0, 5, 10])])
def test_a_full_backlog_slot_is_caught_up_before_it_would_overflow(target, n_prompt, expected_held):
    """Decoding calls whose head only catches up hold their tokens until the next call could overflow the slot,
    which writes the held KV first (12 + 5 would overflow 16: the prompt's 12 are caught up first); tokens that do
    not fit (a 17-token prompt) are caught up as they come. A chain at the end drafts what the head drafts over
    the whole sequence."""
    rng = np.random.default_rng(8)
    prompt = [int(t) for t in rng.integers(0, 509, n_prompt)]
    runtime = runtime_of(target)
    pages, planes = [1, 2], (1, 2)
    first = runtime.step([StepRow(Row(prompt, 0, pages, 0, [-1] * (n_prompt - 1) + [1], [n_prompt - 1]), n_chain=0,
                                  backlog_slot=1)])[0]  # fmt: skip
    tokens, live, held = prompt + first.committed, 1, [runtime.backlog_held[1]]
    while len(tokens) < 28:  # the pages hold 32 positions
        other = planes[1 - planes.index(live)]
        row = Row(tokens[-1:], len(tokens) - 1, pages, live, [other], [0])
        result = runtime.step([StepRow(row, n_chain=0, loop=RowLoop(0, planes, budget=5), backlog_slot=1)],
                              iterations=5)[0]  # fmt: skip
        tokens += result.committed + [t for later in result.more for t in later.committed]
        for _ in range(1 + len(result.more)):
            live = planes[1 - planes.index(live)]
        held.append(runtime.backlog_held[1])
    assert held == expected_held
    other = planes[1 - planes.index(live)]
    result = runtime.step([StepRow(Row(tokens[-1:], len(tokens) - 1, pages, live, [other], [0]), n_chain=3,
                                   backlog_slot=1)])[0]  # fmt: skip
    assert runtime.backlog_held[1] == 0
    _check_head_caught_up(target, runtime, tokens, pages, result)


def test_mtp_chain_stops_below_p_min(target):
    rng = np.random.default_rng(4)
    tokens = [int(t) for t in rng.integers(0, 509, 9)]
    runtime = runtime_of(target)
    row = Row(tokens, 0, [1, 2], 0, [-1] * 8 + [1], [8])
    assert runtime.step([StepRow(row, n_chain=3, p_min=1.0)])[0].next_drafts == []
    assert runtime.step([StepRow(row, n_chain=-1)])[0].next_drafts == []


def test_draft_model_drafts_its_greedy_continuation_across_rollbacks(target):
    draft_model = load_model(DATA / "tiny-qwen35-f16.gguf", load_mtp=False)
    drafter = DraftModelDrafter(draft_model, max_seqs=2, max_context=64, n_max=4)
    rng = np.random.default_rng(5)
    context = [int(t) for t in rng.integers(0, 509, 9)]
    for accepted in (4, 0, 2, 1):
        draft = drafter.propose([DraftRequest("s", context, n_max=4)])[0].tokens
        assert draft == plain_greedy(draft_model, context, 4)
        bonus = int(rng.integers(0, 509))
        committed = draft[:accepted] + [bonus]
        drafter.observe("s", accepted, committed)
        context = context + committed
    drafter.release("s")
    assert len(drafter.free_slots) == 2


def test_draft_model_vocabulary_is_checked(tmp_path):
    check_same_vocab(str(DATA / "tiny-qwen35-mtp.gguf"), str(DATA / "tiny-qwen35-f16.gguf"))
    with pytest.raises(ValueError, match=r"different vocabulary .* \(640 vs 512 tokens"):
        check_same_vocab(str(DATA / "tiny-qwen35-mtp.gguf"), str(DATA / "tiny-qwen35moe.gguf"))


def test_rows_are_padded_to_1_4_8_16_tokens_then_powers_of_4():
    """Short steps compile at 1, 4, 8 and 16 tokens per row (8 for verify steps of 4..7 drafts, which 16 would make
    a third slower), prompt chunks at 64, 256, ...; every length is capped at max_tokens."""
    shapes = Shapes(max_rows=2, max_tokens=80, max_logit_rows=7, pages_per_row=2)
    assert [shapes.tokens(n) for n in range(1, 18)] == [1] + [4] * 3 + [8] * 4 + [16] * 8 + [64]
    assert shapes.tokens(64) == 64 and shapes.tokens(65) == 80
    assert sorted({(B, T) for B, T, _, _ in shapes.grid()}) == [(B, T) for B in (1, 4) for T in (1, 4, 8, 16, 64, 80)]
    assert Shapes(max_rows=1, max_tokens=6, max_logit_rows=6, pages_per_row=2).tokens(5) == 6


def test_row_buckets_replace_the_powers_of_4():
    """A runtime serving half of 16 rows beside another compiles 1, 4 and 8 rows (`bench/replicas.py`), not 16."""
    shapes = Shapes(max_rows=8, max_tokens=4, max_logit_rows=1, pages_per_row=2, row_buckets=(1, 4, 8))
    assert [shapes.batch(n) for n in range(1, 9)] == [1, 4, 4, 4, 8, 8, 8, 8]
    assert sorted({B for B, _, _, _ in shapes.grid()}) == [1, 4, 8]
    assert Shapes(max_rows=8, max_tokens=4, max_logit_rows=1, pages_per_row=2).batch(5) == 16
    for wrong in [(4, 1, 8), (1, 4), (0, 8), (1, 4, 4, 8)]:
        with pytest.raises(ValueError, match="row_buckets"):
            Shapes(max_rows=8, max_tokens=4, max_logit_rows=1, pages_per_row=2, row_buckets=wrong)
    assert [share_buckets(n) for n in (1, 4, 5, 8, 16)] == [(1,), (1, 4), (1, 4, 5), (1, 4, 8), (1, 4, 16)]


def test_a_write_cost_within_the_steps_noise_counts_as_none():
    """Snapshot's writes are priced by paired differences of two step times; on a shared machine those differ by
    tens of milliseconds either way, and auto must not trade snapshot for replay over that noise. Writes that slow
    most pairs are priced at the median difference, however noisy the runs (pairs measured at the 0.8B shape, four
    rows writing 28 more states: the median, 30 ms, is 1.1 ms a state)."""
    without = [0.300, 0.310, 0.330, 0.305, 0.320, 0.300, 0.310, 0.330, 0.305, 0.320]  # 30 ms of spread
    noise = [0.307, 0.300, 0.322, 0.309, 0.330, 0.296, 0.315, 0.325, 0.301, 0.334]  # 6 of 10 slower, 4 faster
    assert plane_write_cost(without, noise, 28) == 0.0
    measured = [0.0113, -0.0285, 0.0412, 0.1019, 0.0184, -0.0484, 0.0488, 0.0605, 0.0175, 0.1161]
    assert plane_write_cost(without, [w + d for w, d in zip(without, measured)], 28) == pytest.approx(0.0298 / 28)
    spikes = [0.0124, -0.2109, 0.0731, 0.0084, 0.0331, 0.3741, 0.1616, -0.0835, 0.0893, 0.1628]  # two slow baselines
    assert plane_write_cost(without, [w + d for w, d in zip(without, spikes)], 28) == 0.0
    assert plane_write_cost(without, [w - 0.01 for w in without], 28) == 0.0  # faster with writes: no cost
    assert plane_write_cost(without, without, 28) == 0.0


def test_the_worked_examples_in_the_runtime_hold():
    import doctest

    from jaxmodel.executor import costs, shapes

    assert doctest.testmod(shapes).failed == 0 and doctest.testmod(costs).failed == 0


@pytest.mark.parametrize("heads", ["fixture", "zeroed"])
@pytest.mark.parametrize("optimistic", [False, True])
def test_replay_iterations_in_one_call_match_plain_greedy(target, optimistic, heads):
    """A row verifies `last` and 3 MTP drafts, then runs 3 more iterations of its bonus and the head's next drafts
    in the same device call, rolling back by replay between planes 1 and 2: forward (the state after each bonus,
    advanced by the accepted drafts) or optimistic (the state after each last draft, rebuilt from the read plane
    when one is rejected). The fixture's MTP head has every draft rejected; with both heads zeroed every logit is
    0, every token and draft is token 0, and every draft is accepted. The tokens committed equal plain greedy
    decoding's, and the plane left live holds the state a prefill of the same tokens computes."""
    model = target
    if heads == "zeroed":
        weights = target.weights
        model = Model(target.cfg, dataclasses.replace(weights, output=jnp.zeros_like(weights.output),
                                                      mtp=dataclasses.replace(weights.mtp,
                                                                              head=jnp.zeros_like(weights.mtp.head))))
    runtime = runtime_of(model)
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, 509, 8)]
    first = runtime.step([StepRow(Row(prompt, 0, [1, 2], 0, [-1] * 7 + [1], [7]), n_chain=3)])[0]
    tokens, drafts = list(first.committed), first.next_drafts
    n = 1 + len(drafts)
    writes = [-1] * (n - 1) + [2] if optimistic else [2] + [-1] * (n - 1)
    row = Row([tokens[-1]] + drafts, len(prompt), [1, 2], 1, writes, range(n))
    loop = RowLoop(3, (1, 2), budget=32, replay=True, optimistic=optimistic)
    result = runtime.step([StepRow(row, drafts, n_chain=3, loop=loop, replay=True, optimistic=optimistic)],
                          iterations=4)[0]  # fmt: skip
    assert [later.n_accepted for later in result.more] == ([3] * 3 if heads == "zeroed" else [0] * 3)
    tokens += result.committed + [t for later in result.more for t in later.committed]
    assert tokens == plain_greedy(model, prompt, len(tokens))
    fed = prompt + tokens[:-1]  # the live plane holds the state before the newest token, plane 1 after 4 moves
    for start in range(0, len(fed), 8):
        chunk = fed[start : start + 8]
        runtime.step([StepRow(Row(chunk, start, [3, 4], 3 if start else 0, [-1] * (len(chunk) - 1) + [3]))])
    state = jax.tree.map(np.asarray, runtime.state)
    for pool in state.conv + state.ssm + (state.hidden,):
        np.testing.assert_allclose(pool[1], pool[3], atol=1e-4, rtol=0)


def test_shapes_compiled_side_by_side_are_the_ones_warmup_runs(target):
    """`Runtime.compile` compiles every step shape `warmup` runs, two at a time, without running any (the pools
    are unchanged); `warmup` then runs each without tracing it again."""
    runtime = Runtime(target, n_pages=3, n_planes=3, n_chain_max=3, replay_tokens=3,
                      shapes=Shapes(max_rows=1, max_tokens=4, max_logit_rows=4, pages_per_row=2))  # fmt: skip
    before = jax.tree.map(np.array, runtime.state)
    assert runtime.compile(threads=2) == 2
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, runtime.state))
    shapes = []
    for shape in runtime.warmup():
        assert not runtime._step.traced, shape
        shapes.append(shape)
    assert shapes == [(1, 1), (1, 4)]


def test_calibration_times_steps_without_touching_sequences(target):
    """`executor.calibrate` times a decoding step, a verify step and the same verify step chaining MTP drafts, on
    rows that read the null plane and write only the trash page, the replay rebuild alone, writing nothing, and
    the verify step writing its states into the spare planes it is lent: every other plane and every other page is
    unchanged."""
    runtime = Runtime(target, n_pages=3, n_planes=3, n_chain_max=3, replay_tokens=3,
                      shapes=Shapes(max_rows=1, max_tokens=4, max_logit_rows=4, pages_per_row=2))  # fmt: skip
    rng = np.random.default_rng(6)
    tokens = [int(t) for t in rng.integers(0, 509, 4)]
    runtime.step([StepRow(Row(tokens, 0, [1, 2], 0, [-1] * 3 + [1], [3]), n_chain=0)])  # a sequence's state
    before = jax.tree.map(np.array, runtime.state)
    calibration = calibrate(runtime, repeats=2, spare_planes=[2])
    assert set(calibration.plane_write_seconds) == {1}
    assert runtime.costs.plane_write_cost(1) == calibration.plane_write_seconds[1] >= 0
    assert set(calibration.step_seconds) == {(1, 1), (1, 4)} and all(s > 0 for s in calibration.step_seconds.values())
    assert set(calibration.chain_seconds) == {1} and runtime.costs.chain_cost(1) == calibration.chain_seconds[1] >= 0
    assert runtime.rebuild_rows == 0  # a tiny state: one pass of every row (`PER_ROW_REBUILD_MIN_BYTES`)
    assert set(calibration.rebuild_seconds) == {1}
    assert runtime.costs.rebuild_cost(1) == (calibration.rebuild_seconds[1], 1)
    assert calibration.rebuild_seconds[1] >= 0
    after = jax.tree.map(np.array, runtime.state)
    for pool_before, pool_after in zip(before.k_pages + before.v_pages, after.k_pages + after.v_pages):
        np.testing.assert_array_equal(pool_before[1:], pool_after[1:])  # page 0 is the trash page
    for pool_before, pool_after in zip(before.conv + before.ssm + (before.hidden,),
                                       after.conv + after.ssm + (after.hidden,)):  # fmt: skip
        np.testing.assert_array_equal(pool_before[:2], pool_after[:2])  # plane 2 was lent
    assert not np.array_equal(before.ssm[0][2], after.ssm[0][2])  # the timed writes happened


@pytest.mark.parametrize("replay,head", [(False, -1), (True, -1), (False, 0)])
def test_lookup_iterations_in_one_call_match_plain_greedy(target, replay, head):
    """A row decodes 5 more iterations in one call drafting by n-gram lookup on device, in snapshot or replay
    rollback, beside a row decoding plainly. Its history holds the model's own greedy continuation after the
    prompt's last tokens, so every lookup proposes 3 right tokens and every iteration accepts them; with a history
    that matches nothing, every later iteration runs at one token. Either way the tokens equal plain greedy
    decoding's. head 0: the row's request also has the MTP head, which then only catches up (its chain would be
    discarded for the lookup's drafts), so the call hands back no MTP drafts."""
    runtime = runtime_of(target)
    assert runtime.lookup_width == 4
    rng = np.random.default_rng(12)
    prompts = [[int(t) for t in rng.integers(0, 509, 8)] for _ in range(2)]
    expected = [plain_greedy(target, p, 24) for p in prompts]
    pages = ([1, 2], [3, 4])

    def decode(history, write_pool):
        """The prompts' prefill, then one call from each one's first token on; returns each row's committed tokens
        and the first row's later iterations."""
        firsts = [runtime.step([StepRow(Row(p, 0, pages[i], 0, [-1] * 7 + [1 + i], [7]))])[0].committed
                  for i, p in enumerate(prompts)]  # fmt: skip
        assert [f[0] for f in firsts] == [e[0] for e in expected]
        rows = []
        for i, p in enumerate(prompts):
            pool = write_pool[i] if not replay or i else write_pool[i][:1]
            loop = RowLoop(3 if i == 0 else 0, (1 + i,) + pool, budget=16, replay=replay and i == 0,
                           lookup=(2, 8) if i == 0 else None, history=history if i == 0 else ())  # fmt: skip
            rows.append(StepRow(Row([firsts[i][0]], len(p), pages[i], 1 + i, [pool[0]], [0]), loop=loop,
                                n_chain=head if i == 0 else -1))
        results = runtime.step(rows, iterations=6)
        assert results[0].next_drafts == []
        return [r.committed + [t for later in r.more for t in later.committed] for r in results], results[0].more

    C = expected[0]
    matched, more = decode(prompts[0][-6:] + C + [7] + prompts[0] + C[:1], ((3, 4, 5, 6), (7, 8, 9, 10)))
    assert [later.n_accepted for later in more] == [3] * len(more) and len(more) == 4  # 4 x 4 tokens: the budget
    assert [len(later.drafts) for later in more] == [3] * 4
    assert [m == e[1 : 1 + len(m)] for m, e in zip(matched, expected)] == [True, True]
    unmatched, more = decode(prompts[0] + C[:1], ((3, 4, 5, 6), (7, 8, 9, 10)))
    assert [len(later.drafts) for later in more] == [0] * 5
    assert [u == e[1 : 1 + len(u)] for u, e in zip(unmatched, expected)] == [True, True]



@pytest.mark.skipif(not cpu_matmul.available(), reason="bit-equal rows need the CPU kernels (row-invariant products)")
def test_a_step_mixing_a_prompt_chunk_with_verify_rows_runs_split_with_the_same_results():
    """On CPU a step mixing a prompt chunk with short rows runs as two calls (`Runtime.split_chunks`): the same
    committed tokens and drafts, and the same pages and planes written bit for bit, as the one padded call (the
    bundled model, whose products all take the kernels)."""
    target = load_model(default_model_path())
    rng = np.random.default_rng(11)
    first = [int(t) for t in rng.integers(0, target.cfg.n_vocab, 5)]
    chunk = [int(t) for t in rng.integers(0, target.cfg.n_vocab, 30)]
    runtimes = [Runtime(target, n_pages=6, n_planes=8, n_chain_max=3, split_chunks=split) for split in (False, True)]
    results = []
    for runtime in runtimes:
        opened = runtime.step([StepRow(Row(first, 0, [1], 0, [-1] * 4 + [1], [4]), n_chain=3)])[0]
        verify = Row([opened.committed[0], *opened.next_drafts], 5, [1], 1, [2, 3, 4, 5], [0, 1, 2, 3])
        prompt = Row(chunk, 0, [2, 3, 4], 0, [-1] * 29 + [6], [29])
        results.append(runtime.step([StepRow(verify, opened.next_drafts, n_chain=3),
                                     StepRow(prompt, n_chain=3)]))  # fmt: skip
    assert results[0] == results[1]
    assert results[0][0].n_accepted > 0 and results[0][1].next_drafts  # a draft accepted; the prompt drafted
    joined, split = (runtime.state for runtime in runtimes)
    for a, b in zip(joined.k_pages + joined.v_pages, split.k_pages + split.v_pages, strict=True):
        np.testing.assert_array_equal(np.asarray(a)[1:5], np.asarray(b)[1:5])  # page 0 takes padding's writes
    for a, b in zip(joined.conv + joined.ssm + (joined.hidden,), split.conv + split.ssm + (split.hidden,), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[1:7], np.asarray(b)[1:7])
