"""The device side of a step: owns the target's state pools, pads rows into bucketed batches, runs the jitted
forward (and MTP) steps and the verification rule, and hands back host results.

Synchronous and single-threaded: the engine calls it from one worker thread at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxmodel.delta_rule import CPU_CHUNKED_MIN_TOKENS
from jaxmodel.model import Model
from jaxmodel.sampling import SamplingParams, verify
from jaxmodel.state import Row, StepOutput, bucket, pack_batch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass(frozen=True)
class VerifyRow:
    """A row of a step plus what verification needs. `row.logit_rows` must be the indices of `last` and of each
    draft among the fed tokens (empty: nothing is sampled, e.g. an intermediate prompt chunk)."""

    row: Row
    drafts: Sequence[int] = ()
    draft_probs: np.ndarray | None = None  # [len(drafts), V]
    sampling: Sampling = field(default_factory=Sampling)


@dataclass(frozen=True)
class RowResult:
    n_accepted: int
    committed: list[int]  # accepted drafts + one token from the target; empty when nothing was sampled
    hidden: np.ndarray  # [n_fed, E] the target's post-norm hidden of every fed token


@dataclass(frozen=True)
class Shapes:
    """Which padded shapes a runner compiles, kept few because each is a compile.

    Rows and tokens per row are bucketed by powers of 4 (on CPU a matmul of 2 rows costs about what 4 do); every
    row has the page table of a full-length sequence, so the page count adds no shapes. Logits come for every row
    of a short step (T <= 16: verification wants them all), and for long steps (prompt chunks) either for one row
    (a prefill-only step, which also takes the chunked GDN form) or for as many as a draft can need (prompt chunks
    batched with decoding sequences).
    """

    max_rows: int  # sequences per step
    max_tokens: int  # tokens per row (a prompt chunk, or replays + last + drafts)
    max_logit_rows: int  # 1 + the longest draft
    pages_per_row: int

    def batch(self, n_rows: int) -> int:
        return min(bucket(n_rows, base=4), bucket(self.max_rows, base=4))

    def tokens(self, n_tokens: int) -> int:
        return min(bucket(n_tokens, base=4), self.max_tokens)

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


class Runner:
    """Target model + device state. `n_pages`/`n_planes` include the trash page and the null plane."""

    def __init__(self, model: Model, *, n_pages: int, n_planes: int, page_size: int = 16, shapes: Shapes | None = None):
        self.model = model
        self.page_size = page_size
        self.shapes = shapes
        self.state = model.new_state(n_pages=n_pages, n_planes=n_planes, page_size=page_size)
        self._verify = jax.jit(verify)

    def _pack(self, rows: Sequence[Row], prefill_only: bool):
        """The padded batch, and whether it runs as final-only (long prefill-only steps)."""
        if self.shapes is None:
            return pack_batch(rows), prefill_only
        T = self.shapes.tokens(max(len(r.tokens) for r in rows))
        final_only = prefill_only and self.shapes.is_long(T)
        R = self.shapes.logit_rows(T, final_only)
        return pack_batch(rows, B=self.shapes.batch(len(rows)), T=T, P=self.shapes.pages_per_row, R=R), final_only

    def forward(self, rows: Sequence[Row], *, prefill_only: bool = False) -> StepOutput:
        """prefill_only: each row writes at most its final state and wants at most its last token's logits."""
        batch, final_only = self._pack(rows, prefill_only)
        out, self.state = self.model.step(self.model.weights, batch=batch, state=self.state, final_only=final_only)
        return out

    def warmup(self, verify: bool = True) -> int:
        """Compile every step shape of `self.shapes` (the MTP step's and, with `verify`, the verification's too)
        with all-padding batches, which read the null plane and write nothing. Returns how many shapes compiled."""
        if self.shapes is None:
            return 0
        n = 0
        for B, T, R, final_only in self.shapes.grid():
            batch = pack_batch([], B=B, T=T, P=self.shapes.pages_per_row, R=R)
            out, self.state = self.model.step(self.model.weights, batch=batch, state=self.state, final_only=final_only)
            n += 1
            if verify:
                params = SamplingParams.of(np.zeros(B), batch=B)
                zeros = np.zeros((B,), np.int32)
                self._verify(out.logits, np.zeros((B, R - 1), np.int32), None, zeros, params, zeros)
            if self.model.has_mtp and not final_only:
                hidden = np.zeros((B, T, self.model.cfg.n_embd), np.float32)
                out, self.state = self.model.mtp_step(self.model.weights, batch=batch, hidden_in=hidden, state=self.state)
                n += 1
        jax.block_until_ready(out.logits)
        return n

    def forward_mtp(self, rows: Sequence[Row], hidden_in: Sequence[np.ndarray]) -> StepOutput:
        """MTP block over rows; hidden_in[b] is [len(rows[b].tokens), E]: h_{p-1} for each fed token."""
        batch, _ = self._pack(rows, prefill_only=False)
        B, T = batch.tokens.shape
        h = np.zeros((B, T, self.model.cfg.n_embd), np.float32)
        for b, rows_hidden in enumerate(hidden_in):
            h[b, : len(rows_hidden)] = rows_hidden
        out, self.state = self.model.mtp_step(self.model.weights, batch=batch, hidden_in=h, state=self.state)
        return out

    def step(self, rows: Sequence[VerifyRow]) -> list[RowResult]:
        """One target step over all rows, then verification of every row that samples."""
        prefill_only = all(
            list(r.row.logit_rows) in ([], [len(r.row.tokens) - 1]) and all(w < 0 for w in r.row.write_planes[:-1])
            for r in rows
        )
        out = self.forward([r.row for r in rows], prefill_only=prefill_only)
        B, R, V = out.logits.shape
        drafts = np.zeros((B, R - 1), np.int32)
        n_drafts = np.zeros((B,), np.int32)
        positions = np.zeros((B,), np.int32)
        soft = any(r.draft_probs is not None for r in rows)
        probs = np.zeros((B, R - 1, V), np.float32) if soft else None
        for b, r in enumerate(rows):
            d = len(r.drafts)
            drafts[b, :d] = r.drafts
            n_drafts[b] = d
            if r.row.logit_rows:
                positions[b] = r.row.start + r.row.logit_rows[0] + 1
            if r.draft_probs is not None:
                probs[b, :d] = r.draft_probs
            elif soft:  # deterministic drafts beside sampled ones are one-hot
                probs[b, np.arange(d), list(r.drafts)] = 1.0
        pad = B - len(rows)
        params = SamplingParams.of(
            [r.sampling.temperature for r in rows] + [0.0] * pad,
            [r.sampling.top_p for r in rows] + [1.0] * pad,
            [r.sampling.top_k for r in rows] + [0] * pad,
            [r.sampling.seed for r in rows] + [0] * pad,
        )
        n_accepted, tokens = self._verify(out.logits, drafts, probs, n_drafts, params, positions)
        n_accepted, tokens, hidden = np.asarray(n_accepted), np.asarray(tokens), np.asarray(out.hidden)
        results = []
        for b, r in enumerate(rows):
            n_fed = len(r.row.tokens)
            if r.row.logit_rows:
                a = int(n_accepted[b])
                results.append(RowResult(a, [int(t) for t in tokens[b, : a + 1]], hidden[b, :n_fed]))
            else:
                results.append(RowResult(0, [], hidden[b, :n_fed]))
        return results
