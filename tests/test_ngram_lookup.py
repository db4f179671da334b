"""The n-gram lookup on device against the host's definition (`drafters.ngram.ngram_draft`), and the history it
searches growing inside a call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafters.ngram import NgramDrafter, ngram_draft
from jaxmodel.ngram_lookup import LOOKUP_MAX_N, append_tokens, ngram_lookup

EXAMPLE = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
lookup = jax.jit(ngram_lookup, static_argnames="n_draft")


def lookup_rows(rows, min_n, max_n, n_draft, width=None):
    """Each row's device draft, as lists."""
    width = width or max(len(r) for r in rows) + 3
    history = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
    drafts, n_found = lookup(history, np.array([len(r) for r in rows], np.int32), np.asarray(min_n, np.int32),
                             np.asarray(max_n, np.int32), n_draft=n_draft)  # fmt: skip
    return [np.asarray(drafts[b, : n_found[b]]).tolist() for b in range(len(rows))]


def test_worked_example():
    got = lookup_rows([EXAMPLE, EXAMPLE, EXAMPLE], [2, 2, 2], [3, 2, 3], 4)
    assert got == [[10, 11, 2, 3], [20, 21, 1, 2], [10, 11, 2, 3]]
    # a draft stops at the end of the history: 9 tokens follow the match, 12 asked for
    assert lookup_rows([EXAMPLE], [2], [3], 12) == [[10, 11, 2, 3, 20, 21, 1, 2, 3]]


def test_rows_without_lookup_or_match_get_nothing():
    assert lookup_rows([EXAMPLE, [1, 2, 3, 4, 5], [], [4]], [0, 2, 1, 1], [3, 8, 8, 8], 3) == [[], [], [], []]


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_host_definition_on_random_histories(seed):
    """Small alphabets make matches of every length common; sizes vary per row, the pattern up to LOOKUP_MAX_N."""
    rng = np.random.default_rng(seed)
    rows, mins, maxs = [], [], []
    for _ in range(48):
        rows.append(rng.integers(0, rng.integers(2, 6), rng.integers(0, 40)).tolist())
        mins.append(int(rng.integers(1, 4)))
        maxs.append(int(rng.integers(mins[-1], LOOKUP_MAX_N + 1)))
    got = lookup_rows(rows, mins, maxs, 5, width=48)
    assert got == [ngram_draft(r, 5, lo, hi) for r, lo, hi in zip(rows, mins, maxs)]


def test_appended_tokens_extend_the_history_and_stop_at_its_width():
    history = jnp.zeros((2, 6), jnp.int32).at[0, :2].set(jnp.array([5, 6]))
    history, length = append_tokens(history, jnp.array([2, 5]), jnp.array([[7, 8, 9], [1, 2, 3]]), jnp.array([2, 3]))
    assert np.asarray(history).tolist() == [[5, 6, 7, 8, 0, 0], [0, 0, 0, 0, 0, 1]]
    assert np.asarray(length).tolist() == [4, 6]


def test_the_drafter_offers_its_lookup_to_the_device_within_the_compared_depth():
    assert NgramDrafter(2, 8).device_lookup() == (2, 8)
    assert NgramDrafter(2, LOOKUP_MAX_N + 1).device_lookup() is None
