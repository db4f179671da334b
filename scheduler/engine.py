"""The engine: the only async part. One task group owns the step loop; requests come in and events go out through
anyio memory object streams; each step (drafting, the target step, verification, commits) runs in a worker thread
so the event loop stays responsive.

    async with Engine(model, budget_bytes=64 << 20) as engine:
        async for event in engine.generate(GenerationRequest(prompt_ids=(1, 2, 3), max_tokens=32)):
            ...
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import astuple, dataclass, replace

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from drafters import standard_drafters
from drafters.base import Draft, DraftRequest, Drafter
from drafters.policy import (Choice, DrafterPolicy, PolicyParams, SpeculativeConfig, drafting_pays,
                             expected_accepted)
from jaxmodel.model import Model
from jaxmodel.runtime import RowLoop, RowResult, Runtime, Shapes, StepRow
from jaxmodel.state import (KV_DTYPES, NULL_PLANE, backlog_bytes_per_token, bytes_per_plane, kv_bytes_per_page,
                            replay_bytes_per_token)

from .core import Scheduler
from .memory import MemoryManager, RollbackCosts, pages_for, pool_sizes, replay_plane_wrong
from .step_times import StepTimes
from .types import (Committed, Continued, DoneEvent, DraftPlan, Event, GenerationRequest, Request, Row, SeqId,
                    StepPlan, TokensEvent)

log = logging.getLogger("gdnspec.engine")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def freeze_heap() -> None:
    """Collect once, then move every object alive now out of the garbage collector's reach (`gc.freeze`): a warm-up
    leaves about a million of them (the bundled model's 30 traced and compiled step shapes), and each full
    collection walked them all. Under the 16-stream load one took 0.75 s, in one round of 24 to 28 of those that
    drafted n-grams (whose host-side bookkeeping allocates enough to trigger one), which then ran at 2200-2600
    tokens/s instead of about 11000; frozen, a full collection takes about 1 ms. Objects made later are collected
    as before."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Load:
    """What an engine holds at a moment: sequences running and waiting, and its pools' free and usable pages and
    planes (a `stats` request's counts; `Replicas.load` sums its engines')."""

    running: int
    waiting: int
    pages_free: int
    pages_total: int
    planes_free: int
    planes_total: int

    def __add__(self, other: Load) -> Load:
        return Load(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass
class RequestTiming:
    """perf_counter() instants of one request, filled in by the engine as they happen (`arrived` by whoever queued
    the request first, if it set it)."""

    arrived: float = 0.0
    scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None
    finished: float | None = None


class _NullDetokenizer:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


# The most iterations one device call runs while nothing needs the host. Each call costs a fixed ~1.5-2 ms at one
# stream on CPU beyond its iterations (the first iteration, the worker-thread hand-off, the scheduler's update,
# streaming the burst): on the bundled model, `gdnspec bench iterations` (paired rounds in one process) measured 32
# against 8 at 1.50x (plain) and 1.75x (MTP) at one stream and 1.10x (plain) at 16 streams
# (bench/results/iterations-cpu.json; docs/performance.md, "Iterations per device call"), and 64 against 32 at 1.14x
# (plain and n-gram) at one stream and 1.07x at 16 streams (bench/results/iterations-cpu-64.json). A request arriving
# meanwhile waits for the call in flight (at most `DEFAULT_MAX_CALL_SECONDS`).
DEFAULT_ITERATIONS = 64
# ... and no more of them than fit in this long a call, by the last decoding call's time per iteration at that many
# rows: a 16-row iteration of the bundled model takes about 3 ms on CPU, a one-row one of the 0.8B shape 60 ms.
DEFAULT_MAX_CALL_SECONDS = 0.1
DEFAULT_DRAFT_VOCAB = None
# The most drafts an n-gram lookup feeds per iteration inside a device call (`Drafter.device_lookup`); its later
# iterations are compiled at 1 + this many tokens (and at one, for iterations in which no row finds a match).
LOOKUP_DRAFTS = 3
# The batch gate's probes (`Engine._gate_closed`): a step drafts after this many declined steps, then twice as many,
# up to the most.
GATE_PROBE_MIN, GATE_PROBE_MAX = 16, 128
# Tokens the MTP head's backlog holds per running sequence (`jaxmodel.state.HeadBacklog`): a sequence whose head is
# declined runs no head pass until the head drafts again, the sequence ends, or this many tokens are held. Fewer
# where the backlog would take more than an eighth of the budget (in multiples of 16; none below 16).
HEAD_BACKLOG_TOKENS = 256


def tokens_per_iteration(first: int, results: Sequence[RowResult], n_iterations: int) -> float:
    """The tokens a device call of `n_iterations` iterations verified per iteration: `first` in its first
    iteration (the plan's rows, drafts included), and in each later one 1 + the drafts of every row that ran it
    (`RowResult.more`). A call whose later iterations draft on device costs more per iteration than its first
    iteration's tokens say; priced by those alone, drafting looked cheaper the more it was done.

    Example: two rows, the first iteration plain (2 tokens); in the second, one row verifies 3 drafts and the
    other none; in the third only the first row runs, without drafts: (2 + (4 + 1) + 1) / 3 = 8/3."""
    later = sum(1 + len(it.drafts) for result in results for it in result.more)
    return (first + later) / n_iterations


class Engine:
    """Continuous batching over one target model, its drafters and a memory budget."""

    def __init__(
        self,
        model: Model,
        *,
        tokenizer=None,
        draft_model: Model | None = None,
        extra_drafters: Sequence[Drafter] = (),
        budget_bytes: int = 256 << 20,
        max_running: int = 16,
        max_model_len: int = 2048,
        token_budget: int = 512,
        chunk_size: int = 128,
        page_size: int = 16,
        n_max: int = 16,
        policy_params: PolicyParams | None = None,
        adaptive: bool = True,
        iterations: int = DEFAULT_ITERATIONS,
        max_call_seconds: float | None = DEFAULT_MAX_CALL_SECONDS,
        stop_token_ids: Sequence[int] | None = None,
        draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
        background_warmup: bool = False,
        kv_dtype: str = "float32",
        row_buckets: tuple[int, ...] = (),
    ):
        """budget_bytes: KV pages + GDN planes of the target. adaptive False: every step drafts with the request's
        drafters in order at n_max (the first non-empty draft wins), as fixed-drafter engines do; True: the
        policy in `drafters.policy` chooses drafter and length per sequence. iterations: the most speculative
        iterations (or plain decoding steps) one device call runs while the host has nothing to decide between
        them (no request waiting or arriving, no stop string to check, drafts only from the MTP head); the steps
        are compiled for it, and the attribute `iterations` may be lowered later (`bench.iterations` does).
        max_call_seconds: fewer iterations where the last decoding call at this many rows says that many would take
        longer (None: no bound), since a request arriving meanwhile waits for the call and streams get its tokens
        as one burst. stop_token_ids: end-of-generation ids (default: the tokenizer's). draft_vocab: the MTP head
        drafts among the token ids below it (None: the whole vocabulary; see `jaxmodel.speculative.iteration`).
        background_warmup: while running and idle, compile the shapes `warmup` would, one at a time, then calibrate
        (a server then listens at once; requests arriving meanwhile compile what they need first). kv_dtype: the
        target's KV pages (the MTP head's included), "float32" or "float16" (half the bytes a page, so twice the
        positions in the same budget, and half the bytes attention reads at a long context; docs/performance.md, "A
        float16 KV cache"). row_buckets: the batch sizes the steps compile (`Shapes.row_buckets`; default: powers of
        4)."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
        cfg = model.cfg
        plane_bytes = bytes_per_plane(cfg)
        # Planes for every sequence to snapshot a full draft, but never more than half the budget.
        planes_per_seq = min(2 + n_max, max(2, budget_bytes // 2 // max(plane_bytes, 1) // max_running))
        replay_tokens = n_max if cfg.gdn_layers else 0  # the replay pool: a full draft for every row of a step
        backlog_tokens = 0
        if model.has_mtp and n_max > 0:
            fitting = budget_bytes // 8 // (max_running * backlog_bytes_per_token(cfg))
            backlog_tokens = min(HEAD_BACKLOG_TOKENS, fitting // 16 * 16)
        sizes = pool_sizes(
            budget_bytes,
            page_bytes=kv_bytes_per_page(cfg, page_size, kv_dtype),
            plane_bytes=plane_bytes,
            page_size=page_size,
            max_running=max_running,
            planes_per_seq=planes_per_seq,
            replay_tokens=replay_tokens,
            replay_token_bytes=replay_bytes_per_token(cfg),
            backlog_bytes=max_running * backlog_tokens * backlog_bytes_per_token(cfg),
        )
        self.model = model
        self._draft_model = draft_model
        self.tokenizer = tokenizer
        drafters = standard_drafters(model, draft_model, max_seqs=max_running, max_context=max_model_len,
                                     n_max=n_max, page_size=page_size)  # fmt: skip
        self.drafters: dict[str, Drafter] = {d.name: d for d in [*drafters, *extra_drafters]}
        lookups = iterations > 1 and any(d.device_lookup() is not None for d in self.drafters.values())
        shapes = Shapes(
            max_rows=max_running,
            max_tokens=chunk_size + n_max,  # a row feeds at most a chunk, then its drafts
            max_logit_rows=1 + n_max,
            pages_per_row=pages_for(max_model_len + n_max + 1, page_size),
            row_buckets=row_buckets,
        )
        if stop_token_ids is None:
            stop_token_ids = tokenizer.eog_ids if tokenizer is not None else ()
        self.stop_token_ids = frozenset(stop_token_ids)
        self.runtime = Runtime(model, n_pages=sizes.n_pages, n_planes=sizes.n_planes, page_size=page_size,
                               shapes=shapes, n_chain_max=n_max if model.has_mtp else 0, max_iterations=iterations,
                               stop_ids=self.stop_token_ids, draft_vocab=draft_vocab,
                               replay_tokens=sizes.replay_tokens,
                               lookup_drafts=LOOKUP_DRAFTS if lookups else 0, kv_dtype=kv_dtype,
                               backlog_slots=max_running, backlog_tokens=backlog_tokens)  # fmt: skip
        self._backlog_slots: dict[SeqId, int] = {}  # sequence -> its slot in the MTP head's backlog
        self._free_backlog_slots = list(range(len(self.runtime.backlog_held)))
        self.memory = MemoryManager(sizes)
        detokenizer = tokenizer.detokenizer if tokenizer is not None else _NullDetokenizer
        self.scheduler = Scheduler(
            self.memory, detokenizer, max_model_len=max_model_len, token_budget=token_budget,
            max_running=max_running, chunk_size=chunk_size,
        )  # fmt: skip
        if iterations > 1:
            self.scheduler.lookahead = iterations * (1 + n_max) + n_max
        self.policy = DrafterPolicy(policy_params or PolicyParams())
        host_drafters = frozenset(name for name, d in self.drafters.items()
                                  if d.device_chain(None, 0) < 0 and not (lookups and d.device_lookup()))
        self.policy.params = replace(self.policy.params, loops=iterations > 1, host_drafters=host_drafters)
        self.n_max = n_max
        self.background_warmup = background_warmup
        self.adaptive = adaptive
        self.iterations = iterations
        self.max_call_seconds = max_call_seconds
        self._iteration_seconds: dict[int, float] = {}  # rows -> seconds per iteration of the last decoding call
        self.step_times = StepTimes()  # the batch gate's prices (`_batch_declines`)
        self._lookup_drafter = next((d.name for d in self.drafters.values() if d.device_lookup() is not None), None)
        self._batch_declined = False  # this step's drafts did not pay for its batch: no row drafts or chains
        self._faults: dict[SeqId, str] = {}  # this step's rows whose part of it failed -> the error they end with
        self._gate_wait, self._gate_interval = 0, GATE_PROBE_MIN  # declined steps until the batch's next probe
        self._ids = itertools.count()
        self._outputs: dict[int, MemoryObjectSendStream] = {}
        self._timings: dict[int, RequestTiming] = {}
        self._inbox_send, self._inbox = anyio.create_memory_object_stream(math.inf)
        self.steps = 0

    # ------------------------------------------------------------------------------------------------ the step

    def step(self, quiet: bool = True) -> list[Event]:
        """One scheduler step, synchronously: schedule, draft, run (forward, verification and the next on-device
        drafts in one device call, several iterations of it when the host has nothing to decide between them),
        commit. quiet: no request is arriving (so nothing waits for the host). Returns the events."""
        self._faults = {}
        choices = self._plan_drafts()
        self.scheduler.rollback_costs = self._rollback_costs()
        plan = self.scheduler.schedule({
            seq_id: DraftPlan(max(c.n_draft for c in options), self.policy.acceptance(seq_id, options[0].drafter))
            if options else DraftPlan(0, 0.0)
            for seq_id, options in choices.items()
        })  # fmt: skip
        if not plan.rows:
            return []
        start = time.perf_counter()
        for row in plan.rows:
            timing = self._timings.get(row.seq_id)
            if timing is not None and timing.scheduled is None:
                timing.scheduled = start
        plan = self._attach_drafts(plan, choices)
        iterations = self._call_iterations(plan, quiet)
        rows = [self._isolated_step_row(row, len(plan.rows), iterations > 1, choices.get(row.seq_id, ()))
                for row in plan.rows]
        start = time.perf_counter()
        results = self._run(rows, iterations)
        if all(isinstance(result, RowResult) for result in results):
            self._record_costs(plan, rows, results, time.perf_counter() - start)
        committed, continued = {}, {}
        for row, result in zip(plan.rows, results):
            if not isinstance(result, RowResult):
                self._fault(row.seq_id, "the model step", result)
            elif row.needs_logits and row.seq_id not in self._faults:
                try:
                    committed[row.seq_id], continued[row.seq_id] = self._commit(row, result, choices)
                except Exception as exc:  # a drafter's hook: its sequence ends, the batch-mates go on
                    self._fault(row.seq_id, self._culprit(exc), exc)
        events = self.scheduler.update(plan, committed, continued, self._faults)
        for seq_id, exc in self.scheduler.faults:
            log.error("sequence %s failed in the detokenizer", seq_id, exc_info=(type(exc), exc, exc.__traceback__))
        for event in events:
            if isinstance(event, DoneEvent):
                self._release(event.seq_id)
        self.steps += 1
        return events

    def _commit(self, row: Row, result: RowResult, choices: dict[SeqId, list[Choice]]):
        """A verified row's committed tokens and later iterations, for the scheduler; tells its drafters."""
        committed = Committed(tuple(result.committed), result.n_accepted)
        self._observe(row.seq_id, row.drafter, len(row.drafts), result.n_accepted, result.committed)
        n_tokens = row.start + len(row.fed) + len(result.committed)
        continued = []
        if result.more:
            name = self._loop_drafter(row, choices.get(row.seq_id, ()))[0]
            continued = [Continued(tuple(it.drafts), Committed(it.committed, it.n_accepted),
                                   name if it.drafts else None) for it in result.more]  # fmt: skip
            for it in result.more:
                if it.drafts:
                    self._observe(row.seq_id, name, len(it.drafts), it.n_accepted, it.committed)
                n_tokens += len(it.committed)
        for drafter in self._drafters_of(row):
            drafter.after_step(row.seq_id, n_tokens, result)
        return committed, continued

    def _run(self, rows: list[StepRow], iterations: int) -> list[RowResult | Exception]:
        """The runtime's step over `rows`. Where it raises before its device call changed the state, the rows run
        again in halves, down to each row that raises alone, which gets its exception instead of a result (rows
        are independent, so the others' results are what they would have been). Raises where the state changed
        or was lost (the step then fails as a whole)."""
        before = self.runtime.state
        try:
            return self.runtime.step(rows, iterations)
        except Exception as exc:
            if self.runtime.state is not before or not self.runtime.state_intact():
                raise
            if len(rows) == 1:
                return [exc]
        half = len(rows) // 2
        return self._run(rows[:half], iterations) + self._run(rows[half:], iterations)

    def _fault(self, seq_id: SeqId, culprit: str, exc: Exception) -> None:
        """A sequence's part of this step failed: it ends with done(error) naming the culprit; its batch-mates
        go on."""
        if seq_id not in self._faults:
            log.error("sequence %s failed in %s", seq_id, culprit, exc_info=(type(exc), exc, exc.__traceback__))
            self._faults[seq_id] = f"internal error in {culprit} ({type(exc).__name__})"

    def _call_iterations(self, plan: StepPlan, quiet: bool) -> int:
        """Iterations for this step's call. All it may (`_iterations`) while no request waits or arrives; with every
        row taken, until the first row that can end by length does (nothing waiting or arriving can start before a
        row frees, and a row that ends sooner, at a stop token, holds the next one back for at most a call); one
        otherwise, so that a request waiting for memory or for the step's token budget is taken at the next step."""
        most = self._iterations(len(plan.rows))
        if quiet and not self.scheduler.n_waiting:
            return most
        if self.scheduler.n_running >= self.scheduler.max_running:
            return max(1, min(most, *(self.scheduler.remaining(row.seq_id) for row in plan.rows)))
        return 1

    def _iterations(self, n_rows: int) -> int:
        """The most iterations a call of n_rows rows may run: `iterations`, fewer where `max_call_seconds` says."""
        per_iteration = self._iteration_seconds.get(n_rows)
        if self.max_call_seconds is None or not per_iteration:
            return self.iterations
        return max(1, min(self.iterations, int(self.max_call_seconds / per_iteration)))

    def _rollback_costs(self) -> RollbackCosts:
        """What each rollback mode costs now, for the memory rule's choice: the rebuild's, the verify steps' and
        snapshot's per state written, as calibrated at this many rows, and the policy's measured per-token cost of a
        target step (what replayed tokens cost until calibrated; the rebuild then costs as much as one of them)."""
        n_rows = max(self.scheduler.n_running, 1)
        per_token = self.policy.token_seconds(n_rows)
        rebuild_seconds, rebuild_rows = self.runtime.rebuild_cost(n_rows) or (per_token, 0)
        return RollbackCosts(token_seconds=per_token, rebuild_seconds=rebuild_seconds, rebuild_rows=rebuild_rows,
                             step_seconds=self.runtime.step_costs(n_rows),
                             plane_write_seconds=self.runtime.plane_write_cost(n_rows))

    def _record_costs(self, plan: StepPlan, rows: list[StepRow], results, seconds: float) -> None:
        """Report a device call's time to the policy: the target's share per iteration, and the MTP head's chain
        (measured once by `Runtime.calibrate`, since one call's time cannot be split) as the proposal cost of
        the drafter that chains on device, shared by the rows that chained. A step with replay rows ran the replay
        rebuild in its iterations (its calibrated cost is not the target's). Steps with prompt chunks are not
        reported: their cost follows the chunk, not the drafts. The time per iteration is priced by the tokens an
        iteration verified on average, later iterations' device drafts included (`tokens_per_iteration`). Also
        keeps the call's time per iteration for `max_call_seconds` (`_iterations`) and, by its rows and tokens per
        row, for the batch gate (`step_times`). A call that traced is not reported: its time is mostly
        compilation."""
        if self.runtime.last_step_traced or not all(row.needs_logits and len(row.fed) == 1 for row in plan.rows):
            return
        n_iterations = 1 + max(len(r.more) for r in results)
        self._iteration_seconds[len(rows)] = seconds / n_iterations  # the last call's, so a slow one passes
        if self.runtime.shapes is not None:
            tokens = self.runtime.shapes.tokens(max(len(row.tokens) for row in plan.rows))
            B = self.runtime.shapes.batch(len(rows))
            self.step_times.record(B, tokens, seconds / n_iterations, looped=n_iterations > 1)
            committed = sum(len(r.committed) + sum(len(it.committed) for it in r.more) for r in results)
            self.step_times.record_rate(B, self._call_drafter(plan, rows), committed, seconds)
        chaining = [(row, step_row.n_chain) for row, step_row in zip(plan.rows, rows) if step_row.n_chain > 0]
        per_draft = self.runtime.chain_cost(len(rows))
        chain_seconds = per_draft * max((n for _, n in chaining), default=0)  # the chain runs its longest row's links
        rebuild_seconds = self._rebuild_seconds(rows, results)
        self.policy.record_target(max((seconds - rebuild_seconds) / n_iterations - chain_seconds, 0.0),
                                  tokens_per_iteration(plan.n_tokens, results, n_iterations), n_iterations,
                                  len(plan.rows))  # fmt: skip
        n_chained = sum(n for _, n in chaining)
        for row, n_chain in chaining:
            name = self._device_drafter(row)
            if name is not None:
                self.policy.record_proposal(name, chain_seconds * n_chain / n_chained, n_chain)

    def _call_drafter(self, plan: StepPlan, rows: list[StepRow]) -> str | None:
        """The drafter most of a call's rows drafted with or were given to draft with: a row's own drafts' drafter,
        else the n-gram lookup where its iterations looked up (whether or not it found a draft), else the MTP head
        where it chained; None where no row did any of it (the rate plain decoding is measured by: a call whose
        lookup found nothing still paid for the lookup)."""
        names: Counter[str] = Counter()
        for row, step_row in zip(plan.rows, rows):
            if row.drafts:
                name = row.drafter
            elif step_row.loop is not None and step_row.loop.lookup is not None:
                name = self._lookup_drafter
            else:
                name = self._device_drafter(row) if step_row.n_chain > 0 else None
            if name is not None:
                names[name] += 1
        return names.most_common(1)[0][0] if names else None

    def _rebuild_seconds(self, rows: list[StepRow], results) -> float:
        """What a device call spent rebuilding replay rows: per iteration, a calibrated pass per rebuild_rows of
        its wrong planes (`replay_plane_wrong`)."""
        cost = self.runtime.rebuild_cost(len(rows))
        if cost is None:
            return 0.0
        seconds, per_pass = cost
        wrong: Counter[int] = Counter()  # iteration -> wrong planes
        for r, result in zip(rows, results):
            if r.replay:
                wrong[0] += replay_plane_wrong(r.optimistic, len(r.drafts), result.n_accepted)
            if r.loop is not None and r.loop.replay:
                for j, later in enumerate(result.more, start=1):
                    if later.drafts:
                        wrong[j] += replay_plane_wrong(r.loop.optimistic, len(later.drafts), later.n_accepted)
        return seconds * sum(-(-n // per_pass) for n in wrong.values())

    def _observe(self, seq_id, drafter: str | None, drafted: int, accepted: int, committed) -> None:
        if drafter is not None:
            self.drafters[drafter].observe(seq_id, accepted, committed)
            self.policy.observe(seq_id, drafter, drafted, accepted)

    def _speculative(self, seq_id: SeqId) -> SpeculativeConfig | None:
        return self.scheduler.request(seq_id).speculative

    def _drafters_of(self, row: Row) -> list[Drafter]:
        config = self._speculative(row.seq_id)
        return [self.drafters[name] for name in config.drafters] if config else []

    def _device_drafter(self, row: Row) -> str | None:
        """The first of the row's drafters that drafts on device (the MTP head), if any."""
        return next((d.name for d in self._drafters_of(row) if d.device_chain(row.seq_id, 0) >= 0), None)

    def _loop_drafter(self, row: Row, choices: Sequence[Choice]) -> tuple[str | None, tuple[int, int] | None]:
        """Who drafts in the row's later iterations of a call: the policy's main choice where its lookup runs on
        device (with its n-gram sizes), else the first of the row's drafters that chains on device (the MTP head),
        if any."""
        if choices and self.runtime.lookup_drafts:
            lookup = self.drafters[choices[0].drafter].device_lookup()
            if lookup is not None:
                return choices[0].drafter, lookup
        return self._device_drafter(row), None

    def _step_row(self, row: Row, batch_size: int, may_loop: bool, choices: Sequence[Choice] = ()) -> StepRow:
        """The runtime's view of a plan row: its drafts, sampling, the drafts to chain on device for its next step
        (as long as the policy would plan for each drafter that chains on device), and whether it may run more
        iterations in the same call (a decoding row in plain, snapshot or replay mode, without stop strings, whose
        drafts come from the device: the MTP head's, or the n-gram lookup's where the policy chose it; `choices`
        are the policy's for this step)."""
        request = self.scheduler.request(row.seq_id)
        config = request.speculative
        n_chain = -1
        for drafter in self._drafters_of(row):
            n_next = self.policy.length(row.seq_id, drafter.name, config, batch_size) if self.adaptive else config.n_max
            n_chain = max(n_chain, drafter.device_chain(row.seq_id, min(n_next, self.n_max)))
        if self._batch_declined:  # the next step's batch most likely declines too: no chain to prepare for it
            n_chain = min(n_chain, 0)
        p_min = config.p_min if config else 0.0
        loop = None
        name, lookup = self._loop_drafter(row, choices)
        if (may_loop and row.needs_logits and len(row.fed) == 1 and row.read_plane != NULL_PLANE
                and row.mode in ("snapshot", "replay", None)
                and row.drafter in (None, name) and not request.stop_strings):
            if lookup is not None:
                n_draft = min(choices[0].n_draft, row.draft_max, self.runtime.lookup_drafts)
                lookup = lookup if n_draft > 0 else None
            else:
                n_draft = min(max(n_chain, 0), row.draft_max) if name is not None and row.mode is not None else 0
            loop = RowLoop(n_draft, (row.read_plane,) + row.write_pool, self.scheduler.remaining(row.seq_id),
                           replay=row.mode == "replay", optimistic=row.optimistic, lookup=lookup,
                           history=self.scheduler.tokens(row.seq_id) if lookup else ())  # fmt: skip
        return StepRow(row, row.drafts, request.sampling, n_chain, p_min, loop,
                       replay=row.mode == "replay" and bool(row.drafts), optimistic=row.optimistic,
                       backlog_slot=self._backlog_slot(row.seq_id) if n_chain >= 0 else -1)

    def _isolated_step_row(self, row: Row, batch_size: int, may_loop: bool, choices: Sequence[Choice]) -> StepRow:
        """`_step_row`; where that raises (a drafter's `device_chain`, the policy), the row's fault and a row that
        only verifies (its result is dropped)."""
        try:
            return self._step_row(row, batch_size, may_loop, choices)
        except Exception as exc:
            self._fault(row.seq_id, self._culprit(exc), exc)
            return StepRow(row, row.drafts, replay=row.mode == "replay" and bool(row.drafts), optimistic=row.optimistic)

    def _backlog_slot(self, seq_id: SeqId) -> int:
        """The sequence's slot in the MTP head's backlog, taken at its first row that runs the head (-1 where none
        is free: a preempted sequence keeps its slot while it waits, so slots can run out; its head then catches up
        as it goes)."""
        slot = self._backlog_slots.get(seq_id)
        if slot is None and self._free_backlog_slots:
            slot = self._backlog_slots[seq_id] = self._free_backlog_slots.pop()
        return -1 if slot is None else slot

    def _plan_drafts(self) -> dict[SeqId, list[Choice]]:
        """The policy's drafters and lengths, in order, for every sequence that may draft this step, chosen before
        memory is granted (an empty plan borrows no planes)."""
        may_draft = self.scheduler.may_draft()
        planned = {}
        for seq_id in may_draft:
            config = self._speculative(seq_id)
            if config is None:
                continue
            if self.adaptive:
                choices = self.policy.plan(seq_id, config, len(may_draft))
            else:
                choices = [Choice(name, config.n_max) for name in config.drafters]
            planned[seq_id] = [c for c in choices if c.n_draft > 0]
        self._batch_declined = self.adaptive and self._gate_closed(planned, len(may_draft))
        return {} if self._batch_declined else planned

    def _gate_closed(self, planned: dict[SeqId, list[Choice]], n_rows: int) -> bool:
        """Whether the batch gate keeps this step from drafting (`_batch_declines`). A gate that stays closed lets
        one step draft after GATE_PROBE_MIN declined steps, then twice as many, up to GATE_PROBE_MAX (a batch probe:
        acceptance is learnt only from drafts, and every row drafts in it, so that they share its padding); a step
        that pays resets the wait (one that plans no draft says nothing, and leaves it)."""
        if not any(planned.values()):
            return False
        if not self._batch_declines(planned, n_rows):
            self._gate_wait, self._gate_interval = 0, GATE_PROBE_MIN
            return False
        if self._gate_wait > 0:
            self._gate_wait -= 1
            return True
        self._gate_wait, self._gate_interval = self._gate_interval, min(2 * self._gate_interval, GATE_PROBE_MAX)
        return False

    def _batch_declines(self, planned: dict[SeqId, list[Choice]], n_rows: int) -> bool:
        """Whether the drafts the policy chose per sequence would cost the step's batch of n_rows rows more than
        they return. Where the engine has measured both at this batch size: whether its calls drafting with the
        drafter most rows chose committed fewer tokens per second than its calls in which no row drafted (all of
        it measured: the padding, rows without a draft, the chain, the rebuild). Until then an estimate
        (`policy.drafting_pays`): the step at the longest draft's padded length against the plain step
        (`step_times`: measured under load where both are, in calls of one iteration where a drafter drafts on
        the host; else calibrated, then with the MTP chain's calibrated cost added), for every row's expected
        accepted drafts at its acceptance estimate. No price yet: no decline."""
        firsts = [(seq_id, options[0]) for seq_id, options in planned.items() if options]
        if not firsts or self.runtime.shapes is None:
            return False
        B = self.runtime.shapes.batch(n_rows)
        drafter = Counter(choice.drafter for _, choice in firsts).most_common(1)[0][0]
        rates = self.step_times.plain_and_drafting_rates(B, drafter)
        if rates is not None:
            return rates[1] <= rates[0]
        longest = max(choice.n_draft for _, choice in firsts)
        T = self.runtime.shapes.tokens(1 + longest)
        host = any(c.drafter in self.policy.params.host_drafters for _, c in firsts)
        prices = self.step_times.plain_and_drafting(B, T, host)
        if prices is None:
            return False
        plain, drafting, measured = prices
        if not measured and any(self.drafters[c.drafter].device_chain(seq_id, 1) > 0 for seq_id, c in firsts):
            drafting += self.runtime.chain_cost(n_rows) * longest
        gain = sum(expected_accepted(self.policy.acceptance(seq_id, c.drafter), c.n_draft) for seq_id, c in firsts)
        return not drafting_pays(n_rows, gain, plain, drafting)

    def _attach_drafts(self, plan: StepPlan, choices: dict[SeqId, list[Choice]]) -> StepPlan:
        """Per sequence, the policy's drafters in order; each round batches the sequences still without a draft
        by drafter, so every drafter proposes once per round for all the sequences that chose it."""
        options = {}
        for row in plan.rows:
            config = self._speculative(row.seq_id)
            if row.draft_max > 0 and config is not None and choices.get(row.seq_id):
                options[row.seq_id] = (row, config, choices[row.seq_id])
        drafts, names = {}, {}
        for round_ in itertools.count():
            by_drafter: dict[str, list] = {}
            for seq_id, (row, config, choices) in options.items():
                if seq_id not in drafts and round_ < len(choices):
                    by_drafter.setdefault(choices[round_].drafter, []).append((row, config, choices[round_]))
            if not by_drafter:
                break
            for name, entries in by_drafter.items():
                requests = [
                    DraftRequest(row.seq_id, self.scheduler.tokens(row.seq_id), min(choice.n_draft, row.draft_max),
                                 config.p_min)
                    for row, config, choice in entries
                ]  # fmt: skip
                start = time.perf_counter()
                proposals = self._propose(name, requests)
                share = (time.perf_counter() - start) / len(requests)
                # Drafters that draft on device are costed in `_record_costs` (the MTP chain) or inside the target's
                # iterations (the lookup, whose host proposal is one per call, not per iteration).
                on_device = name not in self.policy.params.host_drafters
                for (row, config, _), proposal in zip(entries, proposals):
                    if isinstance(proposal, Exception):
                        self._fault(row.seq_id, f"drafter {name!r}", proposal)
                        options.pop(row.seq_id)
                        continue
                    if not on_device:
                        self.policy.record_proposal(name, share, len(proposal.tokens))
                    if len(proposal.tokens) >= config.n_min:
                        drafts[row.seq_id] = proposal.tokens[: row.draft_max]
                        names[row.seq_id] = name
        return plan.with_drafts(drafts, names)

    def _propose(self, name: str, requests: list[DraftRequest]) -> list[Draft | Exception]:
        """The drafter's proposals for `requests`, one call for all; where that raises or proposes a token outside
        the vocabulary, each request alone, so that a request whose proposal fails gets its exception and the
        others their drafts."""
        try:
            proposals = self.drafters[name].propose(requests)
            if len(proposals) != len(requests):
                raise ValueError(f"{len(proposals)} proposals for {len(requests)} requests")
            n_vocab = self.model.cfg.n_vocab
            for proposal in proposals:
                if not all(0 <= token < n_vocab for token in proposal.tokens):
                    raise ValueError(f"a draft token outside the vocabulary of {n_vocab}: {proposal.tokens[:8]}")
            return proposals
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
        return [self._propose(name, [request])[0] for request in requests]

    def warmup(self, threads: int | None = None) -> int:
        """Compile every step shape this engine can run, the target's `threads` at a time (default: one per core
        this process may use; `Runtime.compile`), then time a few of them for the drafter policy's costs
        (`Runtime.calibrate`); returns how many shapes compiled. `background_warmup` does the same while serving,
        one shape at a time."""
        self.runtime.compile(available_cores() if threads is None else threads)
        n = sum(1 for _ in self._shapes_to_compile())
        self._finish_warmup()
        return n

    def _shapes_to_compile(self) -> Iterator[object]:
        yield from self.runtime.warmup()
        for drafter in self.drafters.values():
            yield from drafter.warmup()

    def _finish_warmup(self) -> None:
        """After the shapes have compiled: time the runtime's steps (only while no step runs), lending it free
        planes to time snapshot's state writes in, then freeze the heap the warm-up leaves (`freeze_heap`)."""
        spare = self.memory.take_planes(min(self.memory.free_planes, 1 + self.n_max))
        try:
            calibration = self.runtime.calibrate(spare_planes=spare)
        finally:
            self.memory.give_planes(spare)
        self.policy.calibrate(calibration.step_seconds)
        self.step_times.calibrate({**calibration.step_seconds, **calibration.longer_step_seconds})
        freeze_heap()

    def _release(self, seq_id) -> None:
        for drafter in self.drafters.values():
            try:
                drafter.release(seq_id)
            except Exception:  # a faulty drafter must not keep the others from releasing
                log.exception("drafter %r failed to release sequence %s", drafter.name, seq_id)
        self.policy.release(seq_id)
        slot = self._backlog_slots.pop(seq_id, None)
        if slot is not None:
            self.runtime.release_backlog(slot)
            self._free_backlog_slots.append(slot)

    # ------------------------------------------------------------------------------------------------ faults

    def guarded_step(self, quiet: bool = True) -> list[Event]:
        """`step`, except that an exception no row accounts for (`step` ends a row's own fault's request alone)
        fails the requests of the step that raised it (done with finish_reason "error", their pages, planes and
        drafter state released) and the engine serves on."""
        try:
            return self.step(quiet)
        except Exception as exc:
            return self.fail_step(exc)

    def fail_step(self, exc: Exception) -> list[Event]:
        """End the requests of the step in flight (every live request when none is) with done(error)."""
        plan = self.scheduler.in_flight
        message = f"internal error in {self._culprit(exc)} ({type(exc).__name__})"
        log.error("step %s failed: %s", plan.step if plan else "?", message,
                  exc_info=(type(exc), exc, exc.__traceback__))  # fmt: skip
        if plan is None:
            events = self.scheduler.fail_all(message)
        else:
            events = self.scheduler.fail(plan, message)
            # Sequences the failed update had already finished lost their done event with it.
            ended = {event.seq_id for event in events}
            events += [DoneEvent(row.seq_id, "error", 0, 0, error=message) for row in plan.rows
                       if row.seq_id not in ended and row.seq_id not in self.scheduler]  # fmt: skip
        for event in events:
            self._release(event.seq_id)
        return events

    def _culprit(self, exc: Exception) -> str:
        """What raised `exc` in a step, in words: a drafter by name, the model step, the detokenizer, or the
        innermost function."""
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        for outer, inner in zip(frames, frames[1:]):
            owner = inner.f_locals.get("self")
            if owner is self.runtime:
                return "the model step"
            if any(owner is drafter for drafter in self.drafters.values()):
                return f"drafter {owner.name!r}"
            seq = outer.f_locals.get("seq")
            if outer.f_code.co_name == "_append" and owner is getattr(seq, "detokenizer", None):
                return "the detokenizer"
        code = frames[-1].f_code if frames else None
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}" if code else "the engine"

    # ------------------------------------------------------------------------------------------------ async edge

    @asynccontextmanager
    async def running(self):
        self.warmed = anyio.Event()  # set once a background warm-up has finished (at once without one)
        if not self.background_warmup:
            self.warmed.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._loop)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def __aenter__(self) -> Engine:
        self._context = self.running()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc) -> None:
        await self._context.__aexit__(*exc)

    async def _loop(self) -> None:
        uncompiled = self._shapes_to_compile() if self.background_warmup else None
        start, n_compiled = time.perf_counter(), 0
        while True:
            if not self.scheduler.has_work and uncompiled is not None:
                # Idle: compile the next shape. A request arriving meanwhile waits for this one shape only; the
                # shapes its own steps need compile on first use.
                finished = True
                try:
                    if await anyio.to_thread.run_sync(next, uncompiled, None, abandon_on_cancel=True) is not None:
                        n_compiled, finished = n_compiled + 1, False
                    else:
                        await anyio.to_thread.run_sync(self._finish_warmup)
                        log.info("warm-up: %d step shapes compiled in the background in %.1f s", n_compiled,
                                 time.perf_counter() - start)
                except Exception:  # the engine serves on; steps compile what they need on first use
                    log.exception("background warm-up stopped after %d step shapes", n_compiled)
                if finished:
                    uncompiled = None
                    self.warmed.set()
            elif not self.scheduler.has_work:
                self._apply(await self._inbox.receive())  # sleep until a request arrives
            while True:
                try:
                    self._apply(self._inbox.receive_nowait())
                except anyio.WouldBlock:
                    break
            if not self.scheduler.has_work:
                continue
            quiet = self._inbox.statistics().current_buffer_used == 0
            events = await anyio.to_thread.run_sync(self.guarded_step, quiet)
            for event in events:
                stream = self._outputs.get(event.seq_id)
                if stream is not None:
                    stream.send_nowait(event)
                    if isinstance(event, DoneEvent):
                        del self._outputs[event.seq_id]
                        stream.close()

    def _apply(self, message) -> None:
        kind, payload = message
        if kind == "add":
            try:
                self.scheduler.add(payload)
            except ValueError as exc:
                stream = self._outputs.pop(payload.seq_id, None)
                if stream is not None:
                    stream.send_nowait(DoneEvent(payload.seq_id, "error", len(payload.prompt), 0, error=str(exc)))
                    stream.close()
        else:
            for event in self.scheduler.abort(payload):
                stream = self._outputs.pop(event.seq_id, None)
                if stream is not None:
                    stream.send_nowait(event)
                    stream.close()
            self._release(payload)

    async def generate(
        self, request: GenerationRequest, timing: RequestTiming | None = None
    ) -> AsyncIterator[TokensEvent | DoneEvent]:
        """Stream a request's events; leaving the loop early (or being cancelled) aborts the request.
        timing, if given, receives the request's instants."""
        timing = timing or RequestTiming()
        timing.arrived = timing.arrived or time.perf_counter()  # a caller that queued the request set it already
        self.check(request)
        seq_id = next(self._ids)
        core_request = Request(seq_id, request.prompt_ids, request.max_tokens, self.stop_token_ids, request.stop,
                               request.sampling, request.speculative)  # fmt: skip
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._outputs[seq_id] = send
        self._timings[seq_id] = timing
        self._inbox_send.send_nowait(("add", core_request))
        finished = False
        try:
            async with receive:
                async for event in receive:
                    if isinstance(event, TokensEvent) and timing.first_token is None:
                        timing.first_token = time.perf_counter()
                    if isinstance(event, DoneEvent):
                        finished = True
                        timing.finished = time.perf_counter()
                    yield event
        finally:
            self._timings.pop(seq_id, None)
            if not finished:
                self._outputs.pop(seq_id, None)
                self._inbox_send.send_nowait(("abort", seq_id))

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def weights_bytes(self) -> int:
        """The target's and the draft model's weights on the device (`Model.weights_bytes`); the budget is beyond."""
        return self.model.weights_bytes + (self._draft_model.weights_bytes if self._draft_model else 0)

    def load(self) -> Load:
        memory, scheduler = self.memory, self.scheduler
        return Load(scheduler.n_running, scheduler.n_waiting, memory.free_pages, memory.usable_pages,
                    memory.free_planes, memory.usable_planes)

    @property
    def n_in_flight(self) -> int:
        """Requests `generate` is streaming (waiting, running, or their last events on the way)."""
        return len(self._outputs)

    def check(self, request: GenerationRequest) -> None:
        """ValueError for what this engine cannot serve: drafters it lacks, drafts longer than its n_max.
        (`api.server.Server` holds its limits to the engine's, so the protocol refuses these first.)"""
        spec = request.speculative
        if spec is None:
            return
        unknown = [name for name in spec.drafters if name not in self.drafters]
        if unknown:
            raise ValueError(f"drafters {unknown} are not among this engine's {list(self.drafters)}")
        if spec.n_max > self.n_max:
            raise ValueError(f"n_max {spec.n_max} exceeds this engine's {self.n_max}")
