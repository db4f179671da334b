"""N-gram (prompt lookup) drafting on device: `drafters.ngram.ngram_draft` over a batch of token histories, so that
the iterations a device call runs without the host (`jaxmodel.speculative.speculative_step`) can draft by lookup.

The answer is the host's: for n from max_n down to min_n the pattern is the history's last n tokens, the longest n
with an earlier occurrence wins, among its occurrences the most recent one, and the draft is what followed it, up
to the end of the history. Instead of trying each n in turn, every candidate end e (exclusive) gets the length of
the common suffix of history[:e] and the whole history, up to max_n: the best end is the one with the longest such
match (at least min_n), the latest among equals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The longest pattern a device lookup compares: the matching depth is unrolled to this many shifted copies.
LOOKUP_MAX_N = 8


def ngram_lookup(
    history: jax.Array,  # [B, H] int32, each row's tokens (oldest first), padding after `length`
    length: jax.Array,  # [B] int32, tokens held (the last one is the token fed next)
    min_n: jax.Array,  # [B] int32, shortest pattern; 0: the row does not look up
    max_n: jax.Array,  # [B] int32, longest pattern, at most LOOKUP_MAX_N
    n_draft: int,
) -> tuple[jax.Array, jax.Array]:
    """Each row's draft: drafts [B, n_draft] int32 (zeros past the draft) and n_found [B] int32.

    Worked example (the one of `drafters.ngram.ngram_draft`), min_n=2, max_n=3, n_draft=4:

        position  0  1  2  3   4   5  6  7   8   9  10 11
        tokens    1  2  3  10  11  2  3  20  21  1  2  3

    The common suffix with the whole history is 3 tokens long at end 3 (tokens[0:3] = [1, 2, 3]) and 2 tokens at
    end 7 ([2, 3]); the longest wins: drafts [10, 11, 2, 3], n_found 4. The equal answer of the host's scan is
    tested on random histories.
    """
    B, H = history.shape
    positions = jnp.arange(H)[None, :]  # [1, H]
    # matched[b, e]: how many tokens before end e equal the history's last ones, up to LOOKUP_MAX_N.
    matched = jnp.zeros((B, H), jnp.int32)
    running = jnp.ones((B, H), bool)
    for i in range(1, LOOKUP_MAX_N + 1):
        before_end = jnp.pad(history, ((0, 0), (i, 0)))[:, :H]  # [B, H]: history[b, e - i]
        newest = jnp.take_along_axis(history, jnp.maximum(length - i, 0)[:, None], axis=1)  # [B, 1]
        running = running & (positions >= i) & (before_end == newest) & (i <= max_n)[:, None]
        matched = matched + running
    # An end must leave the pattern after it (e <= length - 1) and at least min_n matched tokens.
    usable = (positions <= (length - 1)[:, None]) & (matched >= min_n[:, None]) & (min_n > 0)[:, None]
    score = jnp.where(usable, matched * H + positions, -1)  # longest match first, then the most recent end
    top = jnp.max(score, axis=1)  # [B]; usable scores are distinct, so the best end is the top's position (an
    found = top >= 0  # argmax would be a reduction over (value, index) pairs, slow on CPU)
    best = jnp.where(found, top % H, 0).astype(jnp.int32)  # [B]
    n_found = jnp.where(found, jnp.clip(length - best, 0, n_draft), 0)
    index = jnp.minimum(best[:, None] + jnp.arange(n_draft)[None, :], H - 1)
    drafts = jnp.take_along_axis(history, index, axis=1)
    return jnp.where(jnp.arange(n_draft)[None, :] < n_found[:, None], drafts, 0), n_found


def append_tokens(
    history: jax.Array,  # [B, H] int32
    length: jax.Array,  # [B] int32
    tokens: jax.Array,  # [B, W] int32
    n_tokens: jax.Array,  # [B] int32, leading tokens to append (0: the row is left alone)
) -> tuple[jax.Array, jax.Array]:
    """history with tokens[b, :n_tokens[b]] written after its length[b] tokens, and the new lengths. Tokens past
    H are dropped (the caller keeps room for what a call can commit)."""
    B, W = tokens.shape
    H = history.shape[1]
    index = length[:, None] + jnp.arange(W)[None, :]  # [B, W]
    index = jnp.where(jnp.arange(W)[None, :] < n_tokens[:, None], index, H)  # past the end: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, W))
    return history.at[rows, index].set(tokens, mode="drop"), jnp.minimum(length + n_tokens, H)
