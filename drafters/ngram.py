"""N-gram (prompt lookup) drafting over a sequence's own tokens, prompt and output alike.

The draft copies what followed the most recent earlier occurrence of the sequence's longest matching suffix
(vLLM's n-gram proposer is the model). `ngram_draft` is the definition; `NgramIndex` computes the same answer
incrementally, and `NgramDrafter` keeps one index per sequence behind the `Drafter` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest
from jaxmodel.requests import SeqId
from jaxmodel.ngram_lookup import LOOKUP_MAX_N


def ngram_draft(tokens: Sequence[int], n_max: int, min_n: int = 2, max_n: int = 8) -> list[int]:
    """The draft for `tokens`: a plain scan, the definition that `NgramIndex` reproduces incrementally.

    For n from max_n down to min_n, the pattern is the last n tokens. The first n with an earlier occurrence wins
    (longest match first); among its occurrences the most recent one wins. An occurrence is earlier when it ends
    before the last token (it may overlap the pattern). The draft is what followed it, up to n_max tokens and up to
    the end of the context. No occurrence for any n: an empty draft.

    Worked example, min_n=2, max_n=3, n_max=4:

        position  0  1  2  3   4   5  6  7   8   9  10 11
        tokens    1  2  3  10  11  2  3  20  21  1  2  3

    n=3: the pattern [1, 2, 3] occurred at 0..2, so the draft is tokens[3:7] = [10, 11, 2, 3]. The 2-gram [2, 3]
    occurred more recently (5..6, which would give [20, 21, 1, 2]), but the longer match wins. With n_max=16 the
    draft stops at the end of the context: [10, 11, 2, 3, 20, 21, 1, 2, 3].
    """
    length = len(tokens)
    if n_max <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = list(tokens[length - n :])
        for end in range(length - 1, n - 1, -1):  # `end` is where the occurrence stops, exclusive
            if list(tokens[end - n : end]) == pattern:
                return list(tokens[end : end + n_max])
    return []


@dataclass
class NgramIndex:
    """The n-grams of one sequence, each mapped to where its most recent occurrence ends (exclusive).

    It indexes the n-grams that end before the sequence's last token, so a lookup of the sequence's own suffix
    finds an earlier occurrence. Each token is indexed once, on the `update` after it stops being the last one:
    work per token is (max_n - min_n + 1) dictionary writes, whatever the context length. `n_inserted` counts them.
    """

    min_n: int = 2
    max_n: int = 8
    latest_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_len: int = 0  # tokens[:indexed_len - 1] hold every indexed n-gram; the last token is still the pattern
    n_inserted: int = 0

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that `tokens` (an extension of what was seen before) completed since the last call."""
        if len(tokens) < self.indexed_len:  # not an extension: a new sequence under an old id
            self.latest_end.clear()
            self.indexed_len = 0
        first_end, stop = max(self.indexed_len, 1), len(tokens)  # new n-grams end (exclusive) in [first_end, stop)
        for n in range(self.min_n, self.max_n + 1):
            first = max(first_end, n)
            if first >= stop:
                continue
            window = tokens[first - n : stop - 1]
            grams = zip(*(window[i:] for i in range(n)))  # the n-grams ending at first, first + 1, ..., stop - 1
            self.latest_end.update(zip(grams, range(first, stop)))  # later (more recent) ends overwrite
            self.n_inserted += stop - first
        self.indexed_len = max(self.indexed_len, len(tokens))

    def draft(self, tokens: Sequence[int], n_max: int) -> list[int]:
        """`ngram_draft(tokens, n_max, min_n, max_n)` from the index; `update(tokens)` must have run."""
        length = len(tokens)
        if n_max <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.latest_end.get(tuple(tokens[length - n :]))
            if end is not None:
                return list(tokens[end : end + n_max])
        return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafter: one incremental `NgramIndex` per sequence, dropped by `release`."""

    def __init__(self, min_n: int = 2, max_n: int = 8, name: str = "ngram"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.name = name
        self.min_n = min_n
        self.max_n = max_n
        self.indexes: dict[SeqId, NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One deterministic draft per request (probs None), empty when no suffix of length >= min_n recurs."""
        drafts = []
        for request in requests:
            index = self.indexes.get(request.seq_id)
            if index is None:
                index = self.indexes[request.seq_id] = NgramIndex(self.min_n, self.max_n)
            index.update(request.tokens)
            tokens = index.draft(request.tokens, request.n_max)
            drafts.append(Draft(tokens=tokens) if tokens else EMPTY_DRAFT)
        return drafts

    def device_lookup(self) -> tuple[int, int] | None:
        """The same lookup runs on device for patterns of up to `LOOKUP_MAX_N` tokens."""
        return (self.min_n, self.max_n) if self.max_n <= LOOKUP_MAX_N else None

    def observe(self, seq_id: SeqId, accepted: int, committed_tokens: Sequence[int]) -> None:
        """Nothing to learn: the next `propose` indexes the committed tokens from its request."""

    def release(self, seq_id: SeqId) -> None:
        """Drop the sequence's index."""
        self.indexes.pop(seq_id, None)
