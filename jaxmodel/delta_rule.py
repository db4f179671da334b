"""The gated delta rule over snapshot planes (SPEC-qwen35 §4.2 step 6).

This module is the one place that chooses how the recurrence runs; the GDN mixer calls
`gated_delta_rule` and never an implementation directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_key_heads(x: jax.Array, n_value_heads: int) -> jax.Array:
    """[..., Hk, D] -> [..., Hv, D]: value head h uses key head h % Hk (GGUF's tiled order)."""
    n_key_heads = x.shape[-2]
    return jnp.tile(x, (1,) * (x.ndim - 2) + (n_value_heads // n_key_heads, 1))


def recurrent_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes):
    """Token-serial gated delta rule reading and writing state planes.

    q, k:          [B, T, Hk, Dk]  L2-normalised queries and keys
    v:             [B, T, Hv, Dv]
    g, beta:       [B, T, Hv]      log-decay (<= 0) and write strength; padding tokens carry g = beta = 0
    ssm_pool:      [N, Hv, Dk, Dv] float32 state planes
    read_plane:    [B]             plane holding each row's input state
    write_planes:  [B, T]          plane that receives the state after token t, -1 for none
    returns o [B, T, Hv, Dv] (scaled by 1/sqrt(Dk)) and the updated pool.
    """
    n_planes, n_value_heads, dk, _ = ssm_pool.shape
    q = tile_key_heads(q, n_value_heads) * (dk**-0.5)
    k = tile_key_heads(k, n_value_heads)
    # Rows that write nothing at a token scatter out of bounds, which the scatter drops.
    targets = jnp.where(write_planes < 0, n_planes, write_planes)  # [B, T]
    pool = ssm_pool
    state = ssm_pool[read_plane].astype(jnp.float32)  # [B, Hv, Dk, Dv]

    def step(carry, xs):
        state, pool = carry
        q_t, k_t, v_t, g_t, beta_t, target_t = xs  # [B, Hv, Dk] x2, [B, Hv, Dv], [B, Hv] x2, [B]
        state = state * jnp.exp(g_t)[..., None, None]
        recalled = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = beta_t[..., None] * (v_t - recalled)
        state = state + k_t[..., :, None] * delta[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", state, q_t)
        pool = pool.at[target_t].set(state, mode="drop")
        return (state, pool), out

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, g, beta, targets)))
    (_, pool), out = jax.lax.scan(step, (state, pool), xs)
    return time_major(out), pool


def gated_delta_rule(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, final_only: bool = False):
    """Shapes as `recurrent_scan`; dispatches to the implementation for this backend and shape.

    final_only: the caller promises each row writes at most one plane, at or after its last real token
    (a prefill chunk), which lets long inputs take the chunked form.
    """
    return recurrent_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes)
