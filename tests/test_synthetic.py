"""The benchmark's synthetic drafter: a fixed acceptance pattern per reference, so modes compare the same work."""

import doctest

import numpy as np

import drafters.synthetic
from drafters.base import DraftRequest
from drafters.synthetic import SyntheticDrafter


def test_the_worked_examples_hold():
    assert doctest.testmod(drafters.synthetic).failed == 0


def test_a_position_drafts_the_same_tokens_in_every_run_and_order():
    rng = np.random.default_rng(3)
    references = [[int(t) for t in rng.integers(0, 50, 40)] for _ in range(3)]
    first, second = (SyntheticDrafter(references, alpha=0.5, vocab=50, seed=7) for _ in range(2))
    starts = [(i, s) for i in range(3) for s in range(4, 36, 5)]
    drafts = {(i, s): first.propose([DraftRequest(f"{i}-{s}", references[i][:s], 4)])[0].tokens for i, s in starts}
    again = {(i, s): second.propose([DraftRequest(f"{i}-{s}", references[i][:s], 4)])[0].tokens
             for i, s in reversed(starts)}  # fmt: skip
    assert drafts == again
    other_seed = SyntheticDrafter(references, alpha=0.5, vocab=50, seed=8)
    assert any(other_seed.propose([DraftRequest(f"{i}-{s}", references[i][:s], 4)])[0].tokens != drafts[i, s]
               for i, s in starts)  # fmt: skip


def test_each_token_is_kept_with_probability_alpha():
    reference = list(range(4000))
    for alpha in (0.0, 0.6, 0.9, 1.0):
        drafter = SyntheticDrafter([reference], alpha=alpha, vocab=5000, seed=1)
        draft = drafter.propose([DraftRequest("s", reference[:1], 3999)])[0].tokens
        kept = np.mean([d == t for d, t in zip(draft, reference[1:])])
        assert abs(kept - alpha) < 0.03
        assert all(0 <= d < 5000 for d in draft)
