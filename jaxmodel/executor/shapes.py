"""Which padded shapes a runtime compiles (`Shapes`), and how a step with prompt chunks splits into calls
(`chunk_calls`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..delta_rule import CPU_CHUNKED_MIN_TOKENS
from ..state import bucket


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
