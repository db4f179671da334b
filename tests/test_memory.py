"""The memory budget: pool sizing, exact accounting of pages and planes, and the rollback/draft-length rule."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.memory import (DraftCandidate, MemoryManager, PoolSizes, RollbackCosts, decide_drafts,
                              expected_replay, forbidden_draft_rate, pages_for, pool_sizes, rebuild_chance,
                              replays_optimistically)


def cand(seq_id, want=4, preference="auto", kv_end=1, pages_owned=1, spare=1, pending=0, alpha=0.5):
    return DraftCandidate(seq_id, want, preference, kv_end=kv_end, pages_owned=pages_owned, spare_planes=spare,
                          n_pending=pending, alpha=alpha)


def decide(cands, *, budget=100, pages=100, planes=100, page_size=4, replay_tokens=0, rebuild=1.0, rebuild_rows=0):
    costs = RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild, rebuild_rows=rebuild_rows)
    return {d.seq_id: d for d in decide_drafts(cands, token_budget=budget, free_pages=pages, free_planes=planes,
                                               page_size=page_size, replay_tokens=replay_tokens, costs=costs)}


def test_pool_sizes_split_bytes():
    sizes = pool_sizes(1000, page_bytes=10, plane_bytes=100, page_size=16, max_running=2, planes_per_seq=3)
    assert sizes == PoolSizes(n_pages=30, n_planes=7, page_size=16)
    with pytest.raises(ValueError):
        pool_sizes(700, page_bytes=10, plane_bytes=100, page_size=16, max_running=2, planes_per_seq=3)
    with pytest.raises(ValueError):
        pool_sizes(10**6, page_bytes=10, plane_bytes=100, page_size=16, max_running=2, planes_per_seq=1)
    with pytest.raises(ValueError):
        PoolSizes(n_pages=10, n_planes=2, page_size=4)
    # The replay pool comes off the budget first: 2 rows of 4 tokens of 20 bytes leave 840 bytes, 7 planes + 14 pages.
    sizes = pool_sizes(1000, page_bytes=10, plane_bytes=100, page_size=16, max_running=2, planes_per_seq=3,
                       replay_tokens=4, replay_token_bytes=20)
    assert sizes == PoolSizes(n_pages=14, n_planes=7, page_size=16, replay_tokens=4)


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_expected_replay():
    assert expected_replay(0.0, 3, 2) == 3.0  # always rejected at once: replay pending + last
    assert expected_replay(1.0, 3, 2) == 0.0  # always fully accepted: checkpoint replays nothing
    assert expected_replay(0.5, 0, 5) == 0.0
    assert expected_replay(0.5, 2, 0) == pytest.approx(0.5 * 1 + 0.25 * 2)


def test_manager_accounting_is_exact():
    mem = MemoryManager(PoolSizes(n_pages=6, n_planes=5, page_size=4))
    assert (mem.free_pages, mem.free_planes, mem.usable_pages, mem.usable_planes) == (5, 4, 5, 4)
    pages, planes = mem.take_pages(3), mem.take_planes(4)
    assert 0 not in pages and 0 not in planes and len(set(pages)) == 3 and sorted(planes) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        mem.take_planes(1)
    mem.give_planes(planes[:2])
    with pytest.raises(ValueError):
        mem.give_planes(planes[:1])  # double free
    with pytest.raises(ValueError):
        mem.give_pages([0])  # the trash page is never handed out
    mem.give_pages(pages)
    mem.give_planes(planes[2:])
    assert (mem.free_pages, mem.free_planes) == (5, 4)


def test_budget_and_pages_are_consumed_in_priority_order():
    out = decide([cand("a", want=5), cand("b", want=5)], budget=7)
    assert (out["a"].n_drafts, out["b"].n_drafts) == (5, 2)
    # kv_end 6 with 2 pages of 4 and no free page: room for 2 more positions
    out = decide([cand("a", want=5, kv_end=6, pages_owned=2)], pages=0)
    assert (out["a"].n_drafts, out["a"].new_pages) == (2, 0)
    out = decide([cand("a", want=5, kv_end=6, pages_owned=2), cand("b", want=5, kv_end=4, pages_owned=1)], pages=1)
    assert (out["a"].n_drafts, out["a"].new_pages, out["b"].n_drafts) == (5, 1, 0)
    assert out["b"].mode is None


def test_forced_modes():
    out = decide([cand("c", preference="checkpoint")])
    assert (out["c"].mode, out["c"].n_drafts, out["c"].new_planes) == ("checkpoint", 4, 0)
    out = decide([cand("s", preference="snapshot", want=6, spare=1, kv_end=4, pages_owned=1)], planes=2)
    assert (out["s"].mode, out["s"].n_drafts, out["s"].new_planes, out["s"].new_pages) == ("snapshot", 2, 2, 1)
    out = decide([cand("s", preference="snapshot", spare=1)], planes=0)
    assert (out["s"].mode, out["s"].n_drafts) == (None, 0)
    # forced snapshot is served before auto even when auto comes first in priority
    out = decide([cand("a", want=3), cand("s", preference="snapshot", want=3)], planes=3)
    assert (out["s"].mode, out["s"].new_planes, out["a"].mode) == ("snapshot", 3, "checkpoint")
    # forced replay: no plane, the draft cut to the replay pool (none without one)
    out = decide([cand("r", preference="replay", want=6, spare=1, kv_end=4, pages_owned=1)], planes=0,
                 replay_tokens=3)
    assert (out["r"].mode, out["r"].n_drafts, out["r"].new_planes, out["r"].new_pages) == ("replay", 3, 0, 1)
    assert decide([cand("r", preference="replay")])["r"].mode is None


def test_auto_spends_planes_where_they_save_most_replay():
    # Same draft length: a sequence half accepted saves more than one almost always fully accepted.
    out = decide([cand("sure", alpha=0.99), cand("half", alpha=0.5)], planes=4)
    assert (out["half"].mode, out["sure"].mode) == ("snapshot", "checkpoint")
    # Replayed tokens before `last` count too.
    out = decide([cand("p0", pending=0), cand("p5", pending=5)], planes=4)
    assert (out["p5"].mode, out["p0"].mode) == ("snapshot", "checkpoint")
    # A snapshot that needs no extra plane is always taken; planes left over go to the next best.
    out = decide([cand("free", want=1, spare=2), cand("x", want=2, spare=1)], planes=2)
    assert (out["free"].mode, out["free"].new_planes, out["x"].mode, out["x"].new_planes) == ("snapshot", 0,
                                                                                            "snapshot", 2)


def test_auto_falls_back_to_replay_when_the_rebuild_costs_less_than_the_replayed_tokens():
    # No plane to borrow; expected_replay(0.5, 4, 0) = 1.625 tokens each, at 1 second per token, 3.25 for both.
    # At alpha 0.5 and d = 4 a row writes the state after `last`, wrong (and rebuilt) when a draft is accepted: 1/2.
    two = [cand("a"), cand("b")]
    # One pass for every row: rebuilt unless neither is wrong, 3/4 of the steps.
    assert {d.mode for d in decide(two, planes=0, replay_tokens=4, rebuild=4.0).values()} == {"replay"}
    assert {d.mode for d in decide(two, planes=0, replay_tokens=4, rebuild=4.5).values()} == {"checkpoint"}
    # A pass per wrong row: one pass in expectation.
    assert {d.mode for d in decide(two, planes=0, replay_tokens=4, rebuild=3.0, rebuild_rows=1).values()} == {
        "replay"}
    assert {d.mode for d in decide(two, planes=0, replay_tokens=4, rebuild=3.5, rebuild_rows=1).values()} == {
        "checkpoint"}
    assert {d.mode for d in decide(two, planes=0, replay_tokens=0, rebuild=0.0).values()} == {"checkpoint"}
    # Alone, "a" would pay half a pass (2.5 s > 1.625 s); beside a forced replay row sharing the pass, a quarter.
    assert decide([cand("a")], planes=0, replay_tokens=4, rebuild=5.0)["a"].mode == "checkpoint"
    out = decide([cand("a"), cand("r", preference="replay")], planes=0, replay_tokens=4, rebuild=5.0)
    assert (out["a"].mode, out["r"].mode) == ("replay", "replay")
    out = decide([cand("a"), cand("r", preference="replay")], planes=0, replay_tokens=4, rebuild=5.0,
                 rebuild_rows=1)  # a pass of its own
    assert (out["a"].mode, out["r"].mode) == ("checkpoint", "replay")
    # Snapshot first where planes fit, whatever the fallback.
    out = decide([cand("sure", alpha=0.99), cand("half", alpha=0.5)], planes=4, replay_tokens=4, rebuild=0.0)
    assert (out["half"].mode, out["sure"].mode) == ("snapshot", "replay")


def test_replay_rows_write_the_state_likelier_to_be_right():
    """alpha^d >= 1 - alpha: optimistic (the state after the last draft), only without replayed tokens."""
    assert replays_optimistically(0.9, 4, 0) and not replays_optimistically(0.6, 4, 0)
    assert not replays_optimistically(0.9, 4, 1) and not replays_optimistically(0.9, 0, 0)
    assert rebuild_chance(0.9, 4, 0) == pytest.approx(1 - 0.9**4)
    assert rebuild_chance(0.6, 4, 0) == rebuild_chance(0.6, 4, 2) == 0.6  # wrong when the first draft is kept
    assert rebuild_chance(0.9, 4, 2) == 0.9
    out = decide([cand("sure", alpha=0.9), cand("half", alpha=0.5), cand("pending", alpha=0.9, pending=1)],
                 planes=0, replay_tokens=4, rebuild=0.0)
    assert {k: (d.mode, d.optimistic) for k, d in out.items()} == {
        "sure": ("replay", True), "half": ("replay", False), "pending": ("replay", False)}


def test_expected_rebuild_counts_the_passes_the_wrong_rows_need():
    one_each, all_in_one = RollbackCosts(rebuild_seconds=1.0, rebuild_rows=1), RollbackCosts(rebuild_seconds=1.0)
    two_each = RollbackCosts(rebuild_seconds=1.0, rebuild_rows=2)
    chances = [0.5, 0.25, 1.0]
    assert one_each.expected_rebuild(chances) == pytest.approx(1.75)
    assert all_in_one.expected_rebuild(chances) == 1.0  # one row is always wrong
    # Two rows per pass: 1 wrong (3/8) or 2 (1/2) -> one pass, 3 wrong (1/8) -> two.
    assert two_each.expected_rebuild(chances) == pytest.approx(3 / 8 + 1 / 2 + 2 / 8)
    assert one_each.expected_rebuild([]) == all_in_one.expected_rebuild([0.0, 0.0]) == 0.0


def test_auto_weighs_the_states_snapshot_writes():
    """A snapshot row writes d more GDN states than a row in the other modes: auto snapshots only the rows whose
    writes cost less than what rolling them back otherwise would, however many planes are free."""

    def modes(write_seconds, replay_tokens=0, rebuild=1.0):
        costs = RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild, plane_write_seconds=write_seconds)
        out = decide_drafts([cand("sure", alpha=0.99), cand("half", alpha=0.5)], token_budget=100, free_pages=100,
                            free_planes=100, page_size=4, replay_tokens=replay_tokens, costs=costs)  # fmt: skip
        return {d.seq_id: (d.mode, d.new_planes) for d in out}

    # Checkpoint replays 1.625 tokens at alpha 0.5 and 0.098 at 0.99 (1 s each); snapshot writes 4 states.
    assert modes(0.0) == {"sure": ("snapshot", 4), "half": ("snapshot", 4)}
    assert modes(0.3) == {"sure": ("checkpoint", 0), "half": ("snapshot", 4)}  # 1.2 s < 1.625 s, > 0.098 s
    assert modes(0.5) == {"sure": ("checkpoint", 0), "half": ("checkpoint", 0)}
    # With a replay pool the rest share a rebuild pass (needed unless neither is wrong: 1 - 0.99^4 for "sure",
    # which replays optimistically, 1/2 for "half"), or checkpoint where that costs less.
    assert modes(0.3, replay_tokens=4, rebuild=0.5) == {"sure": ("replay", 0), "half": ("replay", 0)}
    assert modes(0.2, replay_tokens=4, rebuild=4.0) == {"sure": ("checkpoint", 0), "half": ("snapshot", 4)}


def test_checkpoint_costs_the_longer_step_its_replayed_tokens_cause():
    steps = ((1, 1.0), (4, 2.0), (16, 5.0))  # a step padded to 1, 4 or 16 tokens per row
    costs = RollbackCosts(token_seconds=0.5, rebuild_seconds=1.0, step_seconds=steps)
    assert (costs.step(1), costs.step(3), costs.step(5), costs.step(17)) == (1.0, 2.0, 5.0, None)
    # d = 3: 4 tokens, and up to 7 after a rejection: the next step is padded to 16, 3 seconds more.
    assert costs.checkpoint([(0.5, 3, 0, None)]) == pytest.approx((1 - 0.5**3) * 3.0)
    assert costs.checkpoint([(0.5, 3, 0, None), (0.5, 3, 0, None)]) == pytest.approx((1 - 0.5**6) * 3.0)  # once
    assert costs.checkpoint([(1.0, 3, 0, None)]) == 0.0  # every draft accepted: nothing replayed
    assert costs.checkpoint([(0.5, 5, 0, None)]) == 0.0  # 6 tokens and up to 11 fit the same 16
    # Past the measured lengths: the expected replayed tokens at token_seconds.
    assert costs.checkpoint([(0.5, 8, 0, None)]) == pytest.approx(expected_replay(0.5, 8, 0) * 0.5)
    d = {c.seq_id: c for c in decide_drafts([cand("a", want=3, alpha=0.5)], token_budget=10, free_pages=10,
                                            free_planes=0, page_size=4, replay_tokens=3, costs=costs)}
    assert d["a"].mode == "replay"  # 2.6 seconds of checkpoint against half a rebuild of 1


def test_checkpoint_costs_the_draft_steps_its_piled_up_replays_forbid():
    assert forbidden_draft_rate(0.5, 2, 2) == pytest.approx(0.25)  # worked through in its docstring
    assert forbidden_draft_rate(1.0, 3, 3) == 0.0  # every draft kept: nothing piles up
    assert forbidden_draft_rate(0.5, 2, 50) < 1e-4  # room for a long pile-up
    assert forbidden_draft_rate(0.6, 6, 6) > forbidden_draft_rate(0.9, 6, 6) > 0.0
    steps = ((1, 1.0), (4, 2.0), (16, 5.0))
    costs = RollbackCosts(token_seconds=0.5, rebuild_seconds=0.3, step_seconds=steps)
    # d = 5 with n_max 5: every length fits 16, so only the forbidden draft steps cost.
    accepted = sum(0.5**i for i in range(1, 6))
    lost = forbidden_draft_rate(0.5, 5, 5) * 5.0 * accepted / (1 + accepted)
    assert costs.checkpoint([(0.5, 5, 0, 5)]) == pytest.approx(lost)
    assert costs.checkpoint([(0.5, 5, 0, 5), (0.5, 5, 2, 5)]) == pytest.approx(2 * lost)  # per row
    assert costs.checkpoint([(0.5, 5, 0, None)]) == 0.0  # no limit on replayed tokens
    # So auto replays such a row (half a rebuild of 0.3 s against about 0.63 s lost), and checkpoints it when
    # drafts are nearly always kept.
    for alpha, mode in ((0.5, "replay"), (0.999, "checkpoint")):
        c = dataclasses.replace(cand("a", want=5, alpha=alpha), pending_max=5)
        d = decide_drafts([c], token_budget=10, free_pages=10, free_planes=0, page_size=4, replay_tokens=5,
                          costs=costs)
        assert d[0].mode == mode, alpha


def test_manager_keeps_reserved_planes_for_admission():
    mem = MemoryManager(PoolSizes(n_pages=10, n_planes=8, page_size=4))
    c = [cand("a", want=3)]
    assert mem.decide_drafts(c, 10)[0].mode == "snapshot"
    assert mem.decide_drafts(c, 10, reserve_planes=6)[0].mode == "checkpoint"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.sampled_from(["auto", "snapshot", "checkpoint", "replay"]),
                          st.integers(1, 40), st.integers(0, 3), st.integers(0, 4), st.integers(0, 10),
                          st.floats(0, 1)), max_size=8),
       st.integers(0, 30), st.integers(0, 6), st.integers(0, 12), st.sampled_from([1, 4, 16]),
       st.integers(0, 8), st.floats(0, 10))
def test_decisions_respect_every_limit(raw, budget, free_pages, free_planes, page_size, replay_tokens, rebuild):
    cands = [DraftCandidate(i, want, pref, kv_end=kv_end, pages_owned=pages_for(kv_end, page_size) + more,
                            spare_planes=spare, n_pending=pending, alpha=alpha)
             for i, (want, pref, kv_end, more, spare, pending, alpha) in enumerate(raw)]
    out = decide_drafts(cands, token_budget=budget, free_pages=free_pages, free_planes=free_planes,
                        page_size=page_size, replay_tokens=replay_tokens,
                        costs=RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild))
    assert [d.seq_id for d in out] == [c.seq_id for c in cands]
    assert sum(d.n_drafts for d in out) <= budget
    assert sum(d.new_pages for d in out) <= free_pages
    assert sum(d.new_planes for d in out) <= free_planes
    for c, d in zip(cands, out):
        assert 0 <= d.n_drafts <= c.want
        assert (d.mode is None) == (d.n_drafts == 0)
        assert c.pages_owned + d.new_pages >= pages_for(c.kv_end + d.n_drafts, page_size)
        assert d.mode in (None, c.preference) or c.preference == "auto"
        if d.mode == "snapshot":
            assert d.new_planes == max(0, d.n_drafts + 1 - c.spare_planes)
        else:
            assert d.new_planes == 0
        if d.mode == "replay":
            assert d.n_drafts <= replay_tokens
        assert not d.optimistic or (d.mode == "replay" and c.n_pending == 0)


def test_the_worked_examples_in_the_rule_hold():
    import doctest

    import scheduler.memory

    assert doctest.testmod(scheduler.memory).failed == 0


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["auto", "auto", "replay", "checkpoint"]), st.integers(1, 6),
                               st.integers(0, 3), st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0])),
                     min_size=1, max_size=24),
       rebuild_rows=st.sampled_from([0, 1, 2]), rebuild=st.sampled_from([0.0, 0.5, 1.0]))
def test_auto_snapshots_wherever_planes_fit_when_writes_are_free(rows, rebuild_rows, rebuild):
    # Snapshot then costs nothing, and every other mode costs at least nothing: every auto row that may draft
    # snapshots, however many rows the step has and whatever the forced replay rows beside them will rebuild.
    cands = [DraftCandidate(i, want, pref, kv_end=1, pages_owned=1, spare_planes=1, n_pending=pending, alpha=alpha,
                            pending_max=4)
             for i, (pref, want, pending, alpha) in enumerate(rows)]  # fmt: skip
    costs = RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild, rebuild_rows=rebuild_rows,
                          step_seconds=((1, 1.0), (8, 2.0), (16, 3.0)), plane_write_seconds=0.0)
    out = decide_drafts(cands, token_budget=1000, free_pages=1000, free_planes=1000, page_size=4, replay_tokens=8,
                        costs=costs)
    assert all(d.mode == "snapshot" and d.n_drafts == c.want for d, c in zip(out, cands) if c.preference == "auto")
