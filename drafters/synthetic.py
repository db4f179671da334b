"""A benchmark drafter with a chosen acceptance rate: it drafts the target's own greedy continuation (known in
advance from a plain run), corrupting each token with probability 1 - alpha. Not for serving."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import Draft, Drafter, DraftRequest, SeqId


def corrupted_continuation(reference: Sequence[int], start: int, n: int, alpha: float, rng, vocab: int) -> list[int]:
    """reference[start : start + n], each token replaced by a different one with probability 1 - alpha.

    >>> corrupted_continuation([5, 6, 7, 8], 1, 2, alpha=1.0, rng=np.random.default_rng(0), vocab=10)
    [6, 7]
    """
    out = []
    for token in reference[start : start + n]:
        if rng.random() >= alpha:
            token = (token + 1 + int(rng.integers(vocab - 1))) % vocab
        out.append(int(token))
    return out


class SyntheticDrafter(Drafter):
    name = "synthetic"

    def __init__(self, references: Sequence[Sequence[int]], *, alpha: float, vocab: int, seed: int = 0):
        """references: full token sequences (prompt + the target's greedy continuation); a sequence drafts from
        the reference its committed tokens are a prefix of."""
        self.references = [list(r) for r in references]
        self.alpha = alpha
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.assigned: dict[SeqId, list[int]] = {}

    def _reference(self, r: DraftRequest) -> list[int] | None:
        ref = self.assigned.get(r.seq_id)
        if ref is None:
            n = len(r.tokens)
            ref = next((c for c in self.references if len(c) >= n and c[:n] == list(r.tokens)), None)
            if ref is not None:
                self.assigned[r.seq_id] = ref
        return ref

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            ref = self._reference(r)
            tokens = [] if ref is None else corrupted_continuation(ref, len(r.tokens), r.n_max, self.alpha, self.rng, self.vocab)
            drafts.append(Draft(tokens=tokens))
        return drafts

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """Stateless beyond the reference it follows."""

    def release(self, seq_id: SeqId) -> None:
        self.assigned.pop(seq_id, None)
