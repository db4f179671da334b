"""The synchronous scheduler core: which tokens of which sequences each model step computes. No I/O.

Use, one step at a time:

    plan = sched.schedule()                         # rows, each with its draft_max and rollback mode
    plan = plan.with_drafts({seq_id: tokens})       # drafts made in between (optional, possibly empty)
    ...run the model on plan.rows and verify...
    events = sched.update(plan, {seq_id: Committed(tokens, n_accepted)})   # rows with logit_rows only

There is no prefill or decode phase. A sequence is its committed tokens (prompt + output, append-only) of which
the first `n_computed` are in its KV pages and its live GDN plane; a step feeds a prefix of the rest (a prompt
chunk) or all of it (replayed tokens, then `last`, the newest token) followed by drafts. Rollback (see
`scheduler.memory` for the choice of mode):
- snapshot: the state after `last` and after each draft goes to its own plane; after a accepted drafts the plane
  holding the state after drafts[a-1] (or `last`) becomes live and everything up to it counts as computed;
- checkpoint: only the final state is written, to the spare plane; it becomes live if every draft was accepted,
  otherwise the read plane stays live and all tokens fed since it are replayed in the next step;
- replay: the state after `last` is written to the spare plane and the device advances it by the accepted drafts
  in the same call; it becomes live and everything up to the last accepted draft counts as computed.
The attention KV needs no rollback: n_computed is set back and later writes overwrite.

Per step, in order:
1. Running sequences, least recently served first (rows that only feed `last` before longer ones, then by
   admission), each feed min(tokens to compute, chunk_size, remaining token budget). A sequence whose row needs a
   KV page when none is free preempts the youngest running sequence (itself when it is the youngest): its pages
   and planes go back and it waits at the head of the queue to recompute its tokens (nothing is lost or emitted
   twice). The oldest sequence is never preempted, so every step makes progress.
2. Drafts: rows that reach `last` with at most n_max replayed tokens before it may carry drafts; the memory manager
   decides their length and mode from the remaining budget, pages and planes (keeping two planes free per request
   that could be admitted next).
3. Admission, first come first served, while running < max_running, budget remains, two planes are free and the
   first chunk's pages leave one free page per running sequence (room to grow before anyone is preempted).
Device loops run a row until the end of its pages, so rows also hold pages ahead (`lookahead`) while nobody waits,
or while every row is taken (a waiting request can start only when a row frees; its first chunk's pages stay free).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

from .memory import DraftCandidate, MemoryManager, RollbackCosts, pages_for
from .stops import scan_stop_strings
from .types import (UNNAMED_DRAFTER, Committed, Continued, Detokenizer, DoneEvent, DraftPlan, DraftStats, Event,
                    FinishReason, Mode, Request, PlannedRow, SeqId, StepPlan, TokensEvent)

PLANES_PER_SEQUENCE = 2
PRIOR_ACCEPTANCE = 0.5  # acceptance assumed for a sequence without a draft plan (see `schedule`)


@dataclass(eq=False)
class _Sequence:
    """Mutable bookkeeping of one request, private to the scheduler (compared by identity)."""

    request: Request
    detokenizer: Detokenizer
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    n_computed: int = 0  # tokens whose KV and GDN state are in pages / the live plane
    live_plane: int = 0  # 0 = the null plane (nothing computed)
    planes: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    admitted: int = -1  # admission order, -1 while waiting
    last_served: int = -1  # step of the last row
    n_generated: int = 0
    held_text: str = ""
    abort_requested: bool = False
    preemptions: int = 0
    draft_stats: dict[str, list[int]] = field(default_factory=dict)
    rollback_steps: dict[str, int] = field(default_factory=lambda: {"snapshot": 0, "checkpoint": 0, "replay": 0})

    @property
    def running(self) -> bool:
        return self.admitted >= 0

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.n_computed


@dataclass(eq=False)
class _Burst:
    """What one row's step committed, gathered over its iterations into one tokens event (`Scheduler._append`)."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    n_from_drafts: int = 0
    reason: FinishReason | None = None


@dataclass(eq=False)
class _RowSpec:
    seq: _Sequence
    n_feed: int
    draft_max: int = 0
    mode: Mode | None = None
    optimistic: bool = False


class Scheduler:
    """Sans-I/O scheduler over a `MemoryManager`. One plan in flight at a time.

    detokenizer: makes one incremental detokenizer per request (for stop strings and text deltas).
    max_model_len: positions per sequence; prompt + output never exceed it (finish reason "length").
    token_budget: tokens fed per step, drafts included (an attribute the engine may change between steps).
    max_running: sequences holding memory at once.
    chunk_size: the most tokens one row feeds before its drafts (prompt chunks, replays); default token_budget.
    lookahead: positions beyond a step's tokens worth holding pages for, while nobody waits (the tokens a device
    call's later iterations may commit).
    """

    def __init__(self, memory: MemoryManager, detokenizer: Callable[[], Detokenizer], *, max_model_len: int,
                 token_budget: int, max_running: int, chunk_size: int | None = None, lookahead: int = 0):
        if token_budget < 1 or max_running < 1 or max_model_len < 2:
            raise ValueError("token_budget and max_running must be >= 1, max_model_len >= 2")
        if pages_for(max_model_len, memory.page_size) > memory.usable_pages:
            raise ValueError(f"{memory.usable_pages} pages of {memory.page_size} cannot hold one sequence of "
                             f"{max_model_len} positions")
        if memory.usable_planes < PLANES_PER_SEQUENCE:
            raise ValueError(f"{memory.usable_planes} planes; a sequence needs {PLANES_PER_SEQUENCE}")
        self.memory = memory
        self.max_model_len = max_model_len
        self.token_budget = token_budget
        self.max_running = max_running
        self.chunk_size = chunk_size or token_budget
        self.lookahead = lookahead
        self.rollback_costs = RollbackCosts()  # what replay and checkpoint cost, for rollback="auto" (`schedule`)
        self._detokenizer = detokenizer
        self._seqs: dict[SeqId, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._n_admitted = 0
        self._step = 0
        self._in_flight: StepPlan | None = None
        self.faults: list[tuple[SeqId, Exception]] = []  # the last `update`'s rows whose detokenizer raised

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def n_waiting(self) -> int:
        """Requests queued (never admitted or preempted)."""
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        """Requests holding memory."""
        return len(self._running)

    @property
    def in_flight(self) -> StepPlan | None:
        """The plan scheduled and not yet updated or failed."""
        return self._in_flight

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def tokens(self, seq_id: SeqId) -> Sequence[int]:
        """The committed tokens of a live sequence (prompt + output), by reference: read only; they only grow."""
        return self._seqs[seq_id].tokens

    def request(self, seq_id: SeqId) -> Request:
        """The request of a live sequence."""
        return self._seqs[seq_id].request

    def remaining(self, seq_id: SeqId) -> int:
        """Tokens the sequence may still commit before it ends by length (max_tokens or the context length)."""
        seq = self._seqs[seq_id]
        return min(seq.request.max_tokens - seq.n_generated, self.max_model_len - len(seq.tokens))

    # ---- requests in ---------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. ValueError for a live duplicate id or a prompt that leaves no room to generate."""
        if request.seq_id in self._seqs:
            raise ValueError(f"sequence {request.seq_id!r} is already live")
        if len(request.prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(request.prompt)} tokens leaves no room in {self.max_model_len} "
                             "positions")
        seq = _Sequence(request=request, detokenizer=self._detokenizer(), tokens=list(request.prompt))
        self._seqs[request.seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: SeqId) -> list[Event]:
        """Cancel a sequence: done(cancelled) now, or from `update` when it is in the plan in flight.

        Unknown or finished ids give no event, so each sequence ends exactly once.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.abort_requested:
            return []
        if self._in_flight is not None and any(r.seq_id == seq_id for r in self._in_flight.rows):
            seq.abort_requested = True
            return []
        return [self._finish(seq, "cancelled")]

    # ---- one step ------------------------------------------------------------------------------------------

    def may_draft(self) -> list[SeqId]:
        """The running sequences whose next row may carry a draft (they reach their newest token within a chunk and
        their request drafts): the ones the drafter policy plans for before `schedule`."""
        return [seq.request.seq_id for seq in self._running
                if seq.request.n_max > 0 and 0 < seq.to_compute <= self.chunk_size]

    def schedule(self, drafts: Mapping[SeqId, DraftPlan] | None = None,
                 rollback_costs: RollbackCosts | None = None) -> StepPlan:
        """The next step's plan. Its rows must be committed with `update` (or dropped with `fail`) before the next.
        A plan without rows needs neither.

        drafts: the drafter policy's plan per sequence, made first; memory is then granted for it (a draft may come
        out shorter, never longer). A sequence without an entry may draft up to its request's n_max, at an assumed
        acceptance of PRIOR_ACCEPTANCE. rollback_costs: what each rollback mode costs now, for rollback="auto" (kept
        for the steps that follow without).
        """
        if rollback_costs is not None:
            self.rollback_costs = rollback_costs
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step} is still in flight")
        self._step += 1
        budget = self.token_budget
        specs: list[_RowSpec] = []

        order = sorted(self._running, key=lambda s: (s.last_served, s.to_compute > 1, s.admitted))
        for seq in order:
            if not seq.running or budget == 0:
                continue
            n_feed = min(seq.to_compute, self.chunk_size, budget)
            need = pages_for(seq.n_computed + n_feed, self.memory.page_size) - len(seq.pages)
            while need > self.memory.free_pages and seq.running:
                victim = max(self._running, key=lambda s: s.admitted)
                for spec in [s for s in specs if s.seq is victim]:
                    specs.remove(spec)
                    budget += spec.n_feed
                self._preempt(victim)
            if not seq.running:
                continue
            seq.pages += self.memory.take_pages(max(0, need))
            specs.append(_RowSpec(seq, n_feed))
            budget -= n_feed

        budget = self._grant_drafts(specs, budget, drafts or {})
        if self.lookahead and (not self._waiting or len(self._running) >= self.max_running):
            self._hold_lookahead(specs)

        while self._waiting and len(self._running) < self.max_running and budget > 0:
            seq = self._waiting[0]
            n_feed = min(seq.to_compute, self.chunk_size, budget)
            need = pages_for(n_feed, self.memory.page_size)
            if (self.memory.free_planes < PLANES_PER_SEQUENCE
                    or self.memory.free_pages < need + len(self._running)):
                break
            self._waiting.popleft()
            seq.planes = self.memory.take_planes(PLANES_PER_SEQUENCE)
            seq.pages = self.memory.take_pages(need)
            seq.admitted = self._n_admitted
            self._n_admitted += 1
            self._running.append(seq)
            specs.append(_RowSpec(seq, n_feed))
            budget -= n_feed

        for spec in specs:
            spec.seq.last_served = self._step
        plan = StepPlan(self._step, tuple(self._row(spec) for spec in specs))
        self._in_flight = plan if plan.rows else None
        return plan

    def update(self, plan: StepPlan, committed: Mapping[SeqId, Committed],
               continued: Mapping[SeqId, Sequence[Continued]] | None = None,
               failed: Mapping[SeqId, str] | None = None) -> list[Event]:
        """Commit a step: `committed` holds, for every row with logit_rows, the verified tokens; `continued`, for
        rows that ran later iterations in the same step, what each of them fed and committed; `failed`, for rows
        whose part of the step failed, the error each ends with (done, finish_reason "error"; the others go on).
        A row whose detokenizer raises ends the same way ("internal error in the detokenizer"), its exception kept
        in `faults` for the caller to report.

        A continued row's iterations each read the live plane and write into the row's planes (its read plane,
        then its write pool) minus the live one, in that order, in snapshot mode; the scheduler follows the same
        rule. Returns the events of this step, in row order: one tokens event per sequence (all its iterations' tokens,
        one burst for its stream), then done for sequences that finished.
        """
        self._check_in_flight(plan)
        failed = failed or {}
        self.faults = []
        for row in plan.rows:
            if row.needs_logits and not self._seqs[row.seq_id].abort_requested and row.seq_id not in failed:
                result = committed.get(row.seq_id)
                if result is None:
                    raise ValueError(f"no committed tokens for sequence {row.seq_id!r} in step {plan.step}")
                if result.n_accepted > len(row.drafts):
                    raise ValueError(f"sequence {row.seq_id!r}: {result.n_accepted} accepted of "
                                     f"{len(row.drafts)} drafts")
        events: list[Event] = []
        for row in plan.rows:
            seq = self._seqs[row.seq_id]
            if seq.abort_requested:
                events.append(self._finish(seq, "cancelled"))
            elif row.seq_id in failed:
                events.append(self._finish(seq, "error", failed[row.seq_id]))
            elif not row.needs_logits:
                seq.n_computed += len(row.fed)
                seq.live_plane = row.write_planes[-1]
                self._trim_planes(seq)
            else:
                result = committed[row.seq_id]
                later = (continued or {}).get(row.seq_id, ())
                self._roll(seq, row, result.n_accepted, trim=not later)
                burst = _Burst()
                try:
                    if not self._append(seq, result, burst) and later:
                        self._continue(seq, row, later, burst)
                except Exception as exc:  # the detokenizer's: the sequence ends, its batch-mates go on
                    self.faults.append((row.seq_id, exc))
                    message = f"internal error in the detokenizer ({type(exc).__name__})"
                    events.append(self._finish(seq, "error", message))
                    continue
                events += self._emit(seq, burst)
        self._in_flight = None
        return events

    def _continue(self, seq: _Sequence, row: PlannedRow, later: Sequence[Continued], burst: _Burst) -> None:
        """Advance and append a row's later iterations into `burst`, until the sequence finishes."""
        planes = (row.read_plane,) + row.write_pool
        mode = "snapshot" if len(row.write_pool) > 1 else row.mode
        for iteration in later:
            n_drafts = len(iteration.drafts)
            pool = tuple(p for p in planes if p != seq.live_plane)[: len(row.write_pool)]
            self._advance(seq, mode, start=len(seq.tokens) - 1, n_fed=1, write_pool=pool, n_drafts=n_drafts,
                          n_accepted=iteration.committed.n_accepted,
                          drafter=(iteration.drafter or row.drafter or UNNAMED_DRAFTER) if n_drafts else None)
            if self._append(seq, iteration.committed, burst):
                return  # finished: the iterations after it are not the sequence's
        self._trim_planes(seq)

    def _hold_lookahead(self, specs: list[_RowSpec]) -> None:
        """Best effort: pages for up to `lookahead` positions past each row's tokens, each row taking at most an
        equal share of the free pages (so that holding them never keeps another running sequence from its share,
        and a lookahead larger than memory allows still holds what fits). Requests waiting (for a row: this runs
        then only with every row taken) keep what admitting them would need: their first chunks' pages, and a free
        page per running sequence."""
        limit = pages_for(self.max_model_len, self.memory.page_size)
        reserve = sum(pages_for(min(seq.to_compute, self.chunk_size), self.memory.page_size)
                      for seq in islice(self._waiting, self.max_running))
        reserve += len(self._running) if self._waiting else 0
        share = max(0, self.memory.free_pages - reserve) // max(len(self._running), 1)
        for spec in specs:
            seq = spec.seq
            end = seq.n_computed + spec.n_feed + spec.draft_max + self.lookahead
            want = min(pages_for(end, self.memory.page_size), limit, len(seq.pages) + share) - len(seq.pages)
            if want > 0:
                seq.pages += self.memory.take_pages(want)

    def fail(self, plan: StepPlan, error: str = "the step failed") -> list[Event]:
        """The step could not run: every sequence in it ends with done(error) (cancelled if it was aborted).

        Also valid after `update` raised part way: sequences it already finished are gone and give no event."""
        self._check_in_flight(plan)
        self._in_flight = None
        events: list[Event] = []
        for row in plan.rows:
            seq = self._seqs.get(row.seq_id)
            if seq is not None:
                events.append(self._finish(seq, "cancelled" if seq.abort_requested else "error", error))
        return events

    def fail_all(self, error: str) -> list[Event]:
        """Every live sequence ends with done(error): for a failure no step in flight accounts for."""
        self._in_flight = None
        return [self._finish(seq, "error", error) for seq in list(self._seqs.values())]

    # ---- internals -----------------------------------------------------------------------------------------

    def _check_in_flight(self, plan: StepPlan) -> None:
        if self._in_flight is None or plan.step != self._in_flight.step:
            raise RuntimeError(f"step {plan.step} is not the step in flight")
        if [r.seq_id for r in plan.rows] != [r.seq_id for r in self._in_flight.rows]:
            raise RuntimeError(f"step {plan.step}: rows differ from the scheduled plan")

    def _grant_drafts(self, specs: list[_RowSpec], budget: int, drafts: Mapping[SeqId, DraftPlan]) -> int:
        """Give rows that reach `last` their draft length and mode; returns the budget left."""
        candidates = []
        for spec in specs:
            seq, req = spec.seq, spec.seq.request
            reaches_last = spec.n_feed == seq.to_compute
            pending = spec.n_feed - 1
            plan = drafts.get(req.seq_id, DraftPlan(req.n_max, PRIOR_ACCEPTANCE))
            want = min(plan.n_draft, req.n_max,
                       req.max_tokens - seq.n_generated - 1,
                       self.max_model_len - len(seq.tokens) - 1)
            if not reaches_last or pending > req.n_max or want <= 0:
                continue
            spare = len(seq.planes) - (seq.live_plane != 0)
            candidates.append(DraftCandidate(seq.request.seq_id, want, req.rollback,
                                             kv_end=seq.n_computed + spec.n_feed, pages_owned=len(seq.pages),
                                             spare_planes=spare, n_pending=pending, alpha=plan.alpha,
                                             pending_max=req.n_max))  # fmt: skip
        if not candidates:
            return budget
        reserve = PLANES_PER_SEQUENCE * min(len(self._waiting), self.max_running - len(self._running))
        by_id = {spec.seq.request.seq_id: spec for spec in specs}
        for decision in self.memory.decide_drafts(candidates, budget, reserve_planes=reserve,
                                                  costs=self.rollback_costs):
            spec = by_id[decision.seq_id]
            spec.seq.pages += self.memory.take_pages(decision.new_pages)
            spec.seq.planes += self.memory.take_planes(decision.new_planes)
            spec.draft_max, spec.mode, spec.optimistic = decision.n_drafts, decision.mode, decision.optimistic
            budget -= decision.n_drafts
        return budget

    def _row(self, spec: _RowSpec) -> PlannedRow:
        seq = spec.seq
        spare = [p for p in seq.planes if p != seq.live_plane]
        n_write = spec.draft_max + 1 if spec.mode == "snapshot" else 1
        return PlannedRow(seq_id=seq.request.seq_id, fed=tuple(seq.tokens[seq.n_computed:seq.n_computed + spec.n_feed]),
                   start=seq.n_computed, read_plane=seq.live_plane, pages=tuple(seq.pages),
                   needs_logits=spec.n_feed == seq.to_compute, draft_max=spec.draft_max, mode=spec.mode,
                   write_pool=tuple(spare[:n_write]), optimistic=spec.optimistic,
                   speculative=seq.request.speculative)

    def _roll(self, seq: _Sequence, row: PlannedRow, n_accepted: int, trim: bool = True) -> None:
        """Move the live plane and n_computed after verification (tokens are appended by `_append`)."""
        self._advance(seq, row.mode, row.start, len(row.fed), row.write_pool, len(row.drafts), n_accepted,
                      row.drafter)
        if trim:
            self._trim_planes(seq)

    @staticmethod
    def _advance(seq: _Sequence, mode: Mode, start: int, n_fed: int, write_pool: tuple[int, ...],
                 n_drafts: int, n_accepted: int, drafter: str | None) -> None:
        """`_roll` for a step of n_fed tokens from `start` and n_drafts drafts, of which n_accepted were accepted
        (also each later iteration of a looping call, which feeds one token and builds no `PlannedRow`). The planes are
        `PlannedRow.write_planes`: snapshot wrote the state after `last` and each draft to write_pool in turn; replay
        rebuilt its plane on device; otherwise the one plane holds the state after every token fed, valid only
        when every draft was accepted."""
        if mode == "snapshot":
            seq.live_plane = write_pool[n_accepted]
            seq.n_computed = start + n_fed + n_accepted
        elif mode == "replay":
            seq.live_plane = write_pool[0]
            seq.n_computed = start + n_fed + n_accepted
        elif n_accepted == n_drafts:
            seq.live_plane = write_pool[0]
            seq.n_computed = start + n_fed + n_drafts
        if n_drafts:
            stats = seq.draft_stats.setdefault(drafter, [0, 0])
            stats[0] += n_drafts
            stats[1] += n_accepted
            seq.rollback_steps[mode] += 1

    def _append(self, seq: _Sequence, result: Committed, burst: _Burst) -> bool:
        """Append one verified row's tokens to the sequence and to `burst`, up to a stop; True when that finished
        the sequence (`burst.reason` says why; `_emit` then ends it)."""
        req = seq.request
        n_ids = len(burst.ids)
        reason: FinishReason | None = None
        cut_by_stop_string = False
        for token in result.tokens:
            seq.n_generated += 1
            seq.tokens.append(token)
            if token in req.stop_token_ids:
                reason = "stop"
                break
            burst.ids.append(token)
            if req.stop_strings:
                scan = scan_stop_strings(seq.held_text + seq.detokenizer.add(token), req.stop_strings)
                burst.text.append(scan.emit)
                seq.held_text = scan.held
                if scan.stopped:
                    reason, cut_by_stop_string = "stop", True
                    break
            else:
                burst.text.append(seq.detokenizer.add(token))
            if seq.n_generated == req.max_tokens or len(seq.tokens) == self.max_model_len:
                reason = "length"
                break
        burst.n_from_drafts += min(result.n_accepted, len(burst.ids) - n_ids)
        if reason is not None and not cut_by_stop_string:
            # The end of the output: held-back text is no stop string after all, unless the flush completes one.
            scan = scan_stop_strings(seq.held_text + seq.detokenizer.flush(), req.stop_strings)
            burst.text.append(scan.emit if scan.stopped else scan.emit + scan.held)
            reason = "stop" if scan.stopped else reason
        burst.reason = reason
        return reason is not None

    def _emit(self, seq: _Sequence, burst: _Burst) -> list[Event]:
        """A burst's events: its tokens (if any), then done if the sequence finished."""
        events: list[Event] = []
        text = "".join(burst.text)
        if burst.ids or text:
            events.append(TokensEvent(seq.request.seq_id, tuple(burst.ids), text, burst.n_from_drafts))
        if burst.reason is not None:
            events.append(self._finish(seq, burst.reason))
        return events

    def _trim_planes(self, seq: _Sequence) -> None:
        """Keep the live plane and one spare (two spares before anything is computed); return the rest."""
        keep = [seq.live_plane] if seq.live_plane else []
        others = [p for p in seq.planes if p != seq.live_plane]
        n_spare = PLANES_PER_SEQUENCE - len(keep)
        self.memory.give_planes(others[n_spare:])
        seq.planes = keep + others[:n_spare]

    def _release(self, seq: _Sequence) -> None:
        self.memory.give_pages(seq.pages)
        self.memory.give_planes(seq.planes)
        seq.pages, seq.planes = [], []
        seq.n_computed, seq.live_plane = 0, 0

    def _preempt(self, seq: _Sequence) -> None:
        self._release(seq)
        self._running.remove(seq)
        seq.admitted = -1
        seq.preemptions += 1
        self._waiting.appendleft(seq)

    def _finish(self, seq: _Sequence, reason: FinishReason, error: str | None = None) -> DoneEvent:
        self._release(seq)
        if seq.running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        del self._seqs[seq.request.seq_id]
        return DoneEvent(
            seq_id=seq.request.seq_id, finish_reason=reason, prompt_tokens=len(seq.request.prompt),
            completion_tokens=seq.n_generated,
            drafters={name: DraftStats(d, a) for name, (d, a) in seq.draft_stats.items()},
            rollback_steps=dict(seq.rollback_steps), preemptions=seq.preemptions, error=error)
