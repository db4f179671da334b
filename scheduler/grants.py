"""What memory a planned step's rows get beyond their tokens: drafts and a rollback mode for the rows that reach
their newest token (`grant_drafts`, the memory rule's decision), and pages ahead for the tokens a device call's later
iterations may commit (`hold_lookahead`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .memory import DraftCandidate, MemoryManager, RollbackCosts, pages_for
from .sequence import RowSpec
from .types import DraftPlan, SeqId

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed for a sequence without a draft plan (see `Scheduler.schedule`)


def grant_drafts(specs: Sequence[RowSpec], budget: int, drafts: Mapping[SeqId, DraftPlan], *,
                 memory: MemoryManager, costs: RollbackCosts | None, max_model_len: int, reserve_planes: int) -> int:
    """Give rows that reach `last` their draft length and mode (and the pages and planes these need), keeping
    reserve_planes free; returns the token budget left."""
    candidates = []
    for spec in specs:
        seq, req = spec.seq, spec.seq.request
        reaches_last = spec.n_feed == seq.to_compute
        pending = spec.n_feed - 1
        plan = drafts.get(req.seq_id, DraftPlan(req.n_max, PRIOR_ACCEPTANCE))
        want = min(plan.n_draft, req.n_max, req.max_tokens - seq.n_generated - 1, max_model_len - len(seq.tokens) - 1)
        if not reaches_last or pending > req.n_max or want <= 0:
            continue
        spare = len(seq.planes) - (seq.live_plane != 0)
        candidates.append(DraftCandidate(seq.request.seq_id, want, req.rollback,
                                         kv_end=seq.n_computed + spec.n_feed, pages_owned=len(seq.pages),
                                         spare_planes=spare, n_pending=pending, alpha=plan.alpha,
                                         pending_max=req.n_max))  # fmt: skip
    if not candidates:
        return budget
    by_id = {spec.seq.request.seq_id: spec for spec in specs}
    for decision in memory.decide_drafts(candidates, budget, reserve_planes=reserve_planes, costs=costs):
        spec = by_id[decision.seq_id]
        spec.seq.pages += memory.take_pages(decision.new_pages)
        spec.seq.planes += memory.take_planes(decision.new_planes)
        spec.draft_max, spec.mode, spec.optimistic = decision.n_drafts, decision.mode, decision.optimistic
        budget -= decision.n_drafts
    return budget


def hold_lookahead(specs: Sequence[RowSpec], *, memory: MemoryManager, lookahead: int, max_model_len: int,
                   reserve_pages: int, n_running: int) -> None:
    """Best effort: pages for up to `lookahead` positions past each row's tokens, each row taking at most an equal
    share of the free pages beyond reserve_pages (so that holding them never keeps another of the n_running
    sequences from its share, and a lookahead larger than memory allows still holds what fits)."""
    limit = pages_for(max_model_len, memory.page_size)
    share = max(0, memory.free_pages - reserve_pages) // max(n_running, 1)
    for spec in specs:
        seq = spec.seq
        end = seq.n_computed + spec.n_feed + spec.draft_max + lookahead
        want = min(pages_for(end, memory.page_size), limit, len(seq.pages) + share) - len(seq.pages)
        if want > 0:
            seq.pages += memory.take_pages(want)
