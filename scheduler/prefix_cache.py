"""Computed prefixes kept for the requests that start with them: a conversation's next turn (which resends the whole
conversation), a shared system prompt, the same prompt again.

On a hybrid model the recurrent (GDN) state after a prefix cannot be rebuilt from KV pages: it has to have been
kept at that exact position. So the cache holds states at chosen positions, each a `CachedPrefix`: a plane with the
GDN state and the target's hidden state there (what the MTP head pairs with the next token), and a holder's share
of the KV pages of every position before it. A sequence keeps one at
- the end of its computed tokens when it finishes (stop or length): the next turn continues there;
- the end of the longest run of full pages (blocks) its prompt shares with a prompt seen before
  (`PrefixCache.shared_blocks`): the boundary where two prompts part, such as the end of a shared system prompt, so
  that the third and later requests starting with it find a state there;
- the start of its prompt's last chunk, when the prompt takes several (the same prompt again, a next turn whose
  template rewrote the last answer): its rows end there anyway, so keeping it costs no step.

A request starts from the longest entry its prompt extends (`match`): its first plane becomes a copy of the entry's,
it shares the entry's pages but the one holding the entry's last position, which it copies (the MTP head writes its
own KV at that position once the next token is known, and the next token is where prompts part), and it prefills
the rest. Shared pages hold positions every holder computed from the same tokens, which nobody writes again: a
token's KV and state are the same bits whatever step computed them (tests/test_step_invariance.py), so a prefix
taken from the cache decodes what a full prefill would.

Entries live inside the engine's budget: at most `max_planes` of them (planes set aside for the cache, so that
they never take the snapshot planes of the memory rule), dropped least recently used first when a new entry needs
a plane, and whenever running or admitted sequences need pages or planes (`scheduler.core.Scheduler`). A page
returns to the pool when its last holder, entry or sequence, gives it back.

Blocks are found by a chain of hashes (`chain_hashes`), each of a block's tokens and the hash before it; a match is
confirmed on the tokens themselves, so a collision costs a lookup, never a wrong state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = 0  # the chain's hash before its first block
SEEN_BLOCKS = 1 << 16  # block hashes of earlier prompts remembered (`shared_blocks`), least recently seen dropped


def chain_hashes(tokens: Sequence[int], page_size: int, known: Sequence[int] = ()) -> list[int]:
    """The chain hash after each full block of `tokens`: hashes[k] covers tokens[: (k + 1) * page_size]. `known`:
    a prefix of the answer already computed (the chain only grows with the tokens).

    >>> h = chain_hashes([5, 6, 7, 8, 9], 2)
    >>> len(h), h == chain_hashes([5, 6, 7, 8], 2), h[0] == chain_hashes([5, 6, 1], 2)[0]
    (2, True, True)
    """
    hashes = list(known)
    for k in range(len(hashes), len(tokens) // page_size):
        before = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash((before, tuple(tokens[k * page_size:(k + 1) * page_size]))))
    return hashes


@dataclass(frozen=True)
class CachedPrefix:
    """The state after `tokens`: GDN plane `plane`, and one holder's share of `pages`, the KV pages of positions
    0 .. len(tokens) - 1 in order."""

    tokens: tuple[int, ...]
    plane: int
    pages: tuple[int, ...]

    def pages_to_share(self, page_size: int) -> tuple[int, ...]:
        """The pages a sequence starting here shares: all but the one holding the last position (it gets a copy)."""
        return self.pages[: (len(self.tokens) - 1) // page_size]


class PrefixCache:
    """Cached prefixes, least recently used first, at most `max_planes` of them (one plane each); at most one entry
    per token sequence. Holds no memory itself: the scheduler takes and gives back what entries hold."""

    def __init__(self, page_size: int, max_planes: int) -> None:
        self.page_size = page_size
        self.max_planes = max_planes
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self._by_chain: dict[int, list[CachedPrefix]] = {}  # chain hash of an entry's full blocks -> entries
        self._chain_of: dict[tuple[int, ...], int] = {}  # an entry's tokens -> its key in _by_chain
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._entries

    @property
    def full(self) -> bool:
        """Whether a new entry has to replace one."""
        return len(self._entries) >= self.max_planes

    @property
    def pages(self) -> int:
        """Distinct pages the entries hold."""
        return len({page for entry in self._entries.values() for page in entry.pages})

    @property
    def planes(self) -> int:
        """Planes the entries hold."""
        return len(self._entries)

    def entries(self) -> list[CachedPrefix]:
        """Every entry, least recently used first."""
        return list(self._entries.values())

    def put(self, entry: CachedPrefix, hashes: Sequence[int]) -> None:
        """Keep `entry` (most recently used; its tokens not cached yet, and room for it: see `full`). hashes:
        `chain_hashes` of tokens that `entry.tokens` begin (the sequence's it was cut from)."""
        if entry.tokens in self._entries or self.full:
            raise ValueError("the prefix is cached already, or the cache is full")
        full = len(entry.tokens) // self.page_size
        key = hashes[full - 1] if full else ROOT_HASH
        self._entries[entry.tokens] = entry
        self._chain_of[entry.tokens] = key
        self._by_chain.setdefault(key, []).append(entry)

    def match(self, prompt: Sequence[int], hashes: Sequence[int], touch: bool = True) -> CachedPrefix | None:
        """The longest entry whose tokens begin `prompt` and leave at least one of its tokens to feed (the step
        needs the last one's logits), now most recently used unless not `touch`. hashes: `chain_hashes(prompt)`."""
        for k in range(min(len(hashes), (len(prompt) - 1) // self.page_size), -1, -1):
            best = None
            for entry in self._by_chain.get(hashes[k - 1] if k else ROOT_HASH, ()):
                n = len(entry.tokens)
                if n < len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == entry.tokens:
                    best = entry
            if best is not None:
                if touch:
                    self._entries.move_to_end(best.tokens)
                return best
        return None

    def remove(self, entry: CachedPrefix) -> None:
        """Drop `entry` (its memory is the caller's to give back)."""
        del self._entries[entry.tokens]
        key = self._chain_of.pop(entry.tokens)
        self._by_chain[key].remove(entry)
        if not self._by_chain[key]:
            del self._by_chain[key]

    def least_recent(self, keep: CachedPrefix | None = None) -> CachedPrefix | None:
        """The least recently used entry other than `keep` (None when there is none)."""
        return next((entry for entry in self._entries.values() if entry is not keep), None)

    def shared_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `chain_hashes`) an earlier prompt noted here began with too."""
        for k in range(len(hashes), 0, -1):
            if hashes[k - 1] in self._seen:
                return k
        return 0

    def note(self, hashes: Sequence[int]) -> None:
        """Remember a prompt's blocks, for `shared_blocks`."""
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > SEEN_BLOCKS:
            self._seen.popitem(last=False)
