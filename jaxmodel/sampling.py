"""Sampling and the speculative verification rule, on device and jittable.

Randomness is per request and per position: the token at position t of a request with seed s is drawn with keys
derived from (s, t) only, never from global state or from the batch it happens to run in.

Verification keeps the target's distribution exactly (Leviathan et al. 2023, Chen et al. 2023). With q the target's
processed distribution and p the draft's, draft token x is accepted with probability min(1, q(x) / p(x)); on
rejection the token is drawn from normalize(max(0, q - p)); when every draft is accepted, a bonus token is drawn
from q at the next row. For a deterministic draft p is one-hot, and that rule is the same as drawing y ~ q and
accepting x iff y == x (accept with probability q(x); otherwise y is q conditioned on y != x). `verify` uses that
form, drawing y with the same key that plain sampling uses at that position: with deterministic drafts a request
emits exactly the tokens that `sample` would, whatever was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .kernels.cpu_argmax import greedy_tokens

# key streams under one (seed, position) key
_DRAW, _ACCEPT, _RESIDUAL = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters, all [B].

    temperature: 0 means greedy (argmax); top_p >= 1 and top_k <= 0 disable those filters; seed: uint32.
    """

    temperature: jax.Array  # [B] float32
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    seed: jax.Array  # [B] uint32

    @classmethod
    def of(cls, temperature, top_p=1.0, top_k=0, seed=0, batch: int | None = None) -> SamplingParams:
        """Build from scalars or per-row sequences; scalars are broadcast to `batch` rows."""
        columns = [np.asarray(v) for v in (temperature, top_p, top_k, seed)]
        rows = batch if batch is not None else max(c.size if c.ndim else 1 for c in columns)
        temperature, top_p, top_k, seed = (np.broadcast_to(c, (rows,)) for c in columns)
        return cls(  # numpy, not jnp: built on the host every step, no eager device op
            temperature=np.asarray(temperature, np.float32),
            top_p=np.asarray(top_p, np.float32),
            top_k=np.asarray(top_k, np.int32),
            seed=(np.asarray(seed, np.int64) & 0xFFFFFFFF).astype(np.uint32),
        )


def process_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Temperature, then top-k, then top-p (on the top-k renormalised distribution), as in HF transformers.

    logits [..., V]; temperature, top_p, top_k [...]. Returns the scaled logits [..., V] float32 with -inf outside
    the kept set; softmax of it is the distribution q that sampling draws from. Greedy rows (temperature 0) are
    left unscaled: only their argmax matters. Ties with the smallest kept logit are kept. The sort runs only when
    some row filters.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[..., None]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    filters = (temperature > 0) & ((k < vocab) | (top_p < 1.0))

    def filtered(scaled):
        ranked = -jnp.sort(-scaled, axis=-1)  # [..., V] descending
        rank = jnp.arange(vocab)
        in_top_k = rank < k[..., None]
        probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        in_top_p = (mass_before < top_p[..., None]) | (top_p[..., None] >= 1.0) | (rank == 0)
        cutoff = jnp.min(jnp.where(in_top_k & in_top_p, ranked, jnp.inf), axis=-1)  # smallest kept logit
        return jnp.where(filters[..., None] & (scaled < cutoff[..., None]), -jnp.inf, scaled)

    return jax.lax.cond(jnp.any(filters), filtered, lambda s: s, scaled)


def position_keys(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """seed [B] uint32, positions [B, R] int32 -> keys [B, R]: the key for each row's token at each position."""
    request_keys = jax.vmap(jax.random.key)(seed)
    return jax.vmap(lambda key, pos: jax.vmap(lambda p: jax.random.fold_in(key, p))(pos))(request_keys, positions)


def _stream(keys: jax.Array, stream: int) -> jax.Array:
    """keys [B, R] -> keys [B, R] of one named stream."""
    return jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, stream)))(keys)


def _draw(processed: jax.Array, greedy: jax.Array, keys: jax.Array) -> jax.Array:
    """processed [B, R, V] filtered logits, greedy [B, 1], keys [B, R] -> tokens [B, R] int32."""
    sampled = jax.vmap(jax.vmap(jax.random.categorical))(keys, processed)
    return jnp.where(greedy, greedy_tokens(processed), sampled).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array) -> jax.Array:
    """Plain (non-speculative) sampling.

    logits [B, V]; positions [B] int32, the position of the token being drawn in its sequence -> tokens [B] int32.
    """
    processed = process_logits(logits, params.temperature, params.top_p, params.top_k)
    keys = position_keys(params.seed, positions[:, None])
    return _draw(processed[:, None], (params.temperature <= 0)[:, None], _stream(keys, _DRAW))[:, 0]


def verify(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    n_drafts: jax.Array,
    params: SamplingParams,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of each row's draft and draw one more token from the target.

    target_logits [B, R, V]: row r predicts the token after the input's r-th token (`last`, then the drafts).
    draft_tokens  [B, R-1] int32; entries at or beyond n_drafts[b] are padding and never accepted.
    draft_probs   [B, R-1, V] the distributions the drafts were sampled from, or None for deterministic drafts;
                  in a mixed batch, deterministic rows pass one-hot rows.
    n_drafts      [B] int32 in [0, R-1]; 0 is plain sampling.
    positions     [B] int32: the position in its sequence of the token that row 0 predicts.
    Returns n_accepted [B] int32 and tokens [B, R] int32: row b commits tokens[b, :n_accepted[b] + 1], the accepted
    drafts and then the target's token; later entries are -1.
    """
    if draft_probs is None:  # all-greedy batches skip the random draws over [B, R, V] (most of verify's cost)
        # The branches take the logits as [B * R, V]: handed in as [B, R, V], XLA gave the operand a layout of its
        # own (the size-1 R of decoding placed outermost) and copied all of it back before the argmax kernel.
        B, R, V = target_logits.shape
        flat = target_logits.reshape(B * R, V)
        return jax.lax.cond(
            jnp.all(params.temperature <= 0),
            lambda: _accept(greedy_tokens(flat.astype(jnp.float32)).reshape(B, R), draft_tokens, n_drafts),
            lambda: _verify(flat.reshape(B, R, V), draft_tokens, None, n_drafts, params, positions),
        )
    return _verify(target_logits, draft_tokens, draft_probs, n_drafts, params, positions)


def _accept(target_draws: jax.Array, draft_tokens: jax.Array, n_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Deterministic drafts against the target's draws [B, R]: the accepted prefix, then the target's token."""
    return _commit(draft_tokens == target_draws[:, :-1], target_draws, draft_tokens, n_drafts)


def _commit(accepted, corrections, draft_tokens, n_drafts) -> tuple[jax.Array, jax.Array]:
    """accepted [B, R-1] bool, corrections [B, R]: the token committed after each accepted prefix."""
    batch, rows = corrections.shape
    row = jnp.arange(rows)
    is_draft = row[:-1] < n_drafts[:, None]  # [B, R-1]
    n_accepted = jnp.sum(jnp.cumprod(accepted & is_draft, axis=1), axis=1).astype(jnp.int32)  # [B]
    padded_drafts = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
    correction = jnp.take_along_axis(corrections, n_accepted[:, None], axis=1)  # [B, 1]
    tokens = jnp.where(row < n_accepted[:, None], padded_drafts, jnp.where(row == n_accepted[:, None], correction, -1))
    return n_accepted, tokens


def _verify(target_logits, draft_tokens, draft_probs, n_drafts, params, positions):
    batch, rows, _ = target_logits.shape
    row = jnp.arange(rows)
    greedy = (params.temperature <= 0)[:, None]  # [B, 1]
    processed = process_logits(
        target_logits, params.temperature[:, None], params.top_p[:, None], params.top_k[:, None]
    )  # [B, R, V]
    keys = position_keys(params.seed, positions[:, None] + row)  # [B, R]
    target_draws = _draw(processed, greedy, _stream(keys, _DRAW))  # [B, R] what plain sampling emits there
    is_draft = row[:-1] < n_drafts[:, None]  # [B, R-1]

    if draft_probs is None:
        return _accept(target_draws, draft_tokens, n_drafts)
    else:
        q = jnp.where(greedy[..., None], jax.nn.one_hot(target_draws, processed.shape[-1]), jax.nn.softmax(processed))
        q_x = jnp.take_along_axis(q[:, :-1], draft_tokens[..., None], axis=-1)[..., 0]  # [B, R-1]
        p_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(jax.random.uniform))(_stream(keys[:, :-1], _ACCEPT))  # [B, R-1]
        one_hot_draft = p_x >= 1.0  # a deterministic draft in a mixed batch: keep the coupling with `sample`
        accepted = jnp.where(one_hot_draft, draft_tokens == target_draws[:, :-1], u * p_x < q_x)
        residual = jnp.maximum(q[:, :-1] - draft_probs, 0.0)  # [B, R-1, V]
        residual_logits = jnp.where(
            jnp.any(residual > 0, axis=-1, keepdims=True),
            jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf),
            processed[:, :-1],  # q == p: rejection has probability 0; any valid distribution will do
        )
        residual_draws = _draw(residual_logits, jnp.zeros_like(greedy), _stream(keys[:, :-1], _RESIDUAL))
        rejected_draws = jnp.where(is_draft & ~one_hot_draft, residual_draws, target_draws[:, :-1])
        corrections = jnp.concatenate([rejected_draws, target_draws[:, -1:]], axis=1)  # [B, R]
    return _commit(accepted, corrections, draft_tokens, n_drafts)
