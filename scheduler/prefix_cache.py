"""What finished sequences computed, kept for the requests that continue them: a conversation's next turn resends
the whole conversation, whose tokens up to the last answer the previous turn's sequence already computed.

When a sequence finishes (stop or length), its computed tokens' state stays in memory as a `CachedPrefix`: the live
plane (the GDN state after them, and the target's hidden state the MTP head reads) and the KV pages of their
positions. A request whose prompt starts with those tokens and goes on past them takes the entry over (`take`): its
sequence starts with them computed, reading that plane and owning those pages, and prefills only the rest. An entry
serves one sequence, which then owns it, so nothing is shared and nothing is copied; the sequence caches its own
state when it finishes in turn. Entries hold memory inside the engine's budget and are evicted least recently cached
first whenever running or admitted sequences need their pages or planes (`Scheduler`).

Taking over a finished sequence's state is exact: a token's KV, state and hidden state are the same bits whatever
step computed it (tests/test_step_invariance.py), so the continuation decodes what a full prefill would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedPrefix:
    """The state after `tokens`: GDN plane `plane`, KV of positions 0 .. len(tokens)-1 in `pages` (in order)."""

    tokens: tuple[int, ...]
    plane: int
    pages: tuple[int, ...]


class PrefixCache:
    """Finished sequences' computed prefixes, oldest first; at most one entry per token sequence."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pages(self) -> int:
        """Pages the entries hold."""
        return sum(len(e.pages) for e in self._entries.values())

    @property
    def planes(self) -> int:
        """Planes the entries hold."""
        return len(self._entries)

    def put(self, entry: CachedPrefix) -> CachedPrefix | None:
        """Keep `entry`, newest; returns the entry it replaces (the same tokens cached before), whose memory goes
        back to the pool."""
        old = self._entries.pop(entry.tokens, None)
        self._entries[entry.tokens] = entry
        return old

    def match(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The longest entry whose tokens begin `prompt` and leave at least one of its tokens to feed (the step
        needs the last one's logits)."""
        best = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == entry.tokens:
                best = entry
        return best

    def take(self, entry: CachedPrefix) -> None:
        """Hand `entry` over to the sequence that continues it."""
        del self._entries[entry.tokens]

    def evict(self, keep: CachedPrefix | None = None) -> CachedPrefix | None:
        """Remove and return the oldest entry other than `keep` (None when there is none)."""
        for tokens, entry in self._entries.items():
            if entry is not keep:
                del self._entries[tokens]
                return entry
        return None
