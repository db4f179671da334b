"""A benchmark drafter with a chosen acceptance rate: it drafts the target's own greedy continuation (known in
advance from a plain run), each token corrupted with probability 1 - alpha. Not for serving.

Which positions of a reference are corrupted, and into what, is drawn once per reference (from the seed and the
reference's index), so a draft at a position is the same whenever it is proposed: every run over the same
references meets the same acceptances whatever its rollback mode, and two runs of a benchmark compare the same
work rather than two draws of it (a 4-sequence, 24-token run at alpha 0.9 took 7 to 10 device calls by the draw
alone, when each proposal drew afresh)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxmodel.requests import SeqId

from .base import Draft, Drafter, DraftRequest


def corruption(length: int, alpha: float, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[length] offsets to add (mod vocab) to a reference's tokens: 0 with probability alpha, else 1..vocab-1
    (a different token).

    >>> corruption(4, alpha=1.0, vocab=10, rng=np.random.default_rng(0)).tolist()
    [0, 0, 0, 0]
    >>> bool((corruption(1000, alpha=0.0, vocab=10, rng=np.random.default_rng(0)) > 0).all())
    True
    """
    corrupt = rng.random(length) >= alpha
    return np.where(corrupt, 1 + rng.integers(vocab - 1, size=length), 0)


def corrupted_continuation(reference: Sequence[int], offsets: Sequence[int], start: int, n: int,
                           vocab: int) -> list[int]:  # fmt: skip
    """reference[start : start + n], each token shifted by its offset (mod vocab).

    >>> corrupted_continuation([5, 6, 7, 8], [0, 0, 3, 0], 1, 2, vocab=10)
    [6, 0]
    """
    return [int((t + o) % vocab) for t, o in zip(reference[start : start + n], offsets[start : start + n])]


class SyntheticDrafter(Drafter):
    name = "synthetic"

    def __init__(self, references: Sequence[Sequence[int]], *, alpha: float, vocab: int, seed: int = 0):
        """references: full token sequences (prompt + the target's greedy continuation); a sequence drafts from
        the reference its committed tokens are a prefix of. The list may be replaced before the first request."""
        self.references = [list(r) for r in references]
        self.alpha = alpha
        self.vocab = vocab
        self.seed = seed
        self.assigned: dict[SeqId, tuple[list[int], np.ndarray]] = {}
        self._offsets: dict[tuple[int, int], np.ndarray] = {}  # (reference index, length) -> its corruption

    def _reference(self, r: DraftRequest) -> tuple[list[int], np.ndarray] | None:
        ref = self.assigned.get(r.seq_id)
        if ref is None:
            n = len(r.tokens)
            index = next((i for i, c in enumerate(self.references) if len(c) >= n and c[:n] == list(r.tokens)), None)
            if index is not None:
                reference = self.references[index]
                key = (index, len(reference))
                if key not in self._offsets:
                    rng = np.random.default_rng([self.seed, index])
                    self._offsets[key] = corruption(len(reference), self.alpha, self.vocab, rng)
                ref = self.assigned[r.seq_id] = (reference, self._offsets[key])
        return ref

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            ref = self._reference(r)
            tokens = [] if ref is None else corrupted_continuation(*ref, len(r.tokens), r.n_max, self.vocab)
            drafts.append(Draft(tokens=tokens))
        return drafts

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """Stateless beyond the reference it follows."""

    def release(self, seq_id: SeqId) -> None:
        self.assigned.pop(seq_id, None)
