"""What a step's device call cost, told to those who price drafting: the drafter policy (the target's time per
token, the MTP chain's per draft), the batch gate (`step_times`: time per iteration and tokens per second by batch
size and drafter) and the bound on a call's iterations (its time per iteration)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from drafters.policy import DrafterPolicy
from jaxmodel.executor import RowResult, Runtime, StepRow

from .memory import replay_plane_wrong
from .step_times import StepTimes
from .types import PlannedRow, StepPlan


def tokens_per_iteration(first: int, results: Sequence[RowResult], n_iterations: int) -> float:
    """The tokens a device call of `n_iterations` iterations verified per iteration: `first` in its first
    iteration (the plan's rows, drafts included), and in each later one 1 + the drafts of every row that ran it
    (`RowResult.more`). A call whose later iterations draft on device costs more per iteration than its first
    iteration's tokens say; priced by those alone, drafting looked cheaper the more it was done.

    Example: two rows, the first iteration plain (2 tokens); in the second, one row verifies 3 drafts and the
    other none; in the third only the first row runs, without drafts: (2 + (4 + 1) + 1) / 3 = 8/3."""
    later = sum(1 + len(it.drafts) for result in results for it in result.more)
    return (first + later) / n_iterations


def record_costs(plan: StepPlan, rows: list[StepRow], results: Sequence[RowResult], seconds: float, *,
                 runtime: Runtime, policy: DrafterPolicy, step_times: StepTimes,
                 iteration_seconds: dict[int, float], lookup_drafter: str | None,
                 device_drafter: Callable[[PlannedRow], str | None]) -> None:
    """Report a device call's time to the policy: the target's share per iteration, and the MTP head's chain
    (measured once by `executor.calibrate`, since one call's time cannot be split) as the proposal cost of
    the drafter that chains on device, shared by the rows that chained. A step with replay rows ran the replay
    rebuild in its iterations (its calibrated cost is not the target's). Steps with prompt chunks are not
    reported: their cost follows the chunk, not the drafts. The time per iteration is priced by the tokens an
    iteration verified on average, later iterations' device drafts included (`tokens_per_iteration`). Also
    keeps the call's time per iteration in iteration_seconds (by rows, for `max_call_seconds`) and, by its rows
    and tokens per row, for the batch gate (`step_times`). A call that traced is not reported: its time is mostly
    compilation."""
    if runtime.last_step_traced or not all(row.needs_logits and len(row.fed) == 1 for row in plan.rows):
        return
    n_iterations = 1 + max(len(r.more) for r in results)
    iteration_seconds[len(rows)] = seconds / n_iterations  # the last call's, so a slow one passes
    if runtime.shapes is not None:
        tokens = runtime.shapes.tokens(max(len(row.tokens) for row in plan.rows))
        B = runtime.shapes.batch(len(rows))
        step_times.record(B, tokens, seconds / n_iterations, looped=n_iterations > 1)
        committed = sum(len(r.committed) + sum(len(it.committed) for it in r.more) for r in results)
        step_times.record_rate(B, call_drafter(plan, rows, lookup_drafter, device_drafter), committed, seconds)
    chaining = [(row, step_row.n_chain) for row, step_row in zip(plan.rows, rows) if step_row.n_chain > 0]
    per_draft = runtime.costs.chain_cost(len(rows))
    chain_seconds = per_draft * max((n for _, n in chaining), default=0)  # the chain runs its longest row's links
    rebuilding = rebuild_seconds(runtime, rows, results)
    policy.record_target(max((seconds - rebuilding) / n_iterations - chain_seconds, 0.0),
                         tokens_per_iteration(plan.n_tokens, results, n_iterations), n_iterations,
                         len(plan.rows))  # fmt: skip
    n_chained = sum(n for _, n in chaining)
    for row, n_chain in chaining:
        name = device_drafter(row)
        if name is not None:
            policy.record_proposal(name, chain_seconds * n_chain / n_chained, n_chain)


def call_drafter(plan: StepPlan, rows: list[StepRow], lookup_drafter: str | None,
                 device_drafter: Callable[[PlannedRow], str | None]) -> str | None:
    """The drafter most of a call's rows drafted with or were given to draft with: a row's own drafts' drafter,
    else the n-gram lookup where its iterations looked up (whether or not it found a draft), else the MTP head
    where it chained; None where no row did any of it (the rate plain decoding is measured by: a call whose
    lookup found nothing still paid for the lookup)."""
    names: Counter[str] = Counter()
    for row, step_row in zip(plan.rows, rows):
        if row.drafts:
            name = row.drafter
        elif step_row.loop is not None and step_row.loop.lookup is not None:
            name = lookup_drafter
        else:
            name = device_drafter(row) if step_row.n_chain > 0 else None
        if name is not None:
            names[name] += 1
    return names.most_common(1)[0][0] if names else None


def rebuild_seconds(runtime: Runtime, rows: list[StepRow], results: Sequence[RowResult]) -> float:
    """What a device call spent rebuilding replay rows: per iteration, a calibrated pass per rebuild_rows of
    its wrong planes (`replay_plane_wrong`)."""
    cost = runtime.costs.rebuild_cost(len(rows))
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
