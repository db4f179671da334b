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
from itertools import islice

from .grants import grant_drafts, hold_lookahead
from .memory import MemoryManager, RollbackCosts, pages_for
from .prefix_cache import CachedPrefix, PrefixCache, chain_hashes
from .sequence import Burst, RowSpec, SequenceState
from .types import (Committed, Continued, Detokenizer, DoneEvent, DraftPlan, Event,
                    FinishReason, PlannedRow, Request, SeqId, StepPlan, TokensEvent)

PLANES_PER_SEQUENCE = 2


class Scheduler:
    """Sans-I/O scheduler over a `MemoryManager`. One plan in flight at a time.

    detokenizer: makes one incremental detokenizer per request (for stop strings and text deltas).
    max_model_len: positions per sequence; prompt + output never exceed it (finish reason "length").
    token_budget: tokens fed per step, drafts included (an attribute the engine may change between steps).
    max_running: sequences holding memory at once.
    chunk_size: the most tokens one row feeds before its drafts (prompt chunks, replays); default token_budget.
    lookahead: positions beyond a step's tokens worth holding pages for, while nobody waits (the tokens a device
    call's later iterations may commit).
    prefix_cache_planes: the most states the prefix cache keeps (`scheduler.prefix_cache`; 0: no cache), evicted
    least recently used first whenever sequences need the memory.
    """

    def __init__(self, memory: MemoryManager, detokenizer: Callable[[], Detokenizer], *, max_model_len: int,
                 token_budget: int, max_running: int, chunk_size: int | None = None, lookahead: int = 0,
                 prefix_cache_planes: int = 0):
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
        self._seqs: dict[SeqId, SequenceState] = {}
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._n_admitted = 0
        self._step = 0
        self._in_flight: StepPlan | None = None
        self.faults: list[tuple[SeqId, Exception]] = []  # the last `update`'s rows whose detokenizer raised
        self.prefix_cache = PrefixCache(memory.page_size, prefix_cache_planes) if prefix_cache_planes > 0 else None
        self.prefix_hits = self.prefix_tokens = self.prefix_evictions = 0  # requests, tokens taken; evictions
        # State copies the next plan's device call makes before its rows run: (source, target) planes and pages.
        self._plane_copies: list[tuple[int, int]] = []
        self._page_copies: list[tuple[int, int]] = []

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

    def generated(self, seq_id: SeqId) -> int:
        """Tokens a live sequence has generated so far."""
        return self._seqs[seq_id].n_generated

    def cached_length(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` a request would take from the prefix cache now (0 without one)."""
        if self.prefix_cache is None:
            return 0
        entry = self.prefix_cache.match(prompt, chain_hashes(prompt, self.memory.page_size), touch=False)
        return len(entry.tokens) if entry is not None else 0

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
        seq = SequenceState(request=request, detokenizer=self._detokenizer(), tokens=list(request.prompt))
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
        acceptance of `grants.PRIOR_ACCEPTANCE`. rollback_costs: what each rollback mode costs now, for
        rollback="auto" (kept for the steps that follow without).
        """
        if rollback_costs is not None:
            self.rollback_costs = rollback_costs
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step} is still in flight")
        self._step += 1
        budget = self.token_budget
        specs: list[RowSpec] = []

        order = sorted(self._running, key=lambda s: (s.last_served, s.to_compute > 1, s.admitted))
        for seq in order:
            if not seq.running or budget == 0:
                continue
            if seq.save_points and seq.save_points[0] == seq.n_computed:
                self._save(seq)
            n_feed = min(seq.to_compute, self.chunk_size, budget, *self._until_save(seq))
            need = pages_for(seq.n_computed + n_feed, self.memory.page_size) - len(seq.pages)
            self._evict_until(pages=need)
            while need > self.memory.free_pages and seq.running:
                victim = max(self._running, key=lambda s: s.admitted)
                for spec in [s for s in specs if s.seq is victim]:
                    specs.remove(spec)
                    budget += spec.n_feed
                self._preempt(victim)
            if not seq.running:
                continue
            seq.pages += self.memory.take_pages(max(0, need))
            specs.append(RowSpec(seq, n_feed))
            budget -= n_feed

        reserve = PLANES_PER_SEQUENCE * min(len(self._waiting), self.max_running - len(self._running))
        budget = grant_drafts(specs, budget, drafts or {}, memory=self.memory, costs=self.rollback_costs,
                              max_model_len=self.max_model_len, reserve_planes=reserve)
        if self.lookahead and (not self._waiting or len(self._running) >= self.max_running):
            self._hold_lookahead(specs)

        while self._waiting and len(self._running) < self.max_running and budget > 0:
            seq = self._waiting[0]
            cached = self._match(seq)
            start = len(cached.tokens) if cached else 0
            shared = cached.pages_to_share(self.memory.page_size) if cached else ()
            n_feed = min(len(seq.tokens) - start, self.chunk_size, budget)
            need = pages_for(start + n_feed, self.memory.page_size) - len(shared)
            self._evict_until(pages=need + len(self._running), planes=PLANES_PER_SEQUENCE, keep=cached)
            if self.memory.free_planes < PLANES_PER_SEQUENCE or self.memory.free_pages < need + len(self._running):
                break
            self._waiting.popleft()
            seq.planes += self.memory.take_planes(PLANES_PER_SEQUENCE)
            seq.pages += self.memory.share_pages(shared) + self.memory.take_pages(need)
            if cached is not None:
                self._start_from(seq, cached)
            self._plan_saves(seq)
            n_feed = min((n_feed, *self._until_save(seq)))
            seq.admitted = self._n_admitted
            self._n_admitted += 1
            self._running.append(seq)
            specs.append(RowSpec(seq, n_feed))
            budget -= n_feed

        for spec in specs:
            spec.seq.last_served = self._step
        plan = StepPlan(self._step, tuple(spec.planned_row() for spec in specs), tuple(self._plane_copies),
                        tuple(self._page_copies))
        self._plane_copies.clear()
        self._page_copies.clear()
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
                burst = Burst()
                try:
                    if not seq.append(result, burst, self.max_model_len) and later:
                        if not seq.follow(row, later, burst, self.max_model_len):
                            self._trim_planes(seq)
                except Exception as exc:  # the detokenizer's: the sequence ends, its batch-mates go on
                    self.faults.append((row.seq_id, exc))
                    message = f"internal error in the detokenizer ({type(exc).__name__})"
                    events.append(self._finish(seq, "error", message))
                    continue
                events += self._emit(seq, burst)
        self._in_flight = None
        return events

    def _hold_lookahead(self, specs: list[RowSpec]) -> None:
        """Pages ahead for the rows (`grants.hold_lookahead`). Requests waiting (for a row: this runs then only with
        every row taken) keep what admitting them would need: their first chunks' pages, and a free page per running
        sequence."""
        reserve = sum(pages_for(min(seq.to_compute, self.chunk_size), self.memory.page_size)
                      for seq in islice(self._waiting, self.max_running))
        reserve += len(self._running) if self._waiting else 0
        hold_lookahead(specs, memory=self.memory, lookahead=self.lookahead, max_model_len=self.max_model_len,
                       reserve_pages=reserve, n_running=len(self._running))

    def fail(self, plan: StepPlan, error: str = "the step failed") -> list[Event]:
        """The step could not run: every sequence in it ends with done(error) (cancelled if it was aborted).

        Also valid after `update` raised part way: sequences it already finished are gone and give no event."""
        self._check_in_flight(plan)
        self._in_flight = None
        self.clear_prefix_cache()  # the step may have left the state it copied into the cache unwritten
        events: list[Event] = []
        for row in plan.rows:
            seq = self._seqs.get(row.seq_id)
            if seq is not None:
                events.append(self._finish(seq, "cancelled" if seq.abort_requested else "error", error))
        return events

    def fail_all(self, error: str) -> list[Event]:
        """Every live sequence ends with done(error): for a failure no step in flight accounts for."""
        self._in_flight = None
        self.clear_prefix_cache()
        return [self._finish(seq, "error", error) for seq in list(self._seqs.values())]

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix, giving back what it holds."""
        while self.prefix_cache:
            self._drop(self.prefix_cache.least_recent())

    # ---- internals -----------------------------------------------------------------------------------------

    def _check_in_flight(self, plan: StepPlan) -> None:
        if self._in_flight is None or plan.step != self._in_flight.step:
            raise RuntimeError(f"step {plan.step} is not the step in flight")
        if [r.seq_id for r in plan.rows] != [r.seq_id for r in self._in_flight.rows]:
            raise RuntimeError(f"step {plan.step}: rows differ from the scheduled plan")


    def _roll(self, seq: SequenceState, row: PlannedRow, n_accepted: int, trim: bool = True) -> None:
        """Move the live plane and n_computed after verification (`Sequence.advance`), then return spare planes."""
        seq.advance(row.mode, row.start, len(row.fed), row.write_pool, len(row.drafts), n_accepted, row.drafter)
        if trim:
            self._trim_planes(seq)


    def _emit(self, seq: SequenceState, burst: Burst) -> list[Event]:
        """A burst's events: its tokens (if any), then done if the sequence finished."""
        events: list[Event] = []
        text = "".join(burst.text)
        if burst.ids or text:
            events.append(TokensEvent(seq.request.seq_id, tuple(burst.ids), text, burst.n_from_drafts))
        if burst.reason is not None:
            events.append(self._finish(seq, burst.reason))
        return events

    def _trim_planes(self, seq: SequenceState) -> None:
        """Keep the live plane and one spare (two spares before anything is computed); return the rest."""
        keep = [seq.live_plane] if seq.live_plane else []
        others = [p for p in seq.planes if p != seq.live_plane]
        n_spare = PLANES_PER_SEQUENCE - len(keep)
        self.memory.give_planes(others[n_spare:])
        seq.planes = keep + others[:n_spare]

    def _release(self, seq: SequenceState) -> None:
        self.memory.give_pages(seq.pages)
        self.memory.give_planes(seq.planes)
        seq.pages, seq.planes = [], []
        seq.n_computed, seq.live_plane = 0, 0

    # ---- the prefix cache (`scheduler.prefix_cache`) -----------------------------------------------------------

    def _match(self, seq: SequenceState) -> CachedPrefix | None:
        """The longest cached prefix a waiting sequence's tokens extend."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.match(seq.tokens, seq.hashes(self.memory.page_size))

    def _start_from(self, seq: SequenceState, cached: CachedPrefix) -> None:
        """A just-admitted sequence (its planes taken, the shared pages first among its pages) starts after `cached`:
        its first plane and the page after the shared ones become copies of the entry's."""
        n_shared = len(cached.pages_to_share(self.memory.page_size))
        # A prefix cached in this very plan (its copy not made yet) is copied from where its own copy reads.
        source = next((src for src, dst in self._plane_copies if dst == cached.plane), cached.plane)
        self._plane_copies.append((source, seq.planes[0]))
        self._page_copies.append((cached.pages[n_shared], seq.pages[n_shared]))
        seq.n_computed, seq.live_plane = len(cached.tokens), seq.planes[0]
        seq.cached_tokens = len(cached.tokens)
        self.prefix_hits += 1
        self.prefix_tokens += len(cached.tokens)

    def _plan_saves(self, seq: SequenceState) -> None:
        """Where a just-admitted sequence keeps its state for later requests, past what it starts with: the end of
        the longest run of blocks its prompt shares with an earlier one (where a shared system prompt ends), and the
        last end of a whole prompt chunk before the prompt's last token (where its rows end anyway, so that keeping
        it costs no step: a prompt that fits one chunk keeps none); then its prompt's blocks are noted for later
        prompts."""
        seq.save_points = []
        if self.prefix_cache is None:
            return
        page_size, prompt = self.memory.page_size, len(seq.request.prompt)
        hashes = seq.hashes(page_size)[: (prompt - 1) // page_size]
        shared = self.prefix_cache.shared_blocks(hashes) * page_size
        base = shared if seq.n_computed < shared < prompt else seq.n_computed
        points = {shared, base + (prompt - 1 - base) // self.chunk_size * self.chunk_size}
        seq.save_points = sorted(p for p in points if seq.n_computed < p < prompt)
        self.prefix_cache.note(hashes)

    def _until_save(self, seq: SequenceState) -> tuple[int, ...]:
        """Tokens the sequence may feed before its next save point (none when it has no save point ahead)."""
        return (seq.save_points[0] - seq.n_computed,) if seq.save_points else ()

    def _save(self, seq: SequenceState) -> None:
        """Keep a running sequence's state at its next save point, which it has just computed up to (a copy of its
        live plane, made before this step's rows run; a share of its pages). Skipped when cached already, or when
        no plane is free."""
        point = seq.save_points.pop(0)
        tokens = tuple(seq.tokens[:point])
        cache = self.prefix_cache
        if tokens in cache:
            return
        if cache.full:
            self._evict(cache.least_recent())
        if not self.memory.free_planes:
            return
        plane = self.memory.take_planes(1)[0]
        self._plane_copies.append((seq.live_plane, plane))
        pages = self.memory.share_pages(seq.pages[: pages_for(point, self.memory.page_size)])
        cache.put(CachedPrefix(tokens, plane, tuple(pages)), seq.hashes(self.memory.page_size))

    def _cache_finished(self, seq: SequenceState) -> None:
        """Keep a finished sequence's computed state: its live plane and its pages of computed positions move to the
        cache; `_release` returns the rest."""
        tokens = tuple(seq.tokens[: seq.n_computed])
        cache = self.prefix_cache
        if tokens in cache:
            return
        if cache.full:
            self._evict(cache.least_recent())
        n_pages = pages_for(seq.n_computed, self.memory.page_size)
        cache.put(CachedPrefix(tokens, seq.live_plane, tuple(seq.pages[:n_pages])), seq.hashes(self.memory.page_size))
        seq.pages = seq.pages[n_pages:]
        seq.planes = [p for p in seq.planes if p != seq.live_plane]

    def _evict_until(self, *, pages: int = 0, planes: int = 0, keep: CachedPrefix | None = None) -> None:
        """Evict cached prefixes, least recently used first (never `keep`), until `pages` pages and `planes` planes
        are free or nothing else is cached."""
        while self.prefix_cache and (self.memory.free_pages < pages or self.memory.free_planes < planes):
            entry = self.prefix_cache.least_recent(keep)
            if entry is None:
                return
            self._evict(entry)

    def _evict(self, entry: CachedPrefix) -> None:
        self._drop(entry)
        self.prefix_evictions += 1

    def _drop(self, entry: CachedPrefix) -> None:
        self.prefix_cache.remove(entry)
        self._plane_copies = [(src, dst) for src, dst in self._plane_copies if dst != entry.plane]
        self.memory.give_pages(entry.pages)
        self.memory.give_planes([entry.plane])

    # ---- ending --------------------------------------------------------------------------------------------

    def _preempt(self, seq: SequenceState) -> None:
        self._release(seq)
        seq.cached_tokens = 0
        self._running.remove(seq)
        seq.admitted = -1
        seq.preemptions += 1
        self._waiting.appendleft(seq)

    def _finish(self, seq: SequenceState, reason: FinishReason, error: str | None = None) -> DoneEvent:
        if self.prefix_cache is not None and reason in ("stop", "length") and seq.live_plane in seq.planes:
            self._cache_finished(seq)
        self._release(seq)
        if seq.running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        del self._seqs[seq.request.seq_id]
        return seq.done(reason, error)
