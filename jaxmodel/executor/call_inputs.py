"""The numpy inputs of a runtime's device call, built from its rows (`jaxmodel.speculative` names their parts):
what to verify and chain, how rows loop, which rows flush or hold the MTP head's backlog, which replay."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..ngram_lookup import LOOKUP_MAX_N
from ..sampling import SamplingParams
from ..speculative import BacklogInputs, ChainInputs, LoopInputs, ReplayInputs, VerifyInputs
from ..state import NULL_PLANE
from .rows import StepRow
from .shapes import LOOP_MAX_TOKENS

if TYPE_CHECKING:
    from .runtime import Runtime

# The n-gram lookup on device searches this many of a row's latest tokens (plus what the call commits); the host's
# n-gram drafter searches the whole sequence, so only longer sequences may draft differently (never output).
LOOKUP_HISTORY = 512


def step_inputs(rows: Sequence[StepRow], B: int, R: int) -> tuple[VerifyInputs, ChainInputs]:
    """What each of B rows verifies (its drafts, sampling, where its committed tokens go) and chains next."""
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


def loop_inputs(runtime: Runtime, rows: Sequence[StepRow], B: int, iterations: int,
                lookup: bool = False) -> LoopInputs:
    """The loop's inputs. lookup: the call runs the n-gram lookup; without it, rows drafting by lookup run
    one iteration."""
    width = max(runtime.mtp_chain_max + 2, runtime.lookup_width + 1)
    loops, replay, optimistic = np.zeros((B,), bool), np.zeros((B,), bool), np.zeros((B,), bool)
    n_draft, budget, capacity = np.zeros((B,), np.int32), np.zeros((B,), np.int32), np.zeros((B,), np.int32)
    planes = np.full((B, width), -1, np.int32)
    lookup_min, lookup_max = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
    H = LOOKUP_HISTORY + LOOP_MAX_TOKENS + runtime.max_iterations * runtime.lookup_width if lookup else 1
    history, history_len = np.zeros((B, H), np.int32), np.zeros((B,), np.int32)
    for b, r in enumerate(rows):
        capacity[b] = len(r.row.pages) * runtime.page_size
        if r.loop is None or (r.loop.lookup and not lookup):
            continue
        if r.loop.replay and (b >= runtime.replay_slots or r.loop.n_draft > runtime.replay_tokens):
            raise ValueError(f"row {b}: replay iterations need a replay slot and at most "
                             f"{runtime.replay_tokens} drafts")  # fmt: skip
        if NULL_PLANE in r.loop.planes:
            raise ValueError(f"row {b}: its iterations would write the null plane (planes {r.loop.planes})")
        loops[b], replay[b], optimistic[b] = True, r.loop.replay, r.loop.optimistic
        n_draft[b], budget[b] = r.loop.n_draft, r.loop.budget
        planes[b, : len(r.loop.planes)] = r.loop.planes[:width]
        if r.loop.lookup:
            min_n, max_n = r.loop.lookup
            if not 1 <= min_n <= max_n <= LOOKUP_MAX_N or r.loop.n_draft > runtime.lookup_drafts:
                raise ValueError(f"row {b}: a lookup needs 1 <= min_n <= max_n <= {LOOKUP_MAX_N} and at most "
                                 f"{runtime.lookup_drafts} drafts, got {r.loop.lookup} and {r.loop.n_draft}")
            lookup_min[b], lookup_max[b] = min_n, max_n
            tail = np.asarray(r.loop.history[-LOOKUP_HISTORY:], np.int32)
            history[b, : len(tail)], history_len[b] = tail, len(tail)
    return LoopInputs(loops, replay, optimistic, n_draft, planes, budget, capacity, runtime.stop_ids,
                      np.int32(iterations), lookup_min, lookup_max, history, history_len)


def backlog_inputs(runtime: Runtime, rows: Sequence[StepRow], B: int, loop: LoopInputs | None,
                    width: int) -> BacklogInputs | None:
    """Which rows flush and which hold (`BacklogInputs`), None without a backlog. A row holds where its head only
    catches up (n_chain 0 and no MTP chain in its later iterations); it flushes where it holds something and
    either chains or its slot might not have room for every token the call may commit for it: its fed tokens,
    then its bonus and up to its drafts (at most width - 1) an iteration after the first."""
    if runtime.state.backlog is None:
        return None
    slot, held = np.full((B,), -1, np.int32), np.zeros((B,), np.int32)
    flush, hold = np.zeros((B,), bool), np.zeros((B,), bool)
    capacity = runtime.state.backlog.capacity
    for b, r in enumerate(rows):
        if r.backlog_slot < 0 or r.n_chain < 0:
            continue
        slot[b], held[b] = r.backlog_slot, runtime.backlog_held[r.backlog_slot]
        later = int(loop.n_iterations) - 1 if loop is not None and loop.loops[b] else 0
        chains_later = later > 0 and loop.lookup_min[b] == 0 and loop.n_draft[b] > 0
        most = len(r.row.tokens) + (later * (1 + min(int(loop.n_draft[b]), width - 1)) if later else 0)
        hold[b] = r.n_chain == 0 and not chains_later
        flush[b] = held[b] > 0 and (not hold[b] or held[b] + most > capacity)
    return BacklogInputs(slot, held, flush, hold)


def replay_inputs(runtime: Runtime, rows: Sequence[StepRow], B: int, T: int, final_only: bool,
                   lookup: bool = False) -> ReplayInputs | None:
    """The replay rows' planes. None where no row can replay, so that no rebuild compiles there: without a
    replay pool, and in shapes that carry no draft (one token per row, prefill-only steps), unless a lookup
    call's later iterations carry drafts."""
    if not runtime.replay_tokens or (T == 1 and not lookup) or final_only:
        if any(r.replay for r in rows):
            raise ValueError("a replay row needs a runtime with a replay pool and a step shape with drafts")
        return None
    plane = np.full((B,), -1, np.int32)
    optimistic = np.zeros((B,), bool)
    for b, r in enumerate(rows):
        if r.replay:
            if b >= runtime.replay_slots or len(r.drafts) > runtime.replay_tokens:
                raise ValueError(f"row {b}: replay needs a replay slot and at most {runtime.replay_tokens} "
                                 f"drafts")  # fmt: skip
            if r.optimistic and r.row.logit_rows[0] != 0:
                raise ValueError(f"row {b}: optimistic replay needs `last` to be the row's first token")
            plane[b] = r.row.write_planes[-1 if r.optimistic else r.row.logit_rows[0]]
            optimistic[b] = r.optimistic
    return ReplayInputs(plane, optimistic)
