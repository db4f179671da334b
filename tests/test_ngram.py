"""N-gram drafting: the definition's cases, and the incremental index against it."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from drafters.base import Drafter, DraftRequest
from drafters.ngram import NgramDrafter, NgramIndex, ngram_draft

EXAMPLE = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]


def propose_one(drafter, tokens, n_max, seq_id=0):
    return drafter.propose([DraftRequest(seq_id=seq_id, tokens=tokens, n_max=n_max)])[0]


def test_worked_example():
    assert ngram_draft(EXAMPLE, n_max=4, min_n=2, max_n=3) == [10, 11, 2, 3]
    assert ngram_draft(EXAMPLE, n_max=16, min_n=2, max_n=3) == [10, 11, 2, 3, 20, 21, 1, 2, 3]
    drafter = NgramDrafter(min_n=2, max_n=3)
    assert isinstance(drafter, Drafter)
    draft = propose_one(drafter, EXAMPLE, 4)
    assert draft.tokens == [10, 11, 2, 3] and draft.probs is None


def test_longest_n_wins_over_recency():
    # with max_n=2 only the 2-gram [2, 3] can match, and its most recent occurrence is 5..6
    assert ngram_draft(EXAMPLE, n_max=4, min_n=2, max_n=2) == [20, 21, 1, 2]


def test_most_recent_occurrence_wins():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]
    assert ngram_draft(tokens, n_max=1, min_n=2, max_n=4) == [3]
    assert propose_one(NgramDrafter(2, 4), tokens, 1).tokens == [3]


def test_no_match_gives_empty_draft():
    tokens = [1, 2, 3, 4, 5, 6]
    assert ngram_draft(tokens, n_max=8) == []
    assert propose_one(NgramDrafter(), tokens, 8).tokens == []
    # a match shorter than min_n does not count
    assert ngram_draft([5, 1, 9, 1], n_max=8, min_n=2) == []
    assert ngram_draft([5, 1, 9, 1], n_max=8, min_n=1) == [9, 1]


def test_truncated_at_n_max_and_context_end():
    tokens = [4, 5, 6, 7, 8, 9, 4, 5]
    assert ngram_draft(tokens, n_max=3) == [6, 7, 8]
    assert ngram_draft(tokens, n_max=64) == [6, 7, 8, 9, 4, 5]
    assert ngram_draft(tokens, n_max=0) == []
    drafter = NgramDrafter()
    assert propose_one(drafter, tokens, 3).tokens == [6, 7, 8]
    assert propose_one(drafter, tokens, 64).tokens == [6, 7, 8, 9, 4, 5]
    # a run of one token: the overlapping occurrence ends one before the last token
    assert ngram_draft([3, 3, 3, 3], n_max=8) == [3]


def test_batched_sequences_are_independent_and_released():
    drafter = NgramDrafter(min_n=2, max_n=3)
    a, b = EXAMPLE, [4, 5, 6, 7, 8, 9, 4, 5]
    drafts = drafter.propose([DraftRequest("a", a, 4), DraftRequest("b", b, 2), DraftRequest("c", [1], 4)])
    assert [d.tokens for d in drafts] == [[10, 11, 2, 3], [6, 7], []]
    drafter.release("a")
    assert "a" not in drafter.indexes and "b" in drafter.indexes


@settings(max_examples=150, deadline=None)
@given(
    stream=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    span=st.integers(0, 4),
    n_max=st.integers(0, 9),
)
def test_incremental_index_equals_brute_force(stream, steps, min_n, span, n_max):
    max_n = min_n + span
    drafter = NgramDrafter(min_n, max_n)
    length = 0
    for step in steps + [len(stream)]:
        length = min(len(stream), length + step)
        tokens = stream[:length]
        assert propose_one(drafter, tokens, n_max).tokens == ngram_draft(tokens, n_max, min_n, max_n)
        if length == len(stream):
            break


def test_shorter_context_under_same_id_rebuilds_the_index():
    drafter = NgramDrafter(min_n=2, max_n=3)
    propose_one(drafter, EXAMPLE, 4)
    fresh = [9, 9, 8, 7, 9, 9]
    assert propose_one(drafter, fresh, 4).tokens == ngram_draft(fresh, 4, 2, 3) == [8, 7, 9, 9]


def test_long_context_is_indexed_once_per_token():
    rng = random.Random(0)
    vocab = 50
    tokens = [rng.randrange(vocab) for _ in range(20_000)]
    drafter = NgramDrafter(min_n=2, max_n=8)
    n_steps = 0
    while len(tokens) < 50_000:
        draft = propose_one(drafter, tokens, 32)
        # half the steps accept a few drafted tokens, as decoding over repetitive text would
        accepted = draft.tokens[: rng.randrange(len(draft.tokens) + 1)] if draft.tokens else []
        tokens.extend(accepted + [rng.randrange(vocab)])
        n_steps += 1
    propose_one(drafter, tokens, 32)
    index = drafter.indexes[0]
    per_token = 8 - 2 + 1
    assert n_steps > 1000
    assert index.n_inserted <= per_token * len(tokens)
    assert index.n_inserted >= per_token * (len(tokens) - 8)
    assert index.indexed_len == len(tokens)
