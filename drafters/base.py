"""The drafter protocol: what the scheduler asks of every drafter, and what it gets back.

A drafter proposes up to `n_max` tokens that continue a sequence; the target model then verifies them
(`jaxmodel.sampling.verify`). Proposals are batched: one `propose` call serves many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

SeqId = Hashable


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's request for a draft.

    tokens: the sequence's committed tokens so far (prompt + output); the newest, `tokens[-1]`, is the token the
        target feeds next (`last`). Committed tokens only ever grow for a given `seq_id`, so drafters may index
        them incrementally. The sequence is passed by reference, never copied.
    n_max: the longest draft wanted this step (0 asks for nothing).
    p_min: drafters that score their tokens stop before a token whose draft probability is below it.
    """

    seq_id: SeqId
    tokens: Sequence[int]
    n_max: int
    p_min: float = 0.0


@dataclass(frozen=True)
class Draft:
    """A proposal: `tokens` continue the request's sequence after `last`; possibly empty.

    probs is None for a deterministic draft (n-gram lookup, or a model draft taken by argmax): verification then
    treats the draft distribution as one-hot. A drafter that *samples* its tokens must return the distributions it
    sampled them from, float32 [len(tokens), V], so that rejection sampling keeps the target's distribution.
    """

    tokens: list[int]
    probs: np.ndarray | None = None  # [len(tokens), V] float32

    def __post_init__(self):
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"probs has {self.probs.shape[0]} rows for {len(self.tokens)} draft tokens")


EMPTY_DRAFT = Draft(tokens=[])


@runtime_checkable
class Drafter(Protocol):
    """What the scheduler needs from a drafter; drafters needing engine data take it through their own methods."""

    name: str

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, in order; an empty draft when there is nothing worth proposing."""
        ...

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """After verification: `accepted` drafts were accepted and `committed_tokens` (accepted + 1) committed."""
        ...

    def release(self, seq_id: SeqId) -> None:
        """Forget a finished or aborted sequence."""
        ...
