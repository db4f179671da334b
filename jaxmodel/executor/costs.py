"""What a runtime's steps cost, measured warm (`calibrate`) and kept per batch bucket (`StepCosts`): the policy,
the batch gate and the memory rule price their choices with them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..speculative import rebuild_pass_rows
from ..state import NULL_PLANE, TRASH_PAGE, Row
from .rows import StepRow
from .shapes import Shapes

if TYPE_CHECKING:
    from .runtime import Runtime


@dataclass
class Calibration:
    """Warm step times measured by `calibrate`, in seconds."""

    step_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens per row) -> a step
    chain_seconds: dict[int, float] = field(default_factory=dict)  # rows -> what one chained MTP draft adds
    rebuild_seconds: dict[int, float] = field(default_factory=dict)  # rows -> one pass of the replay rebuild
    # (rows, tokens per row) -> the longer verify steps that replayed tokens (checkpoint rollback) lead to
    longer_step_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    plane_write_seconds: dict[int, float] = field(default_factory=dict)  # rows -> one more GDN state written


def plane_write_cost(without: Sequence[float], with_writes: Sequence[float], n_planes: int) -> float:
    """Seconds one GDN state written into a plane adds to a step, from runs of the same step without and with
    n_planes more such writes, run in turn: the median of the paired differences, when a one-sided Wilcoxon
    signed-rank test says noise alone would make the runs with writes that much slower at most 5 % of the time,
    else 0. On a shared machine a pair of runs of one step differs either way by far more than the writes may cost,
    so one pair means little, and writes that cost nothing measurable must not trade snapshot for another mode
    over noise (docs/design.md "Rollback").

    >>> plane_write_cost([1.00, 1.02, 1.05, 1.01], [1.01, 1.03, 1.04, 1.02], 4)  # 4 pairs cannot tell
    0.0
    >>> round(plane_write_cost([1.00, 1.02, 1.05, 1.01, 1.00], [1.42, 1.43, 1.45, 1.41, 1.60], 4), 3)  # 0.41 / 4
    0.102
    """
    from scipy.stats import wilcoxon  # here, not at import: scipy.stats takes a noticeable part of a second to load

    differences = [w - o for o, w in zip(without, with_writes, strict=True)]
    if not any(differences):
        return 0.0
    p_noise = wilcoxon(differences, alternative="greater").pvalue
    return max(statistics.median(differences), 0.0) / n_planes if p_noise <= 0.05 else 0.0


@dataclass
class StepCosts:
    """A runtime's calibrated costs by batch bucket, in seconds (empty before `calibrate`)."""

    shapes: Shapes | None
    rebuild_rows: int
    chain_seconds: dict[int, float] = field(default_factory=dict)  # batch bucket -> one chained draft
    rebuild_seconds: dict[int, float] = field(default_factory=dict)  # batch bucket -> one pass of the replay rebuild
    step_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, tokens per row)
    plane_write_seconds: dict[int, float] = field(default_factory=dict)  # batch bucket -> one more state written

    def record(self, calibration: Calibration) -> None:
        """Keep a calibration's figures (replacing earlier ones)."""
        self.chain_seconds = dict(calibration.chain_seconds)
        self.rebuild_seconds = dict(calibration.rebuild_seconds)
        self.step_seconds = {**calibration.step_seconds, **calibration.longer_step_seconds}
        self.plane_write_seconds = dict(calibration.plane_write_seconds)

    def _batch_bucket(self, n_rows: int) -> int:
        """The batch size a step of n_rows rows is padded to, under which its calibrated costs are kept."""
        return self.shapes.batch(n_rows) if self.shapes is not None else n_rows

    def chain_cost(self, n_rows: int) -> float:
        """Seconds one chained draft adds to a step of n_rows rows (0 before `calibrate`)."""
        return self.chain_seconds.get(self._batch_bucket(n_rows), 0.0)

    def plane_write_cost(self, n_rows: int) -> float:
        """Seconds one more GDN state written into a plane adds to a step of n_rows rows (0 before `calibrate`)."""
        return self.plane_write_seconds.get(self._batch_bucket(n_rows), 0.0)

    def step_costs(self, n_rows: int) -> tuple[tuple[int, float], ...]:
        """((tokens per row, seconds), ...) of the calibrated steps of n_rows rows, ascending (empty before
        `calibrate`)."""
        B = self._batch_bucket(n_rows)
        return tuple(sorted((T, seconds) for (b, T), seconds in self.step_seconds.items() if b == B))

    def rebuild_cost(self, n_rows: int) -> tuple[float, int] | None:
        """(seconds, rows) of one pass of the replay rebuild in a step of n_rows rows, which rebuilds as many
        passes as its wrong planes need (None before `calibrate`)."""
        B = self._batch_bucket(n_rows)
        seconds = self.rebuild_seconds.get(B)
        return None if seconds is None else (seconds, rebuild_pass_rows(self.rebuild_rows, B))


def calibrate(runtime: Runtime, repeats: int = 5, spare_planes: Sequence[int] = ()) -> Calibration:
    """Time warm steps of every batch bucket B on rows that feed the trash page from the null plane and write
    nothing else: a decoding step (T = 1), a verify step of 1 + n_chain_max tokens, (with MTP drafting) the same
    verify step chaining n_chain_max drafts on device, whose extra time over n_chain_max is what one chained draft
    adds (a call's time cannot be split into its parts afterwards), and (with a replay pool) one pass of the replay
    rebuild alone over n_max drafts, writing nothing: what a step adds per pass its wrong planes need (too little,
    at small shapes, to be told from a step's noise as a difference of two steps), and the verify steps of every
    compiled length from 1 + n_max up to the 3 n_max + 1 tokens that replayed tokens before `last` can lead to (what
    checkpoint rollback costs). With `spare_planes` (planes no sequence holds, which it overwrites), also the
    longest verify step (1 + n_max tokens, n_max the larger of n_chain_max and the replay pool's) of every batch
    bucket writing the state after each of its tokens into them (several rows, and tokens beyond their number,
    share planes), against the same step writing one state per row as replay and checkpoint rows do: its extra
    time per state is what snapshot rollback's writes cost at that many rows (`plane_write_seconds`; 2 x
    `repeats` pairs run in turn, weighed by `plane_write_cost` so that noise is not taken for a cost). Otherwise
    the minimum of `repeats` runs each; call after `Runtime.warmup` (these shapes compile; the rebuild compiles
    here). Keeps the figures in the runtime's `StepCosts` (`runtime.costs`)."""
    calibration = Calibration()
    if runtime.shapes is None:
        return calibration
    n = max(runtime.n_chain_max, 1)
    T_verify = runtime.shapes.tokens(1 + n)
    T_writes = runtime.shapes.tokens(1 + max(n, runtime.replay_tokens))  # the longest verify rows the engine runs

    def timed(B: int, T: int, n_chain: int, write_planes: Sequence[int] = ()) -> float:
        n_drafts = min(T - 1, runtime.shapes.logit_rows(T, False) - 1)  # any tokens before them are replayed ones
        writes = list(write_planes) + [-1] * (T - len(write_planes))
        rows = [StepRow(Row([1] * T, 0, [TRASH_PAGE], NULL_PLANE, writes, range(T - 1 - n_drafts, T)),
                        drafts=[1] * n_drafts, n_chain=n_chain) for _ in range(B)]  # fmt: skip
        start = time.perf_counter()
        runtime.step(rows)
        return time.perf_counter() - start

    def best(B: int, T: int, n_chain: int) -> float:
        return min(timed(B, T, n_chain) for _ in range(repeats))

    for B in sorted({runtime.shapes.batch(k) for k in range(1, runtime.shapes.max_rows + 1)}):
        calibration.step_seconds[B, 1] = best(B, 1, -1)
        calibration.step_seconds[B, T_verify] = verify = best(B, T_verify, -1)
        if runtime.mtp_chain_max:
            chained = best(B, T_verify, runtime.mtp_chain_max)
            calibration.chain_seconds[B] = max(chained - verify, 0.0) / runtime.mtp_chain_max
        if runtime.replay_tokens:  # what auto weighs: the rebuild, and the steps checkpoints lengthen
            calibration.rebuild_seconds[B] = _time_rebuild(runtime, B, repeats)
            replay = runtime.replay_tokens
            lengths = {runtime.shapes.tokens(k) for k in range(1 + replay, 3 * replay + 2)}
            for T in sorted(lengths - {T for b, T in calibration.step_seconds if b == B}):
                calibration.longer_step_seconds[B, T] = best(B, T, -1)
        if spare_planes:
            every = [spare_planes[t % len(spare_planes)] for t in range(T_writes)]
            one = [-1] * (T_writes - 1) + [spare_planes[0]]
            runs = [(timed(B, T_writes, -1, one), timed(B, T_writes, -1, every)) for _ in range(2 * repeats)]
            calibration.plane_write_seconds[B] = plane_write_cost(*zip(*runs), B * (T_writes - 1))
    runtime.costs.record(calibration)
    return calibration


def _time_rebuild(runtime: Runtime, B: int, repeats: int) -> float:
    """The minimum over `repeats` runs (after one that compiles) of one pass of the replay rebuild in a step
    of B rows, every row of it applying all replay_tokens recorded tokens and writing nothing (targets -1)."""
    rows = rebuild_pass_rows(runtime.rebuild_rows, B)
    none, first = np.full((rows,), -1, np.int32), np.zeros((rows,), np.int32)
    n_keep = np.full((rows,), runtime.replay_tokens, np.int32)
    hidden = np.zeros((rows, runtime.model.cfg.n_embd), np.float32)
    seconds = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        runtime.state = runtime._rebuild(runtime.model.weights, state=runtime.state, source=first, target=none,
                                         slot=first, n_keep=n_keep, hidden=hidden)
        jax.block_until_ready(runtime.state.ssm)
        seconds = seconds if i == 0 else min(seconds, time.perf_counter() - start)
    return seconds
