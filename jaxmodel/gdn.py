"""The Gated DeltaNet mixer (docs/model.md §4.2) over the conv and SSM plane pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .delta_rule import gated_delta_rule
from .layers import l2_norm, linear, rms_norm
from .state import read_planes, scatter_planes
from .weights import GatedDeltaNet


def gdn_mixer(
    w: GatedDeltaNet,
    cfg: ModelConfig,
    x: jax.Array,  # [B, T, E] normed input
    valid: jax.Array,  # [B, T] bool
    n_tokens: jax.Array,  # [B]
    conv_pool: jax.Array,  # [N, C, Kc-1]
    ssm_pool: jax.Array,  # [N, Hv, Dk, Dv]
    read_plane: jax.Array,  # [B]
    write_planes: jax.Array,  # [B, T]
    final_only: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns y [B, T, E] and both pools with the states after each written token stored."""
    B, T, _ = x.shape
    Hk, Hv, Dk, Kc = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    qkv = linear(x, w.qkv)  # [B, T, C]
    z = linear(x, w.gate).reshape(B, T, Hv, Dk)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(linear(x, w.beta)), 0.0)  # [B, T, Hv]
    g = jnp.where(valid[..., None], jax.nn.softplus(linear(x, w.alpha) + w.dt_bias) * w.a, 0.0)

    # Causal depthwise conv over [previous Kc-1 raw inputs | this step's inputs], oldest first.
    window = jnp.concatenate([read_planes(conv_pool, read_plane), jnp.swapaxes(qkv, 1, 2)], axis=2)  # [B, C, Kc-1+T]
    taps = jnp.stack([window[:, :, j : j + T] for j in range(Kc)], axis=-1)  # [B, C, T, Kc]
    conv = jax.nn.silu(jnp.einsum("bctk,ck->btc", taps, w.conv))  # [B, T, C]

    q = l2_norm(conv[..., : Hk * Dk].reshape(B, T, Hk, Dk), cfg.norm_eps)
    k = l2_norm(conv[..., Hk * Dk : 2 * Hk * Dk].reshape(B, T, Hk, Dk), cfg.norm_eps)
    v = conv[..., 2 * Hk * Dk :].reshape(B, T, Hv, Dk)
    o, ssm_pool = gated_delta_rule(q, k, v, g, beta, ssm_pool, read_plane, write_planes, final_only=final_only)

    # The conv state after token t is the Kc-1 raw inputs ending at t: window[:, :, t+1 : t+Kc].
    if final_only:
        last = n_tokens - 1  # [B]
        after = jax.vmap(lambda wnd, t: jax.lax.dynamic_slice_in_dim(wnd, t + 1, Kc - 1, axis=1))(window, last)
        conv_pool = scatter_planes(conv_pool, jnp.max(write_planes, axis=1), after)
    else:
        after = jnp.stack([window[:, :, j + 1 : j + 1 + T] for j in range(Kc - 1)], axis=-1)  # [B, C, T, Kc-1]
        after = jnp.swapaxes(after, 1, 2).reshape(B * T, -1, Kc - 1)
        conv_pool = scatter_planes(conv_pool, write_planes.reshape(B * T), after)

    o = rms_norm(o, w.norm, cfg.norm_eps) * jax.nn.silu(z)
    return linear(o.reshape(B, T, Hv * Dk), w.out), conv_pool, ssm_pool
