"""Full-sequence forward passes and the training losses, through the server's own `forward` and `mtp_forward`.

A training batch is B independent sequences of T tokens starting at position 0: each row reads the null plane,
writes no plane, and owns one KV page of size T, so the pools are trivial and what is differentiated is exactly
the step the server runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmodel.config import ModelConfig
from jaxmodel.model import forward, mtp_forward
from jaxmodel.state import StepBatch, init_state
from jaxmodel.weights import Weights

from .params import materialize


def sequence_batch(tokens: jax.Array) -> StepBatch:
    """tokens [B, T] -> a StepBatch feeding every row from position 0 with logits at every token."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return StepBatch(
        tokens=tokens.astype(jnp.int32),
        positions=positions,
        n_tokens=jnp.full((B,), T, jnp.int32),
        page_table=jnp.arange(1, B + 1, dtype=jnp.int32)[:, None],  # [B, 1]; page 0 is the trash page
        read_plane=jnp.zeros((B,), jnp.int32),
        write_planes=jnp.full((B, T), -1, jnp.int32),
        logit_rows=positions,
    )


def sequence_forward(weights: Weights, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The target over fresh sequences. tokens [B, T] -> logits [B, T, V], post-norm hidden [B, T, E]."""
    B, T = tokens.shape
    state = init_state(cfg.replace(n_mtp=0), n_pages=B + 1, n_planes=1, page_size=T)
    out, _ = forward(weights, cfg, sequence_batch(tokens), state)
    return out.logits, out.hidden


def mtp_sequence_forward(
    weights: Weights, cfg: ModelConfig, tokens: jax.Array, hidden_in: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The MTP block on (tokens[:, t] at position t, hidden_in[:, t] = h_{t-1}) pairs.

    tokens [B, T], hidden_in [B, T, E] -> logits [B, T, V] for token t+1, the MTP's own hidden [B, T, E].
    """
    B, T = tokens.shape
    state = init_state(cfg.replace(n_mtp=1, recurrent=()), n_pages=B + 1, n_planes=1, page_size=T)
    out, _ = mtp_forward(weights, cfg, sequence_batch(tokens), hidden_in, state)
    return out.logits, out.hidden


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats. logits [B, N, V], targets [B, N]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def shifted_hidden(hidden: jax.Array) -> jax.Array:
    """[B, T, E] -> [B, T, E] with row t holding h_{t-1} and row 0 zero (llama.cpp's pending_h at start)."""
    return jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))


def losses(
    params: Weights, cfg: ModelConfig, tokens: jax.Array, mtp_chain: int = 1
) -> dict[str, jax.Array]:
    """Next-token loss and the MTP losses on tokens [B, T] (nats per token).

    "lm": the target predicts tokens[t+1] at t. "mtp1": the MTP block, fed (tokens[t], target h_{t-1}) at row t,
    predicts tokens[t+1], i.e. two tokens past h (docs/model.md §6.1). "mtp{k}" for k <= mtp_chain: the block chained on
    its own hidden as drafting does (docs/model.md §6.2), teacher-forced with the true tokens, k tokens past h.
    Row 0 (h_{-1} = 0) is left out of the MTP losses; each chained step loses one more row at the start.
    """
    weights = materialize(params)
    logits, hidden = sequence_forward(weights, cfg, tokens)
    out = {"lm": _cross_entropy(logits[:, :-1], tokens[:, 1:])}
    if weights.mtp is not None:
        h = hidden
        for k in range(1, mtp_chain + 1):
            mtp_logits, h = mtp_sequence_forward(weights, cfg, tokens, shifted_hidden(h))
            out[f"mtp{k}"] = _cross_entropy(mtp_logits[:, k:-1], tokens[:, k + 1 :])
    return out


def total_loss(
    params: Weights, cfg: ModelConfig, tokens: jax.Array, mtp_weight: float, mtp_chain: int = 1
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """lm + mtp_weight * mean of the MTP losses; returns (loss, the parts)."""
    parts = losses(params, cfg, tokens, mtp_chain)
    mtp = [v for k, v in parts.items() if k.startswith("mtp")]
    loss = parts["lm"] + (mtp_weight * sum(mtp) / len(mtp) if mtp else 0.0)
    return loss, parts
