"""The device executor: owns a model's state pools, pads host rows into a few compiled shapes, and runs one jitted
call per step (`jaxmodel.speculative`): the target's forward, verification and the next MTP drafts, or a draft
model's whole chain. Inputs are built with numpy and travel packed in one buffer, as do the small arrays the host
reads back (`host_io`). The rows it takes are `rows.StepRow`; the shapes it compiles, `shapes.Shapes`; the call's
inputs are built in `call_inputs`, and what its steps cost is measured in `costs`.

Synchronous and single-threaded: the engine calls it from one worker thread at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from ..config import ModelConfig
from ..model import Model, rebuild
from ..speculative import draft_chain, later_width, speculative_step
from ..sharding import constrain_state, keeping_state_sharding
from ..state import Row, StepOutput, bucket, bytes_per_plane, copy_state, pack_batch
from .call_inputs import backlog_inputs, loop_inputs, replay_inputs, step_inputs
from .costs import StepCosts
from .host_io import PackedCall
from .rows import Iteration, RowResult, StepRow
from .shapes import LOOP_MAX_TOKENS, Shapes, chunk_calls

# On CPU the replay rebuild goes one row per pass where a row's GDN state is at least this large: moving the
# states through memory then dominates, so a pass costs about what its rows do, and rebuilding only the wrong rows
# pays. Well below it a pass costs mostly its fixed launch overhead, and one pass of all rows is cheaper
# (docs/design.md "Rollback", with the measurements).
PER_ROW_REBUILD_MIN_BYTES = 4 << 20

_copy_state = jax.jit(copy_state, donate_argnames="state")


@functools.lru_cache(maxsize=None)
def _state_copier(tp):
    """`copy_state` jitted; for a sharded model (tp, a `sharding.TensorParallel`) returning the state placed as it
    took it."""
    if tp is None:
        return _copy_state
    return jax.jit(lambda state, planes, pages: constrain_state(copy_state(state, planes, pages), tp),
                   donate_argnames="state")
COPY_PAIRS_MIN = 4  # `Runtime.copy` pads its pairs to a power of two, at least this many


@functools.lru_cache(maxsize=None)
def _compiled(cfg: ModelConfig):
    """The jitted step, chain and replay rebuild (timed alone by `calibrate`) of a config, shared by every runtime
    of it (so their compilations are too). A sharded model's calls return the state placed as they took it
    (`sharding.keeping_state_sharding`)."""
    tp = cfg.tensor_parallel
    step = PackedCall(keeping_state_sharding(functools.partial(speculative_step, cfg=cfg), tp),
                      static_argnames=("final_only", "n_max", "max_iterations", "draft_vocab", "rebuild_rows",
                                       "lookup_width"), name=f"speculative_step {cfg!r}")

    def chain(weights, state, **inputs):
        drafts, n_drafted, state = draft_chain(weights, cfg, state=state, **inputs)
        return (drafts, n_drafted), state

    def rebuilt(weights, state, *args, **kwargs):
        state = rebuild(weights, cfg, state, *args, **kwargs)
        return state if tp is None else constrain_state(state, tp)

    chain_call = PackedCall(keeping_state_sharding(chain, tp), static_argnames=("n_max",), name=f"draft_chain {cfg!r}")
    return step, chain_call, jax.jit(rebuilt, donate_argnames="state")


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
        self._executables: dict = {}  # this runtime's stored executables (`executables`), by shape
        self.costs = StepCosts(shapes, rebuild_rows)  # measured by `costs.calibrate`

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

    def copy(self, planes: Sequence[tuple[int, int]], pages: Sequence[tuple[int, int]]) -> None:
        """Copy planes and pages, (source, target) pairs (`jaxmodel.state.copy_state`); every source is read before
        any target is written. Padded to a few compiled counts."""
        n = bucket(max(len(planes), len(pages)), minimum=COPY_PAIRS_MIN)

        def padded(pairs: Sequence[tuple[int, int]]) -> np.ndarray:
            out = np.zeros((n, 2), np.int32)
            if pairs:
                out[: len(pairs)] = pairs
            return out

        self.state = _state_copier(self.model.cfg.tensor_parallel)(self.state, padded(planes), padded(pages))

    def _copy_counts(self) -> list[int]:
        """The padded pair counts `copy` compiles for: up to two plane copies per row (one into a sequence starting
        from a cached prefix, one out of a sequence keeping its state)."""
        most = bucket(2 * (self.shapes.max_rows if self.shapes is not None else 1), minimum=COPY_PAIRS_MIN)
        return [n for n in (COPY_PAIRS_MIN * 2**k for k in range(32)) if n <= most]

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
        verify_in, chain = step_inputs(rows, B, batch.logit_rows.shape[1])
        max_iterations = self.loops(T, final_only)
        # Lookup rows loop only in calls whose first iteration fits the lookup shapes; elsewhere they run one.
        lookup = (max_iterations > 1 and T <= self.lookup_width
                  and any(r.loop is not None and r.loop.lookup for r in rows))  # fmt: skip
        loop = loop_inputs(self, rows, B, min(iterations, max_iterations), lookup) if max_iterations > 1 else None
        width = later_width(T, self.mtp_chain_max, self.lookup_width if lookup else 0)
        backlog = backlog_inputs(self, rows, B, loop, width)
        inputs = dict(batch=batch, verify_in=verify_in, chain=chain, loop=loop, backlog=backlog,
                      replay=replay_inputs(self, rows, B, T, final_only, lookup))
        (out, more), self.state = self._step(
            self.model.weights, self.state, inputs, held=self._executables, final_only=final_only,
            n_max=self.mtp_chain_max, max_iterations=max_iterations, draft_vocab=self.draft_vocab,
            rebuild_rows=self.rebuild_rows, lookup_width=self.lookup_width if lookup else 0,
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
            self.model.weights, self.state, dict(batch=batch, chain_planes=planes, n_chain=wanted, p_min=floor),
            held=self._executables, n_max=n)
        return [drafts[b, : n_drafted[b]].tolist() for b in range(len(rows))]

    def _warmup_calls(self) -> Iterator[tuple[int, int, dict, dict]]:
        """(B, T, inputs, static arguments) of every step shape of `self.shapes`: all-padding batches, which read
        the null plane and write nothing."""
        if self.shapes is None:
            return
        for B, T, R, final_only in self.shapes.grid():
            batch = pack_batch([], B=B, T=T, P=self.shapes.pages_per_row, R=R)
            verify_in, chain = step_inputs([], B, R)
            max_iterations = self.loops(T, final_only)
            for lookup in (False, True) if max_iterations > 1 and T <= self.lookup_width else (False,):
                loop = loop_inputs(self, [], B, 1, lookup) if max_iterations > 1 else None
                inputs = dict(batch=batch, verify_in=verify_in, chain=chain, loop=loop,
                              backlog=backlog_inputs(self, [], B, loop, 1),
                              replay=replay_inputs(self, [], B, T, final_only, lookup))
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
            self.state = self._step(self.model.weights, self.state, inputs, held=self._executables, **static)[1]
            yield B, T

    def warmup_copies(self) -> Iterator[int]:
        """Compile `copy` for every pair count it pads to, one per item (the count), copying the null plane and the
        trash page onto themselves."""
        for n in self._copy_counts():
            self.copy([(0, 0)] * n, [])
            yield n

    def compile(self, threads: int) -> int:
        """Compile every step shape `warmup` runs, `threads` at a time, without running any (the state is not
        touched); returns how many. The compilations of distinct shapes are independent, and XLA's compiler uses
        about one core per shape most of the time, so on a machine with many cores this takes a fraction of the
        time one after the other does; `warmup` then only runs each shape once. Calls of this runtime must not
        run meanwhile (they may compile the same shape twice)."""
        def compile_one(call: tuple[int, int, dict, dict]) -> None:
            _, _, inputs, static = call
            self._step.compile(self.model.weights, self.state, inputs, held=self._executables, **static)

        calls = list(self._warmup_calls())
        with concurrent.futures.ThreadPoolExecutor(max(threads, 1), thread_name_prefix="gdnspec-compile") as pool:
            for _ in pool.map(compile_one, calls):  # re-raises a compilation's error here
                pass
        return len(calls)


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
            self.state = self._chain(self.model.weights, self.state, inputs, held=self._executables,
                                     n_max=self.n_chain_max)[1]
            yield B, T
            if self.shapes.is_long(T):
                out, self.state = self.model.step(self.model.weights, batch=batch, state=self.state, final_only=True)
                jax.block_until_ready(out.logits)
                yield B, T
