"""The speculator: what one engine step does between the scheduler's plan and its update (docs/design.md "The
scheduler's step"). Before the plan, the drafter policy's choices per sequence and the batch gate (`plan`), which
the scheduler grants memory for; with the plan, the drafters' proposals, the rows the device runs, the device call
and its iterations, the costs it reports to the policy and the drafters' hooks (`run`), returning what the scheduler
commits (`StepResult`). The scheduler never calls a drafter; the speculator never changes the scheduler's state.

    choices = speculator.plan()
    plan = scheduler.schedule(speculator.draft_plans(choices), speculator.rollback_costs())
    result = speculator.run(plan, choices, quiet)
    events = scheduler.update(result.plan, result.committed, result.continued, result.failed)
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from drafters.base import Drafter
from drafters.policy import Choice, DrafterPolicy
from jaxmodel.executor import Calibration, RowLoop, RowResult, Runtime, StepRow, calibrate
from jaxmodel.state import NULL_PLANE

from .batch_gate import BatchGate, batch_declines
from .core import Scheduler
from .drafting import attach_drafts
from .memory import RollbackCosts
from .step_costs import record_costs
from .step_times import StepTimes
from .types import Committed, Continued, DraftPlan, PlannedRow, SeqId, StepPlan

log = logging.getLogger("gdnspec.engine")


@dataclass(frozen=True)
class StepResult:
    """What a step's device call gave the scheduler to commit (`Scheduler.update`): the plan with the drafts its
    rows verified, per row with logits its verified tokens, per row that ran later iterations what each committed,
    and per row whose part of the step failed the error it ends with."""

    plan: StepPlan
    committed: Mapping[SeqId, Committed]
    continued: Mapping[SeqId, Sequence[Continued]]
    failed: Mapping[SeqId, str]


class Speculator:
    """Drafting and the device call for one engine: its runtime, drafters and drafter policy, reading the
    scheduler's sequences (`Scheduler.request`, `tokens`, `remaining`) but never changing them.

    n_vocab: the target's vocabulary (a draft token outside it is its drafter's fault). n_max: the longest draft
    the engine serves. adaptive, iterations, max_call_seconds: as `Engine` takes them."""

    def __init__(self, scheduler: Scheduler, runtime: Runtime, drafters: Mapping[str, Drafter],
                 policy: DrafterPolicy, *, n_vocab: int, n_max: int, adaptive: bool, iterations: int,
                 max_call_seconds: float | None):
        self.scheduler = scheduler
        self.runtime = runtime
        self.drafters = dict(drafters)
        self.policy = policy
        self.n_vocab = n_vocab
        self.n_max = n_max
        self.adaptive = adaptive
        self.iterations = iterations
        self.max_call_seconds = max_call_seconds
        self._iteration_seconds: dict[int, float] = {}  # rows -> seconds per iteration of the last decoding call
        self.step_times = StepTimes()  # the batch gate's prices (`batch_gate.batch_declines`)
        self._lookup_drafter = next((d.name for d in self.drafters.values() if d.device_lookup() is not None), None)
        self._batch_declined = False  # this step's drafts did not pay for its batch: no row drafts or chains
        self._faults: dict[SeqId, str] = {}  # this step's rows whose part of it failed -> the error they end with
        self.gate = BatchGate()
        self._backlog_slots: dict[SeqId, int] = {}  # sequence -> its slot in the MTP head's backlog
        self._free_backlog_slots = list(range(len(runtime.backlog_held)))

    def draft_plans(self, choices: Mapping[SeqId, Sequence[Choice]]) -> dict[SeqId, DraftPlan]:
        """What the scheduler grants memory for: per sequence the longest planned draft and the first choice's
        acceptance estimate (none planned: `DraftPlan(0, 0.0)`, which borrows nothing)."""
        return {
            seq_id: DraftPlan(max(c.n_draft for c in options), self.policy.acceptance(seq_id, options[0].drafter))
            if options else DraftPlan(0, 0.0)
            for seq_id, options in choices.items()
        }  # fmt: skip

    def run(self, plan: StepPlan, choices: Mapping[SeqId, list[Choice]], quiet: bool) -> StepResult:
        """A scheduled step: the drafters' proposals for its rows, one device call (forward, verification and the
        next on-device drafts, several iterations of it when the host has nothing to decide between them), its
        costs to the policy and its results to the drafters. quiet: no request is arriving (so nothing waits for
        the host). A fault in one row's part of it fails that row alone (`StepResult.failed`)."""
        self._faults = {}
        plan = self._attach_drafts(plan, choices)
        iterations = self._call_iterations(plan, quiet)
        rows = [self._isolated_step_row(row, len(plan.rows), iterations > 1, choices.get(row.seq_id, ()))
                for row in plan.rows]
        if plan.plane_copies or plan.page_copies:
            self.runtime.copy(plan.plane_copies, plan.page_copies)
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
                    self._fault(row.seq_id, self.culprit(exc), exc)
        return StepResult(plan, committed, continued, dict(self._faults))

    def release(self, seq_id: SeqId) -> None:
        """Forget an ended sequence: its drafters' and the policy's state, its backlog slot."""
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

    def shapes_to_compile(self) -> Iterator[object]:
        """The runtime's and the drafters' warm-ups, one compiled shape an item."""
        yield from self.runtime.warmup()
        if self.scheduler.prefix_cache is not None:
            yield from self.runtime.warmup_copies()
        for drafter in self.drafters.values():
            yield from drafter.warmup()

    def calibrate(self, spare_planes: Sequence[int]) -> Calibration:
        """Time the runtime's steps (`executor.calibrate`, lent `spare_planes` to time snapshot's state writes in)
        and give the policy and the batch gate their first prices."""
        calibration = calibrate(self.runtime, spare_planes=spare_planes)
        self.policy.calibrate(calibration.step_seconds)
        self.step_times.calibrate({**calibration.step_seconds, **calibration.longer_step_seconds})
        return calibration

    def plan(self) -> dict[SeqId, list[Choice]]:
        """The policy's drafters and lengths, in order, for every sequence that may draft this step, chosen before
        memory is granted (an empty plan borrows no planes)."""
        may_draft = self.scheduler.may_draft()
        planned = {}
        for seq_id in may_draft:
            config = self.scheduler.request(seq_id).speculative
            if config is None:
                continue
            if self.adaptive:
                choices = self.policy.plan(seq_id, config, len(may_draft))
            else:
                choices = [Choice(name, config.n_max) for name in config.drafters]
            planned[seq_id] = [c for c in choices if c.n_draft > 0]
        self._batch_declined = False
        if self.adaptive and any(planned.values()):  # a step that plans no draft says nothing to the gate
            self._batch_declined = self.gate.closed(batch_declines(
                planned, len(may_draft), runtime=self.runtime, step_times=self.step_times, policy=self.policy,
                drafters=self.drafters))  # fmt: skip
        return {} if self._batch_declined else planned

    def rollback_costs(self) -> RollbackCosts:
        """What each rollback mode costs now, for the memory rule's choice: the rebuild's, the verify steps' and
        snapshot's per state written, as calibrated at this many rows, and the policy's measured per-token cost of a
        target step (what replayed tokens cost until calibrated; the rebuild then costs as much as one of them)."""
        n_rows = max(self.scheduler.n_running, 1)
        per_token = self.policy.token_seconds(n_rows)
        rebuild_seconds, rebuild_rows = self.runtime.costs.rebuild_cost(n_rows) or (per_token, 0)
        return RollbackCosts(token_seconds=per_token, rebuild_seconds=rebuild_seconds, rebuild_rows=rebuild_rows,
                             step_seconds=self.runtime.costs.step_costs(n_rows),
                             plane_write_seconds=self.runtime.costs.plane_write_cost(n_rows))

    def _attach_drafts(self, plan: StepPlan, choices: dict[SeqId, list[Choice]]) -> StepPlan:
        """The plan with the drafts the rows' chosen drafters propose (`drafting.attach_drafts`)."""
        return attach_drafts(plan, choices, tokens=self.scheduler.tokens, drafters=self.drafters,
                             policy=self.policy, n_vocab=self.n_vocab, fault=self._fault)

    def _call_iterations(self, plan: StepPlan, quiet: bool) -> int:
        """Iterations for this step's call. All it may (`_iterations`) while no request waits or arrives; with every
        row taken, until the first row that can end by length does (nothing waiting or arriving can start before a
        row frees, and a row that ends sooner, at a stop token, holds the next one back for at most a call); one
        otherwise, so that a request waiting for memory or for the step's token budget is taken at the next step.
        One, too, when a row computes a request's first token from several fed tokens (the rest of its prompt): such a
        row does not loop, and its first token would otherwise wait for the whole call."""
        most = self._iterations(len(plan.rows))
        if any(row.needs_logits and len(row.fed) > 1 and self.scheduler.generated(row.seq_id) == 0
               for row in plan.rows):
            return 1  # a request's first token (its row cannot loop) streams now, not after the others' iterations
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

    def _step_row(self, row: PlannedRow, batch_size: int, may_loop: bool, choices: Sequence[Choice] = ()) -> StepRow:
        """The runtime's view of a plan row: its drafts, sampling, the drafts to chain on device for its next step
        (as long as the policy would plan for each drafter that chains on device), and whether it may run more
        iterations in the same call (a decoding row in plain, snapshot or replay mode, without stop strings, whose
        drafts come from the device: the MTP head's, or the n-gram lookup's where the policy chose it; `choices`
        are the policy's for this step)."""
        request = self.scheduler.request(row.seq_id)
        config = row.speculative
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
        return StepRow(row.device_row(), row.drafts, request.sampling, n_chain, p_min, loop,
                       replay=row.mode == "replay" and bool(row.drafts), optimistic=row.optimistic,
                       backlog_slot=self._backlog_slot(row.seq_id) if n_chain >= 0 else -1)

    def _isolated_step_row(self, row: PlannedRow, batch_size: int, may_loop: bool,
                           choices: Sequence[Choice]) -> StepRow:
        """`_step_row`; where that raises (a drafter's `device_chain`, the policy), the row's fault and a row that
        only verifies (its result is dropped)."""
        try:
            return self._step_row(row, batch_size, may_loop, choices)
        except Exception as exc:
            self._fault(row.seq_id, self.culprit(exc), exc)
            return StepRow(row.device_row(), row.drafts, replay=row.mode == "replay" and bool(row.drafts),
                           optimistic=row.optimistic)

    def _backlog_slot(self, seq_id: SeqId) -> int:
        """The sequence's slot in the MTP head's backlog, taken at its first row that runs the head (-1 where none
        is free: a preempted sequence keeps its slot while it waits, so slots can run out; its head then catches up
        as it goes)."""
        slot = self._backlog_slots.get(seq_id)
        if slot is None and self._free_backlog_slots:
            slot = self._backlog_slots[seq_id] = self._free_backlog_slots.pop()
        return -1 if slot is None else slot

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

    def _commit(self, row: PlannedRow, result: RowResult, choices: dict[SeqId, list[Choice]]):
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

    def _fault(self, seq_id: SeqId, culprit: str, exc: Exception) -> None:
        """A sequence's part of this step failed: it ends with done(error) naming the culprit; its batch-mates
        go on."""
        if seq_id not in self._faults:
            log.error("sequence %s failed in %s", seq_id, culprit, exc_info=(type(exc), exc, exc.__traceback__))
            self._faults[seq_id] = f"internal error in {culprit} ({type(exc).__name__})"

    def culprit(self, exc: Exception) -> str:
        """What raised `exc` in a step, in words: a drafter by name, the model step, or the innermost function. (A
        detokenizer's exception never gets here: `Scheduler.update` ends its sequence and names it.)"""
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        for frame in frames:
            owner = frame.f_locals.get("self")
            if owner is self.runtime:
                return "the model step"
            if any(owner is drafter for drafter in self.drafters.values()):
                return f"drafter {owner.name!r}"
        code = frames[-1].f_code if frames else None
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}" if code else "the engine"

    def _record_costs(self, plan: StepPlan, rows: list[StepRow], results: list[RowResult], seconds: float) -> None:
        record_costs(plan, rows, results, seconds, runtime=self.runtime, policy=self.policy,
                     step_times=self.step_times, iteration_seconds=self._iteration_seconds,
                     lookup_drafter=self._lookup_drafter, device_drafter=self._device_drafter)  # fmt: skip

    def _observe(self, seq_id, drafter: str | None, drafted: int, accepted: int, committed) -> None:
        if drafter is not None:
            self.drafters[drafter].observe(seq_id, accepted, committed)
            self.policy.observe(seq_id, drafter, drafted, accepted)

    def _drafters_of(self, row: PlannedRow) -> list[Drafter]:
        return [self.drafters[name] for name in row.speculative.drafters] if row.speculative else []

    def _device_drafter(self, row: PlannedRow) -> str | None:
        """The first of the row's drafters that drafts on device (the MTP head), if any."""
        return next((d.name for d in self._drafters_of(row) if d.device_chain(row.seq_id, 0) >= 0), None)

    def _loop_drafter(self, row: PlannedRow, choices: Sequence[Choice]) -> tuple[str | None, tuple[int, int] | None]:
        """Who drafts in the row's later iterations of a call: the policy's main choice where its lookup runs on
        device (with its n-gram sizes), else the first of the row's drafters that chains on device (the MTP head),
        if any."""
        if choices and self.runtime.lookup_drafts:
            lookup = self.drafters[choices[0].drafter].device_lookup()
            if lookup is not None:
                return choices[0].drafter, lookup
        return self._device_drafter(row), None
