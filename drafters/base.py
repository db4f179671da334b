"""The drafter protocol: what the scheduler asks of every drafter, and what it gets back.

A drafter proposes up to `n_max` tokens that continue a sequence; the target model then verifies them
(`jaxmodel.sampling.verify`). Proposals are batched: one `propose` call serves many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxmodel.requests import SeqId
from jaxmodel.executor import RowResult


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
    """What the engine needs from a drafter. The last four methods are hooks with no-op defaults (a drafter class
    that subclasses `Drafter` inherits them), so the engine drives every drafter alike and names none:

    - `warmup` compiles the drafter's device calls before serving;
    - `device_chain` lets a drafter whose model is part of the target (the MTP head) have the target's step
      compute the next step's drafts on device, where the hidden states already are;
    - `device_lookup` lets an n-gram drafter's lookup run on device too, between iterations of one call;
    - `after_step` hands each drafter of a sequence the target step's result for it (committed tokens, and the
      drafts chained on device).
    """

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

    def warmup(self) -> Iterator[object]:
        """Compile whatever the drafter runs on a device, one shape per item of the returned iterator (nothing
        compiles until it is consumed, so the engine can serve between two shapes)."""
        return iter(())

    def device_chain(self, seq_id: SeqId, n_next: int) -> int:
        """How many drafts the target's step should chain on device with the MTP head for this sequence's next
        step, given that the policy may ask for up to n_next: -1 for none (host-side drafters), 0 for a catch-up
        only (the head must see every committed token)."""
        return -1

    def device_lookup(self) -> tuple[int, int] | None:
        """(min_n, max_n) when the drafter's proposal is the n-gram lookup (`drafters.ngram.ngram_draft`), which the
        target's device call then runs itself between the iterations it makes without the host
        (`jaxmodel.ngram_lookup`); None: the drafter proposes on the host only."""
        return None

    def after_step(self, seq_id: SeqId, n_tokens: int, result: RowResult) -> None:
        """The target step committed `result.committed` for the sequence, which now holds n_tokens tokens;
        `result.next_drafts` are the drafts chained on device for its next step."""
