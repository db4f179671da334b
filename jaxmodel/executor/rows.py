"""The rows a runtime step takes and what it gives back for each: a target row with its drafts, sampling and
on-device drafting (`StepRow`, `RowLoop`), and its committed tokens (`RowResult`, `Iteration`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..requests import Sampling
from ..state import Row


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
