"""The scheduler core against a fake model whose output depends on the GDN planes and the KV pages it is given.

The fake model's "recurrent state" is a hash of every token fed so far, kept per plane; its "KV" is a dict
page -> slot -> token; the next token depends on both. A wrong read plane, a wrong write plane or a stale KV
position changes the output, so "every sequence's output equals its plain greedy decode" checks the bookkeeping.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmodel.requests import SpeculativeConfig
from scheduler.core import Scheduler
from scheduler.memory import MemoryManager, PoolSizes, RollbackCosts, pages_for
from scheduler.stops import scan_stop_strings
from scheduler.types import (UNNAMED_DRAFTER, Committed, Continued, DoneEvent, DraftPlan, DraftStats, Request, StepPlan,
                             TokensEvent)

V = 32
EOS = 0
MASK = (1 << 64) - 1
# A toy vocabulary whose tokens glue into words, so that stop strings straddle token boundaries.
VOCAB = ["<eos>", "a", "b", "c", "ab", "bc", "ca", " ", "x", "yz", "\n", "d", "e", "f", "de", "ef",
         "g", "h", "gh", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r", "s", "t", "u"]


def spec(n_max: int, rollback: str = "auto") -> SpeculativeConfig | None:
    """A request's speculative settings; the scheduler reads only n_max and rollback (0: plain decoding)."""
    return SpeculativeConfig(("fake",), n_max=n_max, rollback=rollback) if n_max else None


def mix(state: int, token: int) -> int:
    """The fake recurrent update: state after feeding `token`."""
    return ((state ^ (token + 1)) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK


def greedy_next(state: int, kv: tuple[int, ...]) -> int:
    """The fake model's argmax given the recurrent state and the attention's view of the KV."""
    return (((state ^ hash(kv)) * 0xD6E8FEB86659FD93 & MASK) >> 40) % V


def continuation(prompt: tuple[int, ...], n: int) -> list[int]:
    """Plain greedy decoding of n tokens, no stops, one sequence alone."""
    tokens, state = list(prompt), 0
    for t in prompt:
        state = mix(state, t)
    out = []
    for _ in range(n):
        nxt = greedy_next(state, tuple(tokens))
        out.append(nxt)
        tokens.append(nxt)
        state = mix(state, nxt)
    return out


def reference(req: Request, max_model_len: int) -> tuple[list[int], str, str, int]:
    """What a lone sequence must emit: (token ids, text, finish reason, tokens generated), stops applied naively."""
    ids, text = [], ""
    for n, tok in enumerate(continuation(req.prompt, max_model_len - len(req.prompt)), start=1):
        if tok in req.stop_token_ids:
            return ids, text, "stop", n
        ids.append(tok)
        text += VOCAB[tok]
        hits = [i for s in req.stop_strings if (i := text.find(s)) >= 0]
        if hits:
            return ids, text[: min(hits)], "stop", n
        if n == req.max_tokens or len(req.prompt) + n == max_model_len:
            return ids, text, "length", n
    raise AssertionError("unreachable")


class TableDetokenizer:
    """Incremental detokenizer over the toy vocabulary."""

    def add(self, token_id: int) -> str:
        return VOCAB[token_id]

    def flush(self) -> str:
        return ""


class FakeModel:
    """Runs a plan like the real step: rows read their plane at the start, write planes and KV as they go."""

    def __init__(self, page_size: int, script: dict | None = None):
        self.page_size = page_size
        self.planes: dict[int, int] = {}
        self.kv: dict[int, dict[int, int]] = defaultdict(dict)
        self.script = script or {}  # seq_id -> forced output tokens (position-indexed from the prompt end)

    def run(self, plan: StepPlan, prompts: dict) -> dict:
        """seq_id -> greedy tokens at the row's logit_rows. Replay rows keep the state after each token for
        `rebuild`."""
        check_plan(plan, self.page_size)
        assert all(src in self.planes for src, _ in plan.plane_copies), "copies a plane nobody wrote"
        planes = {dst: self.planes[src] for src, dst in plan.plane_copies}
        pages = {dst: dict(self.kv[src]) for src, dst in plan.page_copies}
        self.planes.update(planes)
        self.kv.update(pages)
        writes, out = {}, {}
        self.after = {}
        for row in plan.rows:
            assert row.read_plane == 0 or row.read_plane in self.planes, "reads a plane nobody wrote"
            state = self.planes.get(row.read_plane, 0)
            targets = []
            for i, (tok, pos) in enumerate(zip(row.tokens, row.positions)):
                self.kv[row.pages[pos // self.page_size]][pos % self.page_size] = tok
                state = mix(state, tok)
                self.after[row.seq_id, i] = state
                if row.write_planes[i] >= 0:
                    writes[row.write_planes[i]] = state
                if i in row.logit_rows:
                    view = tuple(self.kv[row.pages[p // self.page_size]][p % self.page_size] for p in range(pos + 1))
                    script = self.script.get(row.seq_id)
                    targets.append(script[pos + 1 - len(prompts[row.seq_id])] if script else greedy_next(state, view))
            out[row.seq_id] = targets
        self.planes.update(writes)
        return out

    def rebuild(self, plan: StepPlan, committed: dict) -> None:
        """Replay rows, after verification: the plane written (after `last`, or after the last draft when
        optimistic) gets the state after the last accepted draft (what the device's rebuild does in the same
        call)."""
        for row in plan.rows:
            if row.mode == "replay" and row.seq_id in committed:
                last = len(row.fed) - 1
                self.planes[row.write_pool[0]] = self.after[row.seq_id, last + committed[row.seq_id].n_accepted]


def check_plan(plan: StepPlan, page_size: int) -> None:
    """Structural invariants every plan must keep."""
    ids = [r.seq_id for r in plan.rows]
    assert len(ids) == len(set(ids))
    # Rows share no page they write (the prefix cache's shared pages hold positions before their starts).
    written_pages = [{r.pages[p // page_size] for p in r.positions} for r in plan.rows]
    for i, r in enumerate(plan.rows):
        assert 0 not in r.pages, "the trash page"
        others = {p for j, o in enumerate(plan.rows) if j != i for p in o.pages}
        assert not written_pages[i] & others, "a row writes a page another row holds"
    written = [w for r in plan.rows for w in r.write_planes if w >= 0]
    assert len(written) == len(set(written)) and 0 not in written, "a plane written twice or the null plane"
    assert not set(written) & {r.read_plane for r in plan.rows}, "a plane read and written in one step"
    for r in plan.rows:
        assert len(r.write_planes) == len(r.tokens) == len(r.positions) > 0
        # Replay: the state after `last`, advanced later, or (optimistic) after the last draft, rebuilt if wrong.
        final = len(r.fed) - 1 if r.mode == "replay" and not r.optimistic else -1
        assert r.write_planes[final] >= 0, "the final state must land somewhere"
        assert not r.optimistic or (r.mode == "replay" and len(r.fed) == 1), "optimistic replay without pending"
        assert pages_for(r.start + len(r.tokens), page_size) <= len(r.pages)
        assert len(r.drafts) <= r.draft_max
        if r.needs_logits:
            assert r.logit_rows == tuple(range(len(r.fed) - 1, len(r.tokens)))
        else:
            assert r.logit_rows == () and not r.drafts


def verify_greedy(plan: StepPlan, targets: dict) -> dict:
    """Accept drafts while they equal the target's argmax, then take the target's token."""
    out = {}
    for row in plan.rows:
        if not row.needs_logits:
            continue
        t = targets[row.seq_id]
        a = 0
        while a < len(row.drafts) and row.drafts[a] == t[a]:
            a += 1
        out[row.seq_id] = Committed(tuple(row.drafts[:a]) + (t[a],), a)
    return out


@dataclass
class Scenario:
    """Requests arriving at given steps, aborts at given steps, a drafter corrupting drafts at given rates."""

    requests: list[Request]
    arrivals: dict = field(default_factory=dict)  # seq_id -> step
    aborts: dict = field(default_factory=dict)  # seq_id -> (step, mid_flight)
    corruption: dict = field(default_factory=dict)  # seq_id -> probability a draft token is wrong
    seed: int = 0
    alpha: dict = field(default_factory=dict)  # seq_id -> the acceptance its draft plans claim (default: none given)


@dataclass
class Run:
    events: dict  # seq_id -> list of events
    plans: list
    waiting_seen: int
    sched: Scheduler


def simulate(sc: Scenario, sched: Scheduler, *, max_steps: int = 3000, script: dict | None = None,
             on_plan=None) -> Run:
    """Drive the scheduler like the engine does, with the fake model, drafter and greedy verification."""
    rng = random.Random(sc.seed)
    model = FakeModel(sched.memory.page_size, script)
    prompts = {r.seq_id: r.prompt for r in sc.requests}
    truth = {r.seq_id: list(r.prompt) + (script[r.seq_id] if script and r.seq_id in script else
                                         continuation(r.prompt, sched.max_model_len)) for r in sc.requests}
    events: dict = defaultdict(list)
    plans, waiting_seen, step = [], 0, 0
    pending = sorted(sc.requests, key=lambda r: sc.arrivals.get(r.seq_id, 0))

    def record(evs):
        for e in evs:
            events[e.seq_id].append(e)

    while pending or sched.has_work:
        assert step < max_steps, "no progress"
        while pending and sc.arrivals.get(pending[0].seq_id, 0) <= step:
            sched.add(pending.pop(0))
        for sid, (at, mid) in sc.aborts.items():
            if at == step and not mid:
                record(sched.abort(sid))
        plan = sched.schedule({sid: DraftPlan(sched.request(sid).n_max, alpha) for sid, alpha in sc.alpha.items()
                               if sid in sched.may_draft()})  # fmt: skip
        waiting_seen = max(waiting_seen, sched.n_waiting)
        if plan.rows:
            drafts = {}
            for row in plan.rows:
                if row.draft_max:
                    have = sched.tokens(row.seq_id)
                    k = rng.randint(0, row.draft_max)
                    true = truth[row.seq_id][len(have):len(have) + k]
                    q = sc.corruption.get(row.seq_id, 0.0)
                    drafts[row.seq_id] = [(t + rng.randrange(1, V)) % V if rng.random() < q else t for t in true]
            plan = plan.with_drafts(drafts, {sid: "fake" for sid in drafts})
            plans.append(plan)
            if on_plan is not None:
                on_plan(plan)
            targets = model.run(plan, prompts)
            for sid, (at, mid) in sc.aborts.items():
                if at == step and mid:
                    evs = sched.abort(sid)
                    assert evs == [] or sid not in {r.seq_id for r in plan.rows}
                    record(evs)
            committed = verify_greedy(plan, targets)
            model.rebuild(plan, committed)
            record(sched.update(plan, committed))
        step += 1
    return Run(dict(events), plans, waiting_seen, sched)


def check_events(run: Run, sc: Scenario) -> None:
    """Every sequence: tokens events then exactly one done; output equals the lone greedy decode."""
    aborted = set(sc.aborts)
    for req in sc.requests:
        evs = run.events[req.seq_id]
        assert [isinstance(e, DoneEvent) for e in evs] == [False] * (len(evs) - 1) + [True], evs
        done = evs[-1]
        ids = [t for e in evs[:-1] for t in e.token_ids]
        text = "".join(e.text for e in evs[:-1])
        want_ids, want_text, want_reason, want_n = reference(req, run.sched.max_model_len)
        assert done.prompt_tokens == len(req.prompt)
        if done.finish_reason == "cancelled":
            assert req.seq_id in aborted
            assert ids == want_ids[: len(ids)] and want_text.startswith(text)
        else:
            assert (ids, text, done.finish_reason) == (want_ids, want_text, want_reason), req.seq_id
            assert done.completion_tokens == want_n
        n_drafts = sum(e.n_from_drafts for e in evs[:-1])
        assert 0 <= n_drafts <= sum(s.accepted for s in done.drafters.values())
        for e in evs[:-1]:
            assert isinstance(e, TokensEvent) and (e.token_ids or e.text)
            assert 0 <= e.n_from_drafts <= len(e.token_ids)
    mem, cache = run.sched.memory, run.sched.prefix_cache
    if cache is not None:  # what the cache holds is all that is not free, and comes back when it is dropped
        assert (mem.free_pages + cache.pages, mem.free_planes + cache.planes) == (mem.usable_pages, mem.usable_planes)
        run.sched.clear_prefix_cache()
    assert (mem.free_pages, mem.free_planes) == (mem.usable_pages, mem.usable_planes)
    assert not run.sched.has_work


def make_scheduler(*, n_pages=64, n_planes=40, page_size=4, max_model_len=40, token_budget=48, max_running=8,
                   chunk_size=None, replay_tokens=6, prefix_cache_planes=0) -> Scheduler:
    mem = MemoryManager(PoolSizes(n_pages=n_pages, n_planes=n_planes, page_size=page_size,
                                  replay_tokens=replay_tokens))
    return Scheduler(mem, TableDetokenizer, max_model_len=max_model_len, token_budget=token_budget,
                     max_running=max_running, chunk_size=chunk_size, prefix_cache_planes=prefix_cache_planes)


def random_scenario(seed: int, n: int, *, rollback=None, corruption=None, abort_share=0.0) -> Scenario:
    rng = random.Random(seed)
    reqs, arrivals, aborts, corr = [], {}, {}, {}
    for i in range(n):
        sid = f"s{i}"
        reqs.append(Request(sid, tuple(rng.randrange(1, V) for _ in range(rng.randint(1, 14))),
                            max_tokens=rng.randint(1, 20), stop_token_ids={EOS} if rng.random() < 0.5 else (),
                            speculative=spec(rng.choice([0, 2, 4, 6, 6]),
                                             rollback or rng.choice(["auto", "snapshot", "checkpoint", "replay"]))))
        arrivals[sid] = rng.randint(0, 12)
        corr[sid] = corruption if corruption is not None else rng.choice([0.0, 0.2, 0.5, 1.0])
        if rng.random() < abort_share:
            aborts[sid] = (arrivals[sid] + rng.randint(0, 8), rng.random() < 0.5)
    return Scenario(reqs, arrivals, aborts, corr, seed)


def mode_steps(run: Run) -> dict:
    total = {"snapshot": 0, "checkpoint": 0, "replay": 0}
    for evs in run.events.values():
        for mode, n in evs[-1].rollback_steps.items():
            total[mode] += n
    return total


# ---- the lossless property ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint", "replay", "auto"])
@pytest.mark.parametrize("corruption", [0.0, 0.35, 1.0])
def test_lossless_per_mode_and_acceptance(rollback, corruption):
    sc = random_scenario(7, 16, rollback=rollback, corruption=corruption)
    # Half the sequences claim a high acceptance: their replay rows write the state after their last draft.
    sc.alpha = {r.seq_id: 0.95 for r in sc.requests[::2]}
    # Few planes and pages: snapshot must shorten or fall back, requests queue, sequences get preempted.
    sched = make_scheduler(n_pages=16, n_planes=12, page_size=4, max_model_len=36, token_budget=24, max_running=6)
    run = simulate(sc, sched)
    check_events(run, sc)
    assert run.waiting_seen > 0
    steps = mode_steps(run)
    if rollback != "auto":
        assert steps[rollback] > 0 and sum(steps.values()) == steps[rollback]
    if rollback == "replay":
        replays = [r.optimistic for plan in run.plans for r in plan.rows if r.mode == "replay" and r.drafts]
        assert 0 < sum(replays) < len(replays), "both ways of replay"
    drafted = [s for evs in run.events.values() for s in evs[-1].drafters.values()]
    accepted, total = sum(s.accepted for s in drafted), sum(s.drafted for s in drafted)
    assert total > 0
    if corruption == 0.0:
        assert accepted == total
    if corruption == 1.0:
        assert accepted == 0


@pytest.mark.parametrize("rebuild_seconds,fallback", [(0.5, "replay"), (1e9, "checkpoint")])
def test_auto_uses_snapshot_and_the_cheaper_fallback_and_preempts(rebuild_seconds, fallback):
    """Snapshot where planes fit; the other sequences replay while the rebuild costs less than the tokens their
    checkpoints would replay, and checkpoint when it costs more."""
    sc = random_scenario(3, 20, rollback="auto", corruption=0.3)
    sched = make_scheduler(n_pages=14, n_planes=14, page_size=4, max_model_len=36, token_budget=32, max_running=6)
    sched.rollback_costs = RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild_seconds)
    run = simulate(sc, sched)
    check_events(run, sc)
    steps = mode_steps(run)
    assert steps["snapshot"] > 0 and steps[fallback] > 0, steps
    assert sum(steps.values()) == steps["snapshot"] + steps[fallback], steps
    assert sum(evs[-1].preemptions for evs in run.events.values()) > 0
    assert run.waiting_seen > 0


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), n=st.integers(16, 22), page_size=st.sampled_from([2, 4, 8]),
       extra_pages=st.integers(0, 24), n_planes=st.integers(3, 24), token_budget=st.integers(6, 40),
       max_running=st.integers(1, 8), chunk_size=st.sampled_from([None, 1, 3, 8]),
       replay_tokens=st.sampled_from([0, 2, 6]), rebuild_seconds=st.sampled_from([0.0, 2.0, 1e9]))
def test_lossless_random_mixes(seed, n, page_size, extra_pages, n_planes, token_budget, max_running, chunk_size,
                               replay_tokens, rebuild_seconds):
    max_model_len = 30
    sc = random_scenario(seed, n, abort_share=0.25)
    sched = make_scheduler(n_pages=1 + pages_for(max_model_len, page_size) + extra_pages, n_planes=n_planes,
                           page_size=page_size, max_model_len=max_model_len, token_budget=token_budget,
                           max_running=max_running, chunk_size=chunk_size, replay_tokens=replay_tokens)
    sched.rollback_costs = RollbackCosts(token_seconds=1.0, rebuild_seconds=rebuild_seconds)
    check_events(simulate(sc, sched), sc)


# ---- scheduling --------------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_while_others_keep_decoding():
    sched = make_scheduler(token_budget=6, chunk_size=4, max_model_len=64, n_pages=64)
    model, prompts = FakeModel(4), {}
    dec = Request("dec", (5, 6), max_tokens=30)
    long = Request("long", tuple(range(1, 23)), max_tokens=2)
    for r in (dec, long):
        prompts[r.seq_id] = r.prompt
    sched.add(dec)
    events = []
    plan = sched.schedule()
    events += sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    sched.add(long)
    chunks = []
    while sched.has_work:
        plan = sched.schedule()
        rows = {r.seq_id: r for r in plan.rows}
        if "long" in rows and not rows["long"].needs_logits:
            assert "dec" in rows and rows["dec"].logit_rows == (0,), "decoding stalls behind a prompt"
            assert rows["long"].logit_rows == ()
        if "long" in rows:
            chunks.append(len(rows["long"].fed))
        assert plan.n_tokens <= 6
        events += sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    assert chunks[:5] == [4, 4, 4, 4, 4] and sum(chunks[:6]) == 22
    long_ids = [t for e in events if e.seq_id == "long" and isinstance(e, TokensEvent) for t in e.token_ids]
    assert long_ids == reference(long, 64)[0]


def test_round_robin_when_the_budget_is_short():
    sched = make_scheduler(token_budget=6, max_running=6, max_model_len=64)
    model = FakeModel(4)
    reqs = [Request(f"r{i}", (i + 1,), max_tokens=40) for i in range(6)]
    prompts = {r.seq_id: r.prompt for r in reqs}
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert len(plan.rows) == 6
    sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    sched.token_budget = 3
    served = defaultdict(int)
    for _ in range(12):
        plan = sched.schedule()
        assert len(plan.rows) == 3
        for r in plan.rows:
            served[r.seq_id] += 1
        sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    assert set(served.values()) == {6}, served


def test_admission_waits_for_planes_and_max_running():
    sched = make_scheduler(n_planes=5, max_running=8)  # 4 usable planes: two sequences
    for i in range(3):
        sched.add(Request(f"r{i}", (1, 2), max_tokens=5))
    plan = sched.schedule()
    assert [r.seq_id for r in plan.rows] == ["r0", "r1"] and sched.n_waiting == 1
    sched.update(plan, verify_greedy(plan, FakeModel(4).run(plan, {f"r{i}": (1, 2) for i in range(3)})))
    sched2 = make_scheduler(max_running=1)
    sched2.add(Request("a", (1,), max_tokens=3))
    sched2.add(Request("b", (1,), max_tokens=3))
    assert [r.seq_id for r in sched2.schedule().rows] == ["a"]


def test_admission_leaves_a_page_per_running_sequence():
    sched = make_scheduler(n_pages=5, page_size=4, max_model_len=16, token_budget=16)
    sched.add(Request("a", (1,), max_tokens=4))
    plan = sched.schedule()
    sched.update(plan, verify_greedy(plan, FakeModel(4).run(plan, {"a": (1,)})))
    sched.add(Request("b", tuple(range(1, 13)), max_tokens=4))  # 3 pages; 3 free, "a" may need one
    assert [r.seq_id for r in sched.schedule().rows] == ["a"] and sched.n_waiting == 1


def test_lookahead_holds_an_equal_share_of_what_fits():
    """A lookahead larger than the free pages allow still holds pages ahead (each running row at most an equal
    share of the free ones), so device loops do not stop at every page end; with room, each row holds all of it."""
    prompts = {"a": (1, 2), "b": (3, 4)}

    def held_after_two_steps(sched):
        for seq_id, prompt in prompts.items():
            sched.add(Request(seq_id, prompt, max_tokens=60))
        plan = sched.schedule()  # admits both: a page each
        sched.update(plan, verify_greedy(plan, FakeModel(4).run(plan, prompts)))
        sched.schedule()  # both decode their first token at position 2, holding pages ahead
        return {seq.request.seq_id: len(seq.pages) for seq in sched._running}

    tight = make_scheduler(n_pages=21, page_size=4, max_model_len=80)  # 20 usable pages
    tight.lookahead = 400
    assert held_after_two_steps(tight) == {"a": 1 + 9, "b": 1 + 9}  # half of the 18 free pages each
    roomy = make_scheduler(n_pages=64, page_size=4, max_model_len=80)
    roomy.lookahead = 12
    assert held_after_two_steps(roomy) == {"a": pages_for(3 + 12, 4), "b": pages_for(3 + 12, 4)}


def test_lookahead_holds_pages_while_requests_wait_for_a_row():
    """With every row taken, a request waiting cannot start before a row frees, so the running rows still hold pages
    ahead (device loops then run past their page ends, instead of one page a call while anyone waits), leaving free
    what admitting the waiting request would need: its first chunk's pages and a page per running sequence."""
    prompts = {"a": (1, 2), "b": (3, 4), "c": tuple(range(1, 10))}  # c's first chunk: 3 pages of 4

    def held_after_two_steps(sched):
        for seq_id, prompt in prompts.items():
            sched.add(Request(seq_id, prompt, max_tokens=60))
        plan = sched.schedule()  # admits a and b, a page each; c waits for a row
        sched.update(plan, verify_greedy(plan, FakeModel(4).run(plan, prompts)))
        sched.schedule()
        assert sched.n_waiting == 1
        return {seq.request.seq_id: len(seq.pages) for seq in sched._running}, sched.memory.free_pages

    roomy = make_scheduler(n_pages=64, page_size=4, max_model_len=80, max_running=2)
    roomy.lookahead = 12
    assert held_after_two_steps(roomy)[0] == {"a": pages_for(3 + 12, 4), "b": pages_for(3 + 12, 4)}
    tight = make_scheduler(n_pages=21, page_size=4, max_model_len=80, max_running=2)  # 20 usable pages
    tight.lookahead = 400
    held, free = held_after_two_steps(tight)
    assert held == {"a": 1 + 6, "b": 1 + 6} and free == 18 - 12 >= 3 + 2  # (18 free - 3 for c - 2) // 2 each


def test_preemption_takes_the_youngest_and_loses_nothing():
    # 4 usable pages of 4 tokens: both sequences cannot reach 14 positions at once.
    reqs = [Request("old", (1, 2, 3), max_tokens=11, speculative=spec(2)),
            Request("young", (4, 5, 6), max_tokens=11, speculative=spec(2))]
    sc = Scenario(reqs, corruption={"old": 0.3, "young": 0.3}, seed=1)
    run = simulate(sc, make_scheduler(n_pages=5, max_model_len=16, token_budget=8))
    check_events(run, sc)
    assert run.events["old"][-1].preemptions == 0 and run.events["young"][-1].preemptions > 0


@pytest.mark.parametrize("replay_tokens,fallback", [(6, "replay"), (0, "checkpoint")])
def test_snapshot_with_few_planes_shortens_drafts_and_auto_falls_back(replay_tokens, fallback):
    sched = make_scheduler(n_planes=6, replay_tokens=replay_tokens)  # 5 usable: two sequences hold 4, one to borrow
    model = FakeModel(4)
    reqs = [Request("snap", (3,), max_tokens=20, speculative=spec(6, "snapshot")),
            Request("auto", (4,), max_tokens=20, speculative=spec(6, "auto"))]
    prompts = {r.seq_id: r.prompt for r in reqs}
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()  # the prompt step: no drafts for just-admitted sequences
    assert all(r.draft_max == 0 and r.mode is None for r in plan.rows)
    sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    plan = sched.schedule()
    snap, auto = plan.row("snap"), plan.row("auto")
    assert (snap.mode, snap.draft_max) == ("snapshot", 1)  # 1 spare + 1 borrowed plane = 2 writes
    assert (auto.mode, auto.draft_max) == (fallback, 6)
    assert len(snap.write_pool) == 2 and len(auto.write_pool) == 1
    sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    assert sched.memory.free_planes == 1


def test_memory_is_granted_for_the_policys_plan():
    """The drafter policy plans first: a sequence it does not draft for borrows no plane, one it plans a short
    draft for gets that length (not its request's n_max), and without a plan the request's n_max applies."""
    sched = make_scheduler(n_planes=16)
    model = FakeModel(4)
    reqs = [Request(name, (i + 1,), max_tokens=20, speculative=spec(6, "snapshot"))
            for i, name in enumerate(("none", "short", "unplanned"))]
    prompts = {r.seq_id: r.prompt for r in reqs}
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    assert sorted(sched.may_draft()) == ["none", "short", "unplanned"]
    free = sched.memory.free_planes
    plan = sched.schedule({"none": DraftPlan(0, 0.0), "short": DraftPlan(2, 0.7)})
    rows = {name: plan.row(name) for name in ("none", "short", "unplanned")}
    assert (rows["none"].draft_max, rows["none"].mode, len(rows["none"].write_pool)) == (0, None, 1)
    assert (rows["short"].draft_max, rows["short"].mode, len(rows["short"].write_pool)) == (2, "snapshot", 3)
    assert (rows["unplanned"].draft_max, rows["unplanned"].mode) == (6, "snapshot")
    assert free - sched.memory.free_planes == (3 - 1) + (7 - 1)  # beyond each sequence's spare plane
    sched.update(plan, verify_greedy(plan, model.run(plan, prompts)))
    assert sched.memory.free_planes == free


# ---- aborts ------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(abort_step=st.integers(0, 12), mid_flight=st.booleans(), victim=st.integers(0, 3), seed=st.integers(0, 99))
def test_abort_at_any_point_returns_memory(abort_step, mid_flight, victim, seed):
    modes = ["auto", "snapshot", "checkpoint", "replay"]
    reqs = [Request(f"s{i}", (i + 1, 2, 3, 4, 5, 6, 7)[: 2 + 2 * i], max_tokens=8, speculative=spec(3, modes[i]))
            for i in range(4)]
    sc = Scenario(reqs, {f"s{i}": i for i in range(4)}, {f"s{victim}": (abort_step, mid_flight)},
                  {f"s{i}": 0.4 for i in range(4)}, seed)
    run = simulate(sc, make_scheduler(n_planes=9, max_running=3, token_budget=10, chunk_size=3))
    check_events(run, sc)


def test_abort_unknown_twice_and_waiting():
    sched = make_scheduler(max_running=1)
    assert sched.abort("nobody") == []
    sched.add(Request("a", (1, 2), max_tokens=4))
    sched.add(Request("b", (1, 2), max_tokens=4))
    plan = sched.schedule()
    assert sched.abort("a") == []  # in flight: deferred to update
    [done_b] = sched.abort("b")  # waiting: immediate
    assert done_b.finish_reason == "cancelled" and done_b.completion_tokens == 0
    assert sched.abort("b") == [] and sched.abort("a") == []
    events = sched.update(plan, verify_greedy(plan, FakeModel(4).run(plan, {"a": (1, 2)})))
    assert [(type(e), e.finish_reason) for e in events] == [(DoneEvent, "cancelled")]
    assert not sched.has_work and sched.memory.free_planes == sched.memory.usable_planes


def test_fail_ends_the_step_with_errors():
    sched = make_scheduler()
    sched.add(Request("a", (1, 2), max_tokens=4))
    plan = sched.schedule()
    [done] = sched.fail(plan)
    assert done.finish_reason == "error"
    assert (sched.memory.free_pages, sched.memory.free_planes) == (sched.memory.usable_pages,
                                                                   sched.memory.usable_planes)



def test_rows_that_fail_end_alone_and_fail_all_ends_every_sequence():
    """A row whose detokenizer raises, and a row `update` is told failed, end with done(error) while their
    batch-mates commit as usual; `fail_all` ends every live sequence (a failure no step accounts for). Both return
    every page and plane."""

    class Raising:
        def add(self, token_id):
            raise RuntimeError("detokenizer")

        def flush(self):
            return ""

    detokenizers = iter([TableDetokenizer(), Raising(), TableDetokenizer(), TableDetokenizer()])
    mem = MemoryManager(PoolSizes(n_pages=64, n_planes=40, page_size=4))
    sched = Scheduler(mem, lambda: next(detokenizers), max_model_len=40, token_budget=48, max_running=8)
    for seq_id, prompt in [("a", (1, 2)), ("b", (3, 4)), ("c", (5, 6)), ("d", (7, 8))]:
        sched.add(Request(seq_id, prompt, max_tokens=1 if seq_id == "a" else 4))
    plan = sched.schedule()
    committed = verify_greedy(plan, FakeModel(4).run(plan, {}))
    events = sched.update(plan, {k: v for k, v in committed.items() if k != "c"},
                          failed={"c": "internal error in drafter 'x' (KeyError)"})
    done = {e.seq_id: e for e in events if isinstance(e, DoneEvent)}
    assert done["a"].finish_reason == "length"
    assert (done["b"].finish_reason, done["b"].error) == ("error", "internal error in the detokenizer (RuntimeError)")
    assert (done["c"].finish_reason, done["c"].error) == ("error", "internal error in drafter 'x' (KeyError)")
    assert [seq_id for seq_id, _ in sched.faults] == ["b"] and "d" not in done
    assert [e.token_ids for e in events if isinstance(e, TokensEvent) and e.seq_id == "d"] == \
        [(continuation((7, 8), 1)[0],)]
    assert [e.seq_id for e in sched.fail_all("boom")] == ["d"]
    assert sched.in_flight is None and not sched.has_work
    sched = make_scheduler()
    sched.add(Request("c", (1, 2), max_tokens=4))
    sched.schedule()
    sched.add(Request("d", (3, 4), max_tokens=4))
    assert [(e.seq_id, e.finish_reason) for e in sched.fail_all("boom")] == [("c", "error"), ("d", "error")]
    assert (sched.memory.free_pages, sched.memory.free_planes) == (sched.memory.usable_pages,
                                                                   sched.memory.usable_planes)
    assert sched.schedule().rows == ()



@pytest.mark.parametrize("drafter", ["mtp", None])
def test_later_iterations_drafting_on_device_are_counted_under_a_name(drafter):
    """A row that carried no draft may run later iterations with the device's drafts: they count under the drafter
    the engine names, or under a string placeholder (a None key cannot be sent in a done frame)."""
    sched = make_scheduler()
    sched.add(Request("a", (1, 2), max_tokens=5, speculative=spec(2, "snapshot")))
    sched.update(sched.schedule(), {"a": Committed((5,), 0)})  # the prompt
    plan = sched.schedule()
    [row] = plan.rows
    assert row.mode == "snapshot" and row.draft_max == 2 and row.drafter is None
    events = sched.update(plan, {"a": Committed((6,), 0)},
                          {"a": [Continued((7, 8), Committed((7, 8, 9), 2), drafter)]})  # fmt: skip
    done = events[-1]
    assert done.finish_reason == "length"
    assert dict(done.drafters) == {drafter or UNNAMED_DRAFTER: DraftStats(2, 2, drafts=1, accepted_per_position=(1, 1))}


def test_a_steps_iterations_reach_the_stream_as_one_tokens_event():
    """A row's later iterations in one step are one burst: one tokens event holding every token in order, with
    the accepted drafts summed (events are what the engine hands to the streams, one by one)."""
    sched = make_scheduler()
    sched.add(Request("a", (1, 2), max_tokens=20, speculative=spec(2, "snapshot")))
    sched.update(sched.schedule(), {"a": Committed((5,), 0)})
    later = [Continued((7, 8), Committed((7, 8, 9), 2), "mtp"), Continued((3, 4), Committed((3, 6), 1), "mtp"),
             Continued((), Committed((10,), 0), "mtp")]  # fmt: skip
    events = sched.update(sched.schedule(), {"a": Committed((6,), 0)}, {"a": later})
    assert events == [TokensEvent("a", (6, 7, 8, 9, 3, 6, 10), events[0].text, 3)]


def test_iterations_after_a_stop_token_are_not_the_sequences():
    """A stop token in a later iteration ends the burst there: the tokens before it in one event, then done; the
    iterations after it are neither emitted nor counted in the drafter's statistics."""
    sched = make_scheduler()
    sched.add(Request("a", (1, 2), max_tokens=20, stop_token_ids=frozenset({4}), speculative=spec(2, "snapshot")))
    sched.update(sched.schedule(), {"a": Committed((5,), 0)})
    later = [Continued((7, 8), Committed((7, 8, 9), 2), "mtp"), Continued((3, 4), Committed((3, 4, 6), 2), "mtp"),
             Continued((11, 12), Committed((11, 12, 13), 2), "mtp")]  # fmt: skip
    events = sched.update(sched.schedule(), {"a": Committed((6,), 0)}, {"a": later})
    assert [type(e) for e in events] == [TokensEvent, DoneEvent]
    assert events[0].token_ids == (6, 7, 8, 9, 3) and events[0].n_from_drafts == 3
    done = events[1]
    assert done.finish_reason == "stop" and done.completion_tokens == 7
    assert dict(done.drafters) == {"mtp": DraftStats(4, 4, drafts=2, accepted_per_position=(2, 2))}
    assert (sched.memory.free_pages, sched.memory.free_planes) == (sched.memory.usable_pages,
                                                                   sched.memory.usable_planes)


# ---- stops -------------------------------------------------------------------------------------------------


def scripted(req: Request, script: list[int], **sched_kw) -> Run:
    """One request whose target emits `script`; the drafter proposes the script (all accepted)."""
    sc = Scenario([req])
    return simulate(sc, make_scheduler(**sched_kw), script={req.seq_id: script})


def outputs(run: Run, sid) -> tuple[list[int], str, DoneEvent]:
    evs = run.events[sid]
    return ([t for e in evs[:-1] for t in e.token_ids], "".join(e.text for e in evs[:-1]), evs[-1])


@pytest.mark.parametrize("n_max", [0, 4])
def test_stop_string_across_tokens_is_never_emitted(n_max):
    # a | b | c | ab  -> text "abcab": stop "bca" spans tokens 2..4 ("b" "c" "ab").
    req = Request("s", (1,), max_tokens=20, stop_strings=("bca",), speculative=spec(n_max))
    run = scripted(req, [1, 2, 3, 4, 8, 8, 8, 8, 8, 8])
    ids, text, done = outputs(run, "s")
    assert text == "a" and ids == [1, 2, 3, 4] and done.finish_reason == "stop"
    assert done.completion_tokens == 4
    texts = [e.text for e in run.events["s"][:-1]]
    assert all("b" not in t for t in texts)


def test_held_back_text_is_released_when_no_stop_follows():
    req = Request("s", (1,), max_tokens=3, stop_strings=("abx",))
    ids, text, done = outputs(scripted(req, [1, 2, 2, 9]), "s")
    assert (ids, text, done.finish_reason) == ([1, 2, 2], "abb", "length")
    req = Request("s", (1,), max_tokens=3, stop_strings=("bbb",))
    run = scripted(req, [1, 2, 2, 9])
    assert [e.text for e in run.events["s"][:-1]] == ["a", "", "bb"]  # "b", "bb" held until the end


@pytest.mark.parametrize("n_max", [0, 5])
def test_stop_token_is_not_emitted_and_later_tokens_dropped(n_max):
    req = Request("s", (1,), max_tokens=20, stop_token_ids={EOS}, speculative=spec(n_max))
    ids, text, done = outputs(scripted(req, [8, 9, EOS, 8, 8, 8, 8, 8, 8]), "s")
    assert (ids, text, done.finish_reason, done.completion_tokens) == ([8, 9], "xyz", "stop", 3)


@pytest.mark.parametrize("n_max", [0, 6])
def test_max_tokens_cuts_accepted_drafts(n_max):
    req = Request("s", (1,), max_tokens=5, speculative=spec(n_max))
    run = scripted(req, [8] * 20)
    ids, _, done = outputs(run, "s")
    assert (ids, done.finish_reason, done.completion_tokens) == ([8] * 5, "length", 5)
    for plan in run.plans:
        for row in plan.rows:  # the 5th output token (position 5) is committed, never fed
            assert row.start + len(row.fed) + row.draft_max <= 5
    assert n_max == 0 or sum(e.n_from_drafts for e in run.events["s"][:-1]) > 0


def test_context_length():
    req = Request("s", (1, 2, 3, 4, 5, 6, 7), max_tokens=50, speculative=spec(4))
    run = scripted(req, [8] * 20, max_model_len=10)
    ids, _, done = outputs(run, "s")
    assert (ids, done.finish_reason) == ([8, 8, 8], "length")
    assert max(r.start + len(r.tokens) for p in run.plans for r in p.rows) <= 9


def test_stop_scan():
    assert scan_stop_strings("abc", ["bcd"]) == scan_stop_strings("abc", ("bcd", "zz"))
    s = scan_stop_strings("abc", ["bcd"])
    assert (s.emit, s.held, s.stopped) == ("a", "bc", False)
    s = scan_stop_strings("bcx", ["bcd"])
    assert (s.emit, s.held, s.stopped) == ("bcx", "", False)
    s = scan_stop_strings("xbcdbc", ["cd", "bcd"])
    assert (s.emit, s.held, s.stopped) == ("x", "", True)
    assert scan_stop_strings("abc", []).emit == "abc"


# ---- API misuse --------------------------------------------------------------------------------------------


def test_misuse_is_refused():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError):
        sched.add(Request("long", tuple(range(1, 9)), max_tokens=2))
    with pytest.raises(ValueError):
        Request("e", (), max_tokens=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(("fake",), rollback="sometimes")
    sched.add(Request("a", (1,), max_tokens=4, speculative=spec(2)))
    with pytest.raises(ValueError):
        sched.add(Request("a", (1,), max_tokens=4))
    plan = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        plan.with_drafts({"a": [1]})  # the prompt step carries no drafts
    with pytest.raises(ValueError):
        plan.with_drafts({"zz": []})
    with pytest.raises(ValueError):
        sched.update(plan, {})
    with pytest.raises(ValueError):
        Committed((1, 2), 0)


# ---- the prefix cache --------------------------------------------------------------------------------------


def shared_prefix_scenario(seed: int, n: int, max_model_len: int, *, abort_share: float = 0.0) -> Scenario:
    """Requests starting with one of a few shared prefixes (system prompts), and later turns of earlier requests:
    an earlier prompt, what it decodes alone, and a new message."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1, V) for _ in range(rng.randint(3, 14))) for _ in range(3)]
    reqs, arrivals, aborts, corr = [], {}, {}, {}
    for i in range(n):
        sid = f"s{i}"
        earlier = [r for r in reqs if len(r.prompt) + r.max_tokens + 3 < max_model_len - 4]
        if earlier and rng.random() < 0.4:
            before = rng.choice(earlier)
            answer = continuation(before.prompt, before.max_tokens)
            prompt = before.prompt + tuple(answer[: rng.randint(0, len(answer))])
        else:
            prompt = rng.choice(prefixes)
        prompt += tuple(rng.randrange(1, V) for _ in range(rng.randint(1, 4)))
        reqs.append(Request(sid, prompt, max_tokens=rng.randint(1, max(1, min(8, max_model_len - len(prompt) - 1))),
                            speculative=spec(rng.choice([0, 2, 4]),
                                             rng.choice(["auto", "snapshot", "checkpoint", "replay"]))))
        arrivals[sid] = i + rng.randint(0, 6)
        corr[sid] = rng.choice([0.0, 0.3, 1.0])
        if rng.random() < abort_share:
            aborts[sid] = (arrivals[sid] + rng.randint(0, 6), rng.random() < 0.5)
    return Scenario(reqs, arrivals, aborts, corr, seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), page_size=st.sampled_from([2, 4]), extra_pages=st.integers(0, 30),
       n_planes=st.integers(3, 24), cache_planes=st.integers(1, 8), max_running=st.integers(1, 6),
       chunk_size=st.sampled_from([None, 3, 8]), abort_share=st.sampled_from([0.0, 0.2]))
def test_lossless_with_the_prefix_cache(seed, page_size, extra_pages, n_planes, cache_planes, max_running, chunk_size,
                                        abort_share):
    """Requests sharing prefixes start from cached states (copied planes, shared pages) and decode what they would
    alone, under every rollback mode, with preemptions, evictions and aborts; the memory all comes back."""
    max_model_len = 32
    sc = shared_prefix_scenario(seed, 18, max_model_len, abort_share=abort_share)
    sched = make_scheduler(n_pages=1 + pages_for(max_model_len, page_size) + extra_pages,
                           n_planes=n_planes + cache_planes, page_size=page_size, max_model_len=max_model_len,
                           token_budget=24, max_running=max_running, chunk_size=chunk_size,
                           prefix_cache_planes=cache_planes)
    run = simulate(sc, sched)
    check_events(run, sc)


def test_a_shared_prefix_is_computed_twice_then_shared():
    """The first request keeps its prompt's last block; the second, sharing two blocks with it, keeps the state at
    their end; the third starts there, sharing those blocks' pages with the second while both run, and copying the
    page of the boundary's last position."""
    system = (5, 6, 7, 8, 9, 10, 11, 12, 13)  # two blocks of 4 and one token
    sched = make_scheduler(n_pages=40, n_planes=20, page_size=4, max_model_len=40, prefix_cache_planes=4)
    reqs = [Request("a", system + (1, 2, 3, 4), max_tokens=3), Request("b", system + (3,), max_tokens=12),
            Request("c", system + (4, 4), max_tokens=3)]
    sc = Scenario(reqs, {"a": 0, "b": 6, "c": 14})
    seen, running = {}, {}

    def watch(plan):
        for row in plan.rows:
            seen.setdefault(row.seq_id, (row.start, row.pages))
            running.setdefault(row.seq_id, {"a", "b"} & {r.seq_id for r in plan.rows})
    run = simulate(sc, sched, on_plan=watch)
    check_events(run, sc)
    done = {sid: evs[-1] for sid, evs in run.events.items()}
    assert (done["a"].cached_tokens, done["b"].cached_tokens, done["c"].cached_tokens) == (0, 0, 8)
    assert seen["c"][0] == 8
    assert seen["c"][1][0] == seen["b"][1][0] and seen["c"][1][1] != seen["b"][1][1]  # block 1 shared, 2 copied
    assert sched.prefix_hits == 1 and running["c"] == {"b"}
