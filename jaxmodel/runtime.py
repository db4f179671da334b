"""The device executor: owns a model's state pools, pads host rows into a few compiled shapes, and runs one jitted
call per step (`jaxmodel.speculative`): the target's forward, verification and the next MTP drafts, or a draft
model's whole chain. Inputs are built with numpy and travel packed in one buffer, as do the small arrays the host
reads back (`jaxmodel.host_io`).

Synchronous and single-threaded: the engine calls it from one worker thread at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from .config import ModelConfig
from .delta_rule import CPU_CHUNKED_MIN_TOKENS
from .host_io import PackedCall
from .model import Model, rebuild
from .ngram_lookup import LOOKUP_MAX_N
from .requests import Sampling
from .sampling import SamplingParams
from .speculative import (BacklogInputs, ChainInputs, LoopInputs, ReplayInputs, VerifyInputs, draft_chain,
                          later_width, rebuild_pass_rows, speculative_step)
from .state import NULL_PLANE, TRASH_PAGE, Row, StepOutput, bucket, bytes_per_plane, pack_batch


@dataclass(frozen=True)
class RowLoop:
    """Lets a row run further iterations in the same device call (see `jaxmodel.speculative.LoopInputs`): each
    feeds the bonus token and up to n_draft MTP drafts, writing into `planes` (the row's read plane first, then
    its write planes in order) minus the live one; at most `budget` tokens are committed in all. replay: the
    iterations roll back by replay (two planes; n_draft at most the runtime's replay pool), else by snapshot;
    optimistic: they replay optimistically (see `StepRow`). lookup: the drafts come from an n-gram lookup on
    device over the row's last `LOOKUP_HISTORY` tokens and what the call commits (`jaxmodel.ngram_lookup`), at most
    the runtime's lookup_drafts of them, instead of the MTP head. The planes never include the null plane (a
    sequence's first row reads it, and runs one iteration)."""

    n_draft: int
    planes: Sequence[int]
    budget: int
    replay: bool = False
    optimistic: bool = False
    lookup: tuple[int, int] | None = None  # (min_n, max_n): the drafts come from an n-gram lookup over `history`
    history: Sequence[int] = ()  # the row's tokens up to `last` (only with `lookup`)


@dataclass(frozen=True)
class StepRow:
    """A row of a target step plus what verification and MTP drafting need.

    `row.logit_rows` must be the indices of `last` and of each draft among the fed tokens (empty: nothing is
    committed, e.g. an intermediate prompt chunk). n_chain: -1 leaves the MTP head alone, 0 has it catch up on the
    committed tokens, n > 0 also chains up to n drafts for the next step, stopping below p_min.
    replay: replay rollback (docs/design.md "Rollback"): the row writes one state, and the call rebuilds it after
    verification where it is wrong (`jaxmodel.speculative.ReplayInputs`). Forward: the state after `last`, into
    `row.write_planes` at `last` (and nothing else), advanced by the accepted drafts when one is. optimistic: the
    state after the last draft, into `row.write_planes` at the row's last token (and nothing else), rebuilt from
    the read plane when a draft is rejected; only for rows without replayed tokens before `last`. Needs a runtime
    with a replay pool of at least len(drafts) tokens.
    backlog_slot: the row's slot in the MTP head's backlog (`state.HeadBacklog`; -1: none), one per sequence that
    names the head, owned by the caller. Where the row's head only catches up (n_chain 0, no MTP chain in later
    iterations), the call holds the catch-up there while the slot has room and runs no head pass for the row; the
    held tokens are caught up in the first call in which the head chains or the slot could overflow. The caller
    empties a slot it gives to another sequence (`Runtime.release_backlog`).
    """

    row: Row
    drafts: Sequence[int] = ()
    sampling: Sampling = field(default_factory=Sampling)
    n_chain: int = -1
    p_min: float = 0.0
    loop: RowLoop | None = None
    replay: bool = False
    optimistic: bool = False
    backlog_slot: int = -1


@dataclass(frozen=True)
class Iteration:
    """A later iteration of a looping row: the drafts it fed (the rejected ones as -1: the call returns only what
    was committed) and what it committed."""

    drafts: list[int]
    n_accepted: int
    committed: list[int]


@dataclass(frozen=True)
class RowResult:
    n_accepted: int
    committed: list[int]  # accepted drafts + one token from the target; empty when nothing was committed
    next_drafts: list[int]  # the MTP head's drafts continuing after the row's last committed token
    more: list[Iteration] = field(default_factory=list)  # later iterations in the same call


@dataclass
class Calibration:
    """Warm step times measured by `Runtime.calibrate`, in seconds."""

    step_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens per row) -> a step
    chain_seconds: dict[int, float] = field(default_factory=dict)  # rows -> what one chained MTP draft adds
    rebuild_seconds: dict[int, float] = field(default_factory=dict)  # rows -> one pass of the replay rebuild
    # (rows, tokens per row) -> the longer verify steps that replayed tokens (checkpoint rollback) lead to
    longer_step_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    plane_write_seconds: dict[int, float] = field(default_factory=dict)  # rows -> one more GDN state written


@dataclass(frozen=True)
class Shapes:
    """Which padded shapes a runtime compiles, kept few because each is a compile.

    Rows are bucketed by powers of 4 (on CPU a matmul of 2 rows costs about what 4 do), and so are tokens per row, with
    8 added between 4 and 16: verify steps of 4..7 drafts (5..8 tokens) would otherwise pad to 16, which costs half as
    much again as 8 on CPU (bench/results/step-cpu-verify-lengths.json). Every row has the page table of a full-length
    sequence, so the page count adds no shapes (attention's cost follows the live context, not the table's width).
    Logits come for every row of a short step (T <= 16: verification wants them all), and for long steps (prompt chunks)
    either for one row (a prefill-only step, which also takes the chunked GDN form) or for as many as a draft can need
    (prompt chunks batched with decoding sequences).
    """

    max_rows: int  # sequences per step
    max_tokens: int  # tokens per row (a prompt chunk, or replays + last + drafts)
    max_logit_rows: int  # 1 + the longest draft
    pages_per_row: int
    # The batch sizes compiled, ascending, the last at least max_rows; empty: the powers of 4 up to max_rows'.
    row_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        buckets = self.row_buckets
        if buckets and (list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] < self.max_rows):
            raise ValueError(f"row_buckets {buckets} must ascend from 1 or more to at least max_rows {self.max_rows}")

    def batch(self, n_rows: int) -> int:
        if self.row_buckets:
            return next((b for b in self.row_buckets if b >= n_rows), self.row_buckets[-1])
        return min(bucket(n_rows, base=4), bucket(self.max_rows, base=4))

    def tokens(self, n_tokens: int) -> int:
        """The compiled length of a row of n_tokens tokens: 1, 4, 8, 16, 64, 256, ... capped at max_tokens."""
        return min(8 if 4 < n_tokens <= 8 else bucket(n_tokens, base=4), self.max_tokens)

    def is_long(self, T: int) -> bool:
        return T >= CPU_CHUNKED_MIN_TOKENS

    def logit_rows(self, T: int, final_only: bool) -> int:
        return 1 if final_only else min(T, bucket(self.max_logit_rows, base=4))

    def grid(self):
        """Every (B, T, R, final_only) a target step can take."""
        Bs = sorted({self.batch(n) for n in range(1, self.max_rows + 1)})
        Ts = sorted({self.tokens(n) for n in range(1, self.max_tokens + 1)})
        for B, T in itertools.product(Bs, Ts):
            for final_only in (False, True) if self.is_long(T) else (False,):
                yield B, T, self.logit_rows(T, final_only), final_only


def share_buckets(rows: int) -> tuple[int, ...]:
    """`Shapes.row_buckets` for a runtime that serves `rows` rows beside other runtimes: the powers of 4 below
    `rows`, then `rows` itself, so that a share of 8 rows never pads to 16.

    >>> share_buckets(8), share_buckets(4), share_buckets(1)
    ((1, 4, 8), (1, 4), (1,))
    """
    return tuple(sorted({min(bucket(n, base=4), rows) for n in range(1, rows + 1)}))


# Steps of up to this many tokens per row (decode and verify steps) may run several iterations per call.
LOOP_MAX_TOKENS = 16
# With `Runtime.split_chunks`, prompt chunks run in calls of at most this many rows (a batch bucket, so no new
# shape): long chunks padded to 16 rows cost several times what they do in calls of four.
CHUNK_CALL_ROWS = 4
# ... where the calls pad fewer (row, token) slots than one call, counting this many for each extra call: a call's
# fixed cost is about what a hundred padded slots cost on the bundled model; larger models' slots cost more against
# the call, so the count is conservative (docs/performance.md, "Steps that mix prompt chunks with decoding rows").
CALL_COST_SLOTS = 100
# The n-gram lookup on device searches this many of a row's latest tokens (plus what the call commits); the host's
# n-gram drafter searches the whole sequence, so only longer sequences may draft differently (never output).
LOOKUP_HISTORY = 512

# On CPU the replay rebuild goes one row per pass where a row's GDN state is at least this large: moving the
# states through memory then dominates, so a pass costs about what its rows do, and rebuilding only the wrong rows
# pays. Well below it a pass costs mostly its fixed launch overhead, and one pass of all rows is cheaper
# (docs/design.md "Rollback", with the measurements).
PER_ROW_REBUILD_MIN_BYTES = 4 << 20


@functools.lru_cache(maxsize=None)
def _compiled(cfg: ModelConfig):
    """The jitted step, chain and replay rebuild (timed alone by `calibrate`) of a config, shared by every runtime
    of it (so their compilations are too)."""
    step = PackedCall(functools.partial(speculative_step, cfg=cfg),
                      static_argnames=("final_only", "n_max", "max_iterations", "draft_vocab", "rebuild_rows",
                                       "lookup_width"))

    def chain(weights, state, **inputs):
        drafts, n_drafted, state = draft_chain(weights, cfg, state=state, **inputs)
        return (drafts, n_drafted), state

    return step, PackedCall(chain, static_argnames=("n_max",)), jax.jit(functools.partial(rebuild, cfg=cfg),
                                                                        donate_argnames="state")


def plane_write_cost(without: Sequence[float], with_writes: Sequence[float], n_planes: int) -> float:
    """Seconds one GDN state written into a plane adds to a step, from runs of the same step without and with
    n_planes more such writes, run in turn: the median of the paired differences, when a one-sided Wilcoxon
    signed-rank test says noise alone would make the runs with writes that much slower at most 5 % of the time,
    else 0. A shared machine's pairs differ by tens of milliseconds either way in a 0.6 s step (and now and then
    by 0.3 s), so one pair means little, and writes that cost nothing measurable must not trade snapshot for
    another mode over noise.

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


def chunk_calls(lengths: Sequence[int], shapes: Shapes | None) -> list[list[int]] | None:
    """How `Runtime.step` with `split_chunks` runs a step whose rows have these token counts: the indices of each
    call's rows (prompt chunks, longest first, CHUNK_CALL_ROWS to a call; then the short rows in a call of their
    own), or None for one joined call. It splits where that pads fewer (row, token) slots, counting each extra call
    as CALL_COST_SLOTS: a joined call pads every row to the longest one's token bucket and the rows to their batch
    bucket, and on CPU each padded slot costs elementwise work even where the products skip it.

    >>> shapes = Shapes(max_rows=16, max_tokens=128, max_logit_rows=4, pages_per_row=8)
    >>> chunk_calls([100] + [1] * 15, shapes)  # one chunk beside 15 decoding rows: 128 + 16 slots against 2048
    [[0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    >>> chunk_calls([90, 100, 95, 97, 99, 92], shapes)  # six chunks: 4 + 2 rows (512 + 512 slots) against 2048
    [[1, 4, 3, 2], [5, 0]]
    >>> chunk_calls([22] * 14 + [12, 12], shapes) is None  # 16 short prompts: one call of 16 rows (1024 slots)
    True
    """
    long = sorted((i for i, n in enumerate(lengths) if n > LOOP_MAX_TOKENS), key=lambda i: -lengths[i])
    short = [i for i, n in enumerate(lengths) if n <= LOOP_MAX_TOKENS]
    if shapes is None or not long or (not short and len(long) <= CHUNK_CALL_ROWS):
        return None
    calls = [long[g : g + CHUNK_CALL_ROWS] for g in range(0, len(long), CHUNK_CALL_ROWS)] + ([short] if short else [])

    def slots(rows: list[int]) -> int:
        return shapes.batch(len(rows)) * shapes.tokens(max(lengths[i] for i in rows))

    split = sum(slots(rows) for rows in calls) + (len(calls) - 1) * CALL_COST_SLOTS
    return calls if split < slots(long + short) else None


class Runtime:
    """A model + its device state. `n_pages`/`n_planes` include the trash page and the null plane.

    n_chain_max: the longest draft chain a step computes on device (the MTP head's for a target, the whole chain
    for a draft model); 0 for none. max_iterations: the most iterations one step may run (short steps only).
    stop_ids: end-of-generation ids, which end a row's iterations on device. draft_vocab: the MTP head drafts
    among the token ids below it (None: all). replay_tokens: the longest draft a row in replay rollback may verify
    (the replay pool holds that many tokens for each of `replay_slots` rows, by default `shapes.max_rows`; 0: no
    replay pool, and no rebuild compiled). rebuild_rows: rows per pass of the replay rebuild (0: all rows of a
    step in one pass; see `jaxmodel.speculative.replay_rebuild`). By default one on CPU where a row's state is
    large (`PER_ROW_REBUILD_MIN_BYTES`), and all elsewhere. lookup_drafts: the most drafts a row drafting by n-gram
    lookup on device (`RowLoop.lookup`) feeds per later iteration; 0: no row does, and no lookup compiles. Calls
    with such rows compile apart, for first iterations of up to `lookup_width` tokens: their later iterations run at
    lookup_width tokens where some row feeds drafts and at one token where none does. backlog_slots x
    backlog_tokens: the MTP head's backlog (`StepRow.backlog_slot`); none when either is 0 or no MTP head drafts
    here. split_chunks: a step with
    prompt chunks (rows of more than LOOP_MAX_TOKENS tokens) runs them in calls of at most CHUNK_CALL_ROWS rows,
    apart from its short rows, where that pads fewer slots (see `step`, `chunk_calls`); by default on CPU.
    """

    def __init__(self, model: Model, *, n_pages: int, n_planes: int, page_size: int = 16,
                 shapes: Shapes | None = None, n_chain_max: int = 0, max_iterations: int = 1,
                 stop_ids: Sequence[int] = (), draft_vocab: int | None = None, replay_tokens: int = 0,
                 replay_slots: int | None = None, rebuild_rows: int | None = None, lookup_drafts: int = 0,
                 split_chunks: bool | None = None, kv_dtype="float32", backlog_slots: int = 0,
                 backlog_tokens: int = 0):
        self.model = model
        self.split_chunks = jax.default_backend() == "cpu" if split_chunks is None else split_chunks
        self.page_size = page_size
        self.shapes = shapes
        self.n_chain_max = n_chain_max
        self.max_iterations = max_iterations
        self.draft_vocab = draft_vocab if draft_vocab and draft_vocab < model.cfg.n_vocab else None
        # -1 pads (it matches no token) to at least 4 ids, so that engines told of up to 4 end-of-generation ids
        # (none, an eval's single one, a tokenizer's pair) share their compiled steps.
        stop_ids = sorted(stop_ids)
        self.stop_ids = np.full((bucket(len(stop_ids), minimum=4, base=4),), -1, np.int32)
        self.stop_ids[: len(stop_ids)] = stop_ids
        if replay_slots is None:
            replay_slots = shapes.max_rows if shapes is not None else 1
        replay_slots = replay_slots if model.cfg.gdn_layers else 0
        if not self.mtp_chain_max:
            backlog_slots = 0
        self.state = model.new_state(n_pages=n_pages, n_planes=n_planes, page_size=page_size,
                                     replay_slots=replay_slots, replay_tokens=replay_tokens, kv_dtype=kv_dtype,
                                     backlog_slots=backlog_slots, backlog_tokens=backlog_tokens)  # fmt: skip
        # Per backlog slot: the tokens it holds (the device's count, read back after each call).
        self.backlog_held = [0] * (backlog_slots if self.state.backlog is not None else 0)
        if rebuild_rows is None:
            per_row = jax.default_backend() == "cpu" and bytes_per_plane(model.cfg) >= PER_ROW_REBUILD_MIN_BYTES
            rebuild_rows = 1 if per_row else 0
        self.rebuild_rows = rebuild_rows
        self.lookup_drafts = lookup_drafts
        width = 1 + lookup_drafts
        self.lookup_width = (shapes.tokens(width) if shapes is not None else width) if lookup_drafts else 0
        self._step, self._chain, self._rebuild = _compiled(model.cfg)
        self.chain_seconds: dict[int, float] = {}  # batch bucket -> seconds per chained draft (see calibrate)
        self.rebuild_seconds: dict[int, float] = {}  # batch bucket -> seconds one pass of the replay rebuild takes
        self.step_seconds: dict[tuple[int, int], float] = {}  # (batch bucket, tokens per row) -> a verify step
        self.plane_write_seconds: dict[int, float] = {}  # batch bucket -> one more GDN state written (see calibrate)

    @property
    def last_step_traced(self) -> bool:
        """Whether the last `step` was the first of its shape in this process (traced, and compiled unless a cache
        held it): its time says little about the next one's."""
        return self._step.traced

    @property
    def replay_tokens(self) -> int:
        """The longest draft a replay row may verify (0: this runtime has no replay pool)."""
        return self.state.replay_tokens

    @property
    def replay_slots(self) -> int:
        """Rows of a step that may be in replay rollback: the rows with index below it."""
        return self.state.replay[0].shape[0] if self.state.replay else 0

    @property
    def mtp_chain_max(self) -> int:
        return self.n_chain_max if self.model.has_mtp else 0

    def state_intact(self) -> bool:
        """Whether every buffer of the state is alive (a device call that failed after its donated state was
        taken leaves it deleted)."""
        return not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.state))

    def release_backlog(self, slot: int) -> None:
        """Forget what a backlog slot holds (its sequence ended; its positions' head KV is no longer wanted)."""
        self.backlog_held[slot] = 0

    def _pack(self, rows: Sequence[Row], prefill_only: bool):
        """The padded batch, and whether it runs as final-only (long prefill-only steps)."""
        if self.shapes is None:
            return pack_batch(rows), prefill_only
        T = self.shapes.tokens(max(len(r.tokens) for r in rows))
        final_only = prefill_only and self.shapes.is_long(T)
        R = self.shapes.logit_rows(T, final_only)
        return pack_batch(rows, B=self.shapes.batch(len(rows)), T=T, P=self.shapes.pages_per_row, R=R), final_only

    def forward(self, rows: Sequence[Row], *, prefill_only: bool = False) -> StepOutput:
        """The model's plain forward (no verification). prefill_only: each row writes at most its final state and
        wants at most its last token's logits."""
        batch, final_only = self._pack(rows, prefill_only)
        out, self.state = self.model.step(self.model.weights, batch=batch, state=self.state, final_only=final_only)
        return out

    def loops(self, T: int, final_only: bool) -> int:
        """The static iteration bound of a step shape: only short steps loop."""
        return self.max_iterations if T <= LOOP_MAX_TOKENS and not final_only else 1

    def step(self, rows: Sequence[StepRow], iterations: int = 1) -> list[RowResult]:
        """One target step over all rows: forward, verification and MTP drafting in one device call; rows with a
        `loop` run up to `iterations` iterations in all (a short step's; others run one).

        With `split_chunks`, a step with prompt chunks runs them in calls of at most CHUNK_CALL_ROWS rows, first,
        then its short rows (decoding, verifying) in a call of their own, where that pads fewer slots than one call
        (`chunk_calls`), every row one iteration as in a joined
        call. Rows are independent (their own pages and planes), so the results are the same; the cost is not: a
        joined call pads every row to the longest row's length and the rows to their bucket (1, 4, 16, 64), and on
        CPU the padding's elementwise work, GDN conv and state writes cost per token (the products skip it): in two
        calls, decoding rows beside a long chunk cost a fraction of one joined call (docs/performance.md, "Steps
        that mix prompt chunks with decoding rows"); the chunks may then also take the final-only form
        (`Shapes.logit_rows`)."""
        calls = chunk_calls([len(r.row.tokens) for r in rows], self.shapes) if self.split_chunks else None
        if calls is not None:
            results: list[RowResult | None] = [None] * len(rows)
            for group in calls:
                for i, result in zip(group, self._call([rows[i] for i in group], 1), strict=True):
                    results[i] = result
            return results
        return self._call(rows, iterations)

    def _call(self, rows: Sequence[StepRow], iterations: int) -> list[RowResult]:
        """`step` as one device call."""
        prefill_only = all(
            list(r.row.logit_rows) in ([], [len(r.row.tokens) - 1]) and all(w < 0 for w in r.row.write_planes[:-1])
            for r in rows
        )
        batch, final_only = self._pack([r.row for r in rows], prefill_only)
        B, T = batch.tokens.shape
        verify_in, chain = self._step_inputs(rows, B, batch.logit_rows.shape[1])
        max_iterations = self.loops(T, final_only)
        # Lookup rows loop only in calls whose first iteration fits the lookup shapes; elsewhere they run one.
        lookup = (max_iterations > 1 and T <= self.lookup_width
                  and any(r.loop is not None and r.loop.lookup for r in rows))  # fmt: skip
        loop = self._loop_inputs(rows, B, min(iterations, max_iterations), lookup) if max_iterations > 1 else None
        width = later_width(T, self.mtp_chain_max, self.lookup_width if lookup else 0)
        backlog = self._backlog_inputs(rows, B, loop, width)
        inputs = dict(batch=batch, verify_in=verify_in, chain=chain, loop=loop, backlog=backlog,
                      replay=self._replay_inputs(rows, B, T, final_only, lookup))
        (out, more), self.state = self._step(
            self.model.weights, self.state, inputs, final_only=final_only, n_max=self.mtp_chain_max,
            max_iterations=max_iterations, draft_vocab=self.draft_vocab, rebuild_rows=self.rebuild_rows,
            lookup_width=self.lookup_width if lookup else 0,
        )  # fmt: skip
        n_accepted, tokens, drafts, n_drafted = out.n_accepted, out.tokens, out.drafts, out.n_drafted
        # Python ints a row at a time, not numpy scalars an element at a time: a call of 64 iterations of 16 rows
        # returns about a thousand of them.
        n_accepted, n_drafted = n_accepted.tolist(), n_drafted.tolist()
        if backlog is not None:
            for slot, held in zip(backlog.slot.tolist(), out.held.tolist()):
                if slot >= 0:
                    self.backlog_held[slot] = held
        if more is not None:
            ran, more_accepted, more_drafts = more.ran.T, more.n_accepted.T.tolist(), more.n_drafts.T.tolist()
        results = []
        for b, r in enumerate(rows):
            if not r.row.logit_rows:
                results.append(RowResult(0, [], []))
                continue
            a = n_accepted[b]
            later = []
            if more is not None:
                iterations = np.flatnonzero(ran[b]).tolist()
                for j, row_tokens in zip(iterations, more.tokens[iterations, b].tolist()):
                    a_j, d_j = more_accepted[b][j], more_drafts[b][j]
                    later.append(Iteration(row_tokens[:a_j] + [-1] * (d_j - a_j), a_j, row_tokens[: a_j + 1]))
            results.append(RowResult(a, tokens[b, : a + 1].tolist(), drafts[b, : n_drafted[b]].tolist(), later))
        return results

    def _replay_inputs(self, rows: Sequence[StepRow], B: int, T: int, final_only: bool,
                       lookup: bool = False) -> ReplayInputs | None:
        """The replay rows' planes. None where no row can replay, so that no rebuild compiles there: without a
        replay pool, and in shapes that carry no draft (one token per row, prefill-only steps), unless a lookup
        call's later iterations carry drafts."""
        if not self.replay_tokens or (T == 1 and not lookup) or final_only:
            if any(r.replay for r in rows):
                raise ValueError("a replay row needs a runtime with a replay pool and a step shape with drafts")
            return None
        plane = np.full((B,), -1, np.int32)
        optimistic = np.zeros((B,), bool)
        for b, r in enumerate(rows):
            if r.replay:
                if b >= self.replay_slots or len(r.drafts) > self.replay_tokens:
                    raise ValueError(f"row {b}: replay needs a replay slot and at most {self.replay_tokens} "
                                     f"drafts")  # fmt: skip
                if r.optimistic and r.row.logit_rows[0] != 0:
                    raise ValueError(f"row {b}: optimistic replay needs `last` to be the row's first token")
                plane[b] = r.row.write_planes[-1 if r.optimistic else r.row.logit_rows[0]]
                optimistic[b] = r.optimistic
        return ReplayInputs(plane, optimistic)

    def _backlog_inputs(self, rows: Sequence[StepRow], B: int, loop: LoopInputs | None,
                        width: int) -> BacklogInputs | None:
        """Which rows flush and which hold (`BacklogInputs`), None without a backlog. A row holds where its head only
        catches up (n_chain 0 and no MTP chain in its later iterations); it flushes where it holds something and
        either chains or its slot might not have room for every token the call may commit for it: its fed tokens,
        then its bonus and up to its drafts (at most width - 1) an iteration after the first."""
        if self.state.backlog is None:
            return None
        slot, held = np.full((B,), -1, np.int32), np.zeros((B,), np.int32)
        flush, hold = np.zeros((B,), bool), np.zeros((B,), bool)
        capacity = self.state.backlog.capacity
        for b, r in enumerate(rows):
            if r.backlog_slot < 0 or r.n_chain < 0:
                continue
            slot[b], held[b] = r.backlog_slot, self.backlog_held[r.backlog_slot]
            later = int(loop.n_iterations) - 1 if loop is not None and loop.loops[b] else 0
            chains_later = later > 0 and loop.lookup_min[b] == 0 and loop.n_draft[b] > 0
            most = len(r.row.tokens) + (later * (1 + min(int(loop.n_draft[b]), width - 1)) if later else 0)
            hold[b] = r.n_chain == 0 and not chains_later
            flush[b] = held[b] > 0 and (not hold[b] or held[b] + most > capacity)
        return BacklogInputs(slot, held, flush, hold)

    def _loop_inputs(self, rows: Sequence[StepRow], B: int, iterations: int, lookup: bool = False) -> LoopInputs:
        """The loop's inputs. lookup: the call runs the n-gram lookup; without it, rows drafting by lookup run
        one iteration."""
        width = max(self.mtp_chain_max + 2, self.lookup_width + 1)
        loops, replay, optimistic = np.zeros((B,), bool), np.zeros((B,), bool), np.zeros((B,), bool)
        n_draft, budget, capacity = np.zeros((B,), np.int32), np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        planes = np.full((B, width), -1, np.int32)
        lookup_min, lookup_max = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        H = LOOKUP_HISTORY + LOOP_MAX_TOKENS + self.max_iterations * self.lookup_width if lookup else 1
        history, history_len = np.zeros((B, H), np.int32), np.zeros((B,), np.int32)
        for b, r in enumerate(rows):
            capacity[b] = len(r.row.pages) * self.page_size
            if r.loop is None or (r.loop.lookup and not lookup):
                continue
            if r.loop.replay and (b >= self.replay_slots or r.loop.n_draft > self.replay_tokens):
                raise ValueError(f"row {b}: replay iterations need a replay slot and at most "
                                 f"{self.replay_tokens} drafts")  # fmt: skip
            if NULL_PLANE in r.loop.planes:
                raise ValueError(f"row {b}: its iterations would write the null plane (planes {r.loop.planes})")
            loops[b], replay[b], optimistic[b] = True, r.loop.replay, r.loop.optimistic
            n_draft[b], budget[b] = r.loop.n_draft, r.loop.budget
            planes[b, : len(r.loop.planes)] = r.loop.planes[:width]
            if r.loop.lookup:
                min_n, max_n = r.loop.lookup
                if not 1 <= min_n <= max_n <= LOOKUP_MAX_N or r.loop.n_draft > self.lookup_drafts:
                    raise ValueError(f"row {b}: a lookup needs 1 <= min_n <= max_n <= {LOOKUP_MAX_N} and at most "
                                     f"{self.lookup_drafts} drafts, got {r.loop.lookup} and {r.loop.n_draft}")
                lookup_min[b], lookup_max[b] = min_n, max_n
                tail = np.asarray(r.loop.history[-LOOKUP_HISTORY:], np.int32)
                history[b, : len(tail)], history_len[b] = tail, len(tail)
        return LoopInputs(loops, replay, optimistic, n_draft, planes, budget, capacity, self.stop_ids,
                          np.int32(iterations), lookup_min, lookup_max, history, history_len)

    @staticmethod
    def _step_inputs(rows: Sequence[StepRow], B: int, R: int) -> tuple[VerifyInputs, ChainInputs]:
        drafts = np.zeros((B, R - 1), np.int32)
        n_drafts = np.zeros((B,), np.int32)
        positions = np.zeros((B,), np.int32)
        commits = np.zeros((B,), bool)
        n_chain = np.full((B,), -1, np.int32)
        p_min = np.zeros((B,), np.float32)
        temperature, top_p = np.zeros((B,), np.float32), np.ones((B,), np.float32)
        top_k, seed = np.zeros((B,), np.int32), np.zeros((B,), np.uint32)
        for b, r in enumerate(rows):
            d = len(r.drafts)
            drafts[b, :d] = r.drafts
            n_drafts[b] = d
            if r.row.logit_rows:
                positions[b] = r.row.start + r.row.logit_rows[0] + 1
                commits[b] = True
            n_chain[b], p_min[b] = r.n_chain, r.p_min
            s = r.sampling
            temperature[b], top_p[b], top_k[b], seed[b] = s.temperature, s.top_p, s.top_k, s.seed & 0xFFFFFFFF
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return VerifyInputs(drafts, n_drafts, positions, commits, params), ChainInputs(n_chain, p_min)

    def chain(self, rows: Sequence[Row], chain_planes: Sequence[Sequence[int]], n_chain: Sequence[int],
              p_min: Sequence[float]) -> list[list[int]]:
        """A draft model's greedy chains, one device call: each row feeds its backlog ending with `last` (one logit
        row, at `last`, writing chain_planes[b][0]); draft k is fed reading chain_planes[b][k-1] and writing
        chain_planes[b][k]. Returns each row's drafts (at most n_chain[b], fewer where a draft's probability falls
        below p_min[b])."""
        batch, _ = self._pack(rows, prefill_only=True)
        B, n = batch.tokens.shape[0], self.n_chain_max
        planes = np.full((B, n), -1, np.int32)
        wanted = np.zeros((B,), np.int32)
        floor = np.zeros((B,), np.float32)
        for b in range(len(rows)):
            planes[b, : len(chain_planes[b][:n])] = chain_planes[b][:n]
            wanted[b], floor[b] = n_chain[b], p_min[b]
        (drafts, n_drafted), self.state = self._chain(
            self.model.weights, self.state, dict(batch=batch, chain_planes=planes, n_chain=wanted, p_min=floor), n_max=n
        )
        return [drafts[b, : n_drafted[b]].tolist() for b in range(len(rows))]

    def _warmup_calls(self) -> Iterator[tuple[int, int, dict, dict]]:
        """(B, T, inputs, static arguments) of every step shape of `self.shapes`: all-padding batches, which read
        the null plane and write nothing."""
        if self.shapes is None:
            return
        for B, T, R, final_only in self.shapes.grid():
            batch = pack_batch([], B=B, T=T, P=self.shapes.pages_per_row, R=R)
            verify_in, chain = self._step_inputs([], B, R)
            max_iterations = self.loops(T, final_only)
            for lookup in (False, True) if max_iterations > 1 and T <= self.lookup_width else (False,):
                loop = self._loop_inputs([], B, 1, lookup) if max_iterations > 1 else None
                inputs = dict(batch=batch, verify_in=verify_in, chain=chain, loop=loop,
                              backlog=self._backlog_inputs([], B, loop, 1),
                              replay=self._replay_inputs([], B, T, final_only, lookup))
                static = dict(final_only=final_only, n_max=self.mtp_chain_max, max_iterations=max_iterations,
                              draft_vocab=self.draft_vocab, rebuild_rows=self.rebuild_rows,
                              lookup_width=self.lookup_width if lookup else 0)  # fmt: skip
                yield B, T, inputs, static

    def warmup(self) -> Iterator[tuple[int, int]]:
        """Compile every step shape of `self.shapes` (unless `compile` has), running each once, one per iteration
        of the returned generator (which yields its (B, T)), with all-padding batches: they read the null plane and
        write nothing. Nothing is compiled until the generator runs; between two shapes the runtime may run real
        steps."""
        for B, T, inputs, static in self._warmup_calls():
            self.state = self._step(self.model.weights, self.state, inputs, **static)[1]
            yield B, T

    def compile(self, threads: int) -> int:
        """Compile every step shape `warmup` runs, `threads` at a time, without running any (the state is not
        touched); returns how many. The compilations of distinct shapes are independent, and XLA's compiler uses
        about one core per shape most of the time, so on a machine with many cores this takes a fraction of the
        time one after the other does; `warmup` then only runs each shape once. Calls of this runtime must not
        run meanwhile (they may compile the same shape twice)."""
        def compile_one(call: tuple[int, int, dict, dict]) -> None:
            _, _, inputs, static = call
            self._step.compile(self.model.weights, self.state, inputs, **static)

        calls = list(self._warmup_calls())
        with concurrent.futures.ThreadPoolExecutor(max(threads, 1), thread_name_prefix="gdnspec-compile") as pool:
            for _ in pool.map(compile_one, calls):  # re-raises a compilation's error here
                pass
        return len(calls)

    def calibrate(self, repeats: int = 5, spare_planes: Sequence[int] = ()) -> Calibration:
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
        the minimum of `repeats` runs each; call after `warmup` (these shapes compile; the rebuild compiles here).
        Also keeps the chain, rebuild, step and write costs for `chain_cost`, `rebuild_cost`, `step_costs` and
        `plane_write_cost`."""
        calibration = Calibration()
        if self.shapes is None:
            return calibration
        n = max(self.n_chain_max, 1)
        T_verify = self.shapes.tokens(1 + n)
        T_writes = self.shapes.tokens(1 + max(n, self.replay_tokens))  # the longest verify rows the engine runs

        def timed(B: int, T: int, n_chain: int, write_planes: Sequence[int] = ()) -> float:
            n_drafts = min(T - 1, self.shapes.logit_rows(T, False) - 1)  # any tokens before them are replayed ones
            writes = list(write_planes) + [-1] * (T - len(write_planes))
            rows = [StepRow(Row([1] * T, 0, [TRASH_PAGE], NULL_PLANE, writes, range(T - 1 - n_drafts, T)),
                            drafts=[1] * n_drafts, n_chain=n_chain) for _ in range(B)]  # fmt: skip
            start = time.perf_counter()
            self.step(rows)
            return time.perf_counter() - start

        def best(B: int, T: int, n_chain: int) -> float:
            return min(timed(B, T, n_chain) for _ in range(repeats))

        for B in sorted({self.shapes.batch(k) for k in range(1, self.shapes.max_rows + 1)}):
            calibration.step_seconds[B, 1] = best(B, 1, -1)
            calibration.step_seconds[B, T_verify] = verify = best(B, T_verify, -1)
            if self.mtp_chain_max:
                chained = best(B, T_verify, self.mtp_chain_max)
                calibration.chain_seconds[B] = max(chained - verify, 0.0) / self.mtp_chain_max
            if self.replay_tokens:  # what auto weighs: the rebuild, and the steps checkpoints lengthen
                calibration.rebuild_seconds[B] = self._time_rebuild(B, repeats)
                lengths = {self.shapes.tokens(k) for k in range(1 + self.replay_tokens, 3 * self.replay_tokens + 2)}
                for T in sorted(lengths - {T for b, T in calibration.step_seconds if b == B}):
                    calibration.longer_step_seconds[B, T] = best(B, T, -1)
            if spare_planes:
                every = [spare_planes[t % len(spare_planes)] for t in range(T_writes)]
                one = [-1] * (T_writes - 1) + [spare_planes[0]]
                runs = [(timed(B, T_writes, -1, one), timed(B, T_writes, -1, every)) for _ in range(2 * repeats)]
                calibration.plane_write_seconds[B] = plane_write_cost(*zip(*runs), B * (T_writes - 1))
        self.chain_seconds = dict(calibration.chain_seconds)
        self.rebuild_seconds = dict(calibration.rebuild_seconds)
        self.step_seconds = {**calibration.step_seconds, **calibration.longer_step_seconds}
        self.plane_write_seconds = dict(calibration.plane_write_seconds)
        return calibration

    def _batch_bucket(self, n_rows: int) -> int:
        """The batch size a step of n_rows rows is padded to, under which its calibrated costs are kept."""
        return self.shapes.batch(n_rows) if self.shapes is not None else n_rows

    def chain_cost(self, n_rows: int) -> float:
        """Seconds one chained draft adds to a step of n_rows rows (0 before `calibrate`)."""
        return self.chain_seconds.get(self._batch_bucket(n_rows), 0.0)

    def plane_write_cost(self, n_rows: int) -> float:
        """Seconds one more GDN state written into a plane adds to a step of n_rows rows (0 before `calibrate`)."""
        return self.plane_write_seconds.get(self._batch_bucket(n_rows), 0.0)

    def _time_rebuild(self, B: int, repeats: int) -> float:
        """The minimum over `repeats` runs (after one that compiles) of one pass of the replay rebuild in a step
        of B rows, every row of it applying all replay_tokens recorded tokens and writing nothing (targets -1)."""
        rows = rebuild_pass_rows(self.rebuild_rows, B)
        none, first = np.full((rows,), -1, np.int32), np.zeros((rows,), np.int32)
        n_keep = np.full((rows,), self.replay_tokens, np.int32)
        hidden = np.zeros((rows, self.model.cfg.n_embd), np.float32)
        seconds = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            self.state = self._rebuild(self.model.weights, state=self.state, source=first, target=none, slot=first,
                                       n_keep=n_keep, hidden=hidden)  # fmt: skip
            jax.block_until_ready(self.state.ssm)
            seconds = seconds if i == 0 else min(seconds, time.perf_counter() - start)
        return seconds

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

    def warmup_chain(self) -> Iterator[tuple[int, int]]:
        """Compile a draft model's chain and catch-up shapes, one (B, T) per iteration, as `warmup` does."""
        if self.shapes is None:
            return
        Bs = sorted({self.shapes.batch(k) for k in range(1, self.shapes.max_rows + 1)})
        Ts = sorted({self.shapes.tokens(k) for k in range(1, self.shapes.max_tokens + 1)})
        for B, T in itertools.product(Bs, Ts):
            batch = pack_batch([], B=B, T=T, P=self.shapes.pages_per_row, R=1)
            zeros = np.zeros((B,), np.int32)
            inputs = dict(batch=batch, chain_planes=np.full((B, self.n_chain_max), -1, np.int32), n_chain=zeros,
                          p_min=zeros.astype(np.float32))
            self.state = self._chain(self.model.weights, self.state, inputs, n_max=self.n_chain_max)[1]
            yield B, T
            if self.shapes.is_long(T):
                out, self.state = self.model.step(self.model.weights, batch=batch, state=self.state, final_only=True)
                jax.block_until_ready(out.logits)
                yield B, T
