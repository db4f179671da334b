"""Pallas kernel: a Gated DeltaNet layer's work between its input projections and its output projection, for decode
and verify steps, as one kernel.

What XLA runs as a dozen or more kernels per layer (the conv planes' gather, the causal conv and its silu, the
conv planes' scatter, the q / k L2 norms, the gates' sigmoid and softplus, the token-serial delta rule, the gated
RMS norm) runs here as one launch per layer: on a GPU a decode step is bound by launches, not bytes
(docs/performance.md, "On a GPU").

One program per (row b, key head j), for the value heads that use key head j (h = j + i Hk, i < Hv / Hk), one after
another. For each it walks the row's T tokens with the conv windows (q and k of key head j, v of value head h) and
the head's [Dk, Dv] state in registers; after token t it stores both into plane write_planes[b, t] (skipped when -1).
The program reads every window before it stores any (a row may write the plane it reads), and only its first value
head stores the key head's channels, so each channel has one writer. Both pools are aliased input -> output: on a
GPU planes are written in place, and planes nobody names are never touched. Aliasing contract as `gdn_recurrent`: a
plane one row reads is not written by another row of the same call (the null plane 0 is only ever read).

Written for the Triton backend of Pallas; runs under `interpret=True` on CPU. `gdn_decode_reference` below is its
specification in jnp (tests/test_gdn_decode.py holds the kernel to it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .cpu_conv import causal_conv_reference


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _decode_kernel(
    n_tokens_ref,  # []                  the row's real tokens; later ones are padding
    read_ref,  # []                      plane holding the row's input states
    write_ref,  # [T]                    plane receiving the states after token t, -1 for none
    qkv_ref,  # [T, G, D]                the projection's raw conv inputs by channel group: G = 2 Hk + Hv
    z_ref,  # [T, Hv, D]                 the output gate
    beta_ref,  # [T, Hv]                 raw write strength (before the sigmoid)
    alpha_ref,  # [T, Hv]                raw decay (before softplus(alpha + dt_bias) * a)
    w_conv_ref,  # [G, D, Kc]            conv taps, oldest first
    dt_bias_ref,  # [Hv]
    a_ref,  # [Hv]
    norm_ref,  # [D]                     the gated RMS norm's weight
    conv_in_ref,  # [N, G, D, Kc-1]      aliased with conv_ref
    ssm_in_ref,  # [N, Hv, D, D]         aliased with ssm_ref
    o_ref,  # [T, Hv, D]
    conv_ref,  # [N, G, D, Kc-1]
    ssm_ref,  # [N, Hv, D, D]
    *,
    n_key_heads: int,
    eps: float,
):
    key_head = pl.program_id(1)
    n_value_heads, d = z_ref.shape[1], z_ref.shape[2]
    n_taps = w_conv_ref.shape[2]
    read = read_ref[...]
    n_real = n_tokens_ref[...]
    norm = norm_ref[...].astype(jnp.float32)
    key_groups = (key_head, n_key_heads + key_head)  # q, k

    def window_of(group):  # the Kc-1 earlier raw inputs [D] of a channel group, oldest first
        return tuple(conv_in_ref[read, group, :, j].astype(jnp.float32) for j in range(n_taps - 1))

    def taps_of(group):
        return tuple(w_conv_ref[group, :, j].astype(jnp.float32) for j in range(n_taps))

    def conv_step(x, window, taps, live):
        total = window[0] * taps[0]
        for j in range(1, n_taps - 1):
            total = total + window[j] * taps[j]
        return jnp.where(live, _silu(total + x * taps[n_taps - 1]), 0.0)

    # Every window is read before anything is stored: a row may write the plane it reads.
    key_windows = tuple(window_of(group) for group in key_groups)
    key_taps = tuple(taps_of(group) for group in key_groups)
    # This program's value heads: key_head + i Hk, i < Hv / Hk (value head h uses key head h % Hk).
    value_windows = [window_of(2 * n_key_heads + key_head + i * n_key_heads)
                     for i in range(n_value_heads // n_key_heads)]
    for i in range(n_value_heads // n_key_heads):
        head = key_head + i * n_key_heads
        v_group = 2 * n_key_heads + head
        v_taps = taps_of(v_group)
        dt_bias, a = dt_bias_ref[head].astype(jnp.float32), a_ref[head].astype(jnp.float32)
        state = ssm_in_ref[read, head].astype(jnp.float32)  # [Dk, Dv]
        writes_keys = i == 0

        def step(t, carry, head=head, v_group=v_group, v_taps=v_taps, dt_bias=dt_bias, a=a,
                 writes_keys=writes_keys):
            state, windows = carry
            live = t < n_real
            raw = (qkv_ref[t, key_groups[0]].astype(jnp.float32), qkv_ref[t, key_groups[1]].astype(jnp.float32),
                   qkv_ref[t, v_group].astype(jnp.float32))
            q, k, v = (conv_step(x, window, taps, live)
                       for x, window, taps in zip(raw, windows, key_taps + (v_taps,)))
            q = q * jax.lax.rsqrt(jnp.sum(q * q) + eps) * (d**-0.5)
            k = k * jax.lax.rsqrt(jnp.sum(k * k) + eps)
            beta = jnp.where(live, jax.nn.sigmoid(beta_ref[t, head].astype(jnp.float32)), 0.0)
            g = jnp.where(live, jax.nn.softplus(alpha_ref[t, head].astype(jnp.float32) + dt_bias) * a, 0.0)

            state = state * jnp.exp(g)
            recalled = jnp.sum(state * k[:, None], axis=0)  # [Dv]
            delta = beta * (v - recalled)
            state = state + k[:, None] * delta[None, :]
            o = jnp.sum(state * q[:, None], axis=0)  # [Dv]
            o = o * jax.lax.rsqrt(jnp.sum(o * o) / d + eps) * norm * _silu(z_ref[t, head].astype(jnp.float32))
            o_ref[t, head] = o.astype(o_ref.dtype)

            windows = tuple(window[1:] + (x,) for window, x in zip(windows, raw))
            plane = write_ref[t]

            @pl.when(plane >= 0)
            def _store():
                ssm_ref[plane, head] = state.astype(ssm_ref.dtype)
                stored = zip((*key_groups, v_group), windows) if writes_keys else ((v_group, windows[2]),)
                for group, window in stored:
                    for j in range(n_taps - 1):
                        conv_ref[plane, group, :, j] = window[j].astype(conv_ref.dtype)

            return state, windows

        jax.lax.fori_loop(0, qkv_ref.shape[0], step, (state, key_windows + (value_windows[i],)))


@functools.partial(jax.jit, static_argnames=("n_key_heads", "eps", "num_warps", "num_stages", "interpret"))
def gdn_decode(qkv, z, beta, alpha, w_conv, dt_bias, a, norm, conv_pool, ssm_pool, read_plane, write_planes,
               n_tokens, *, n_key_heads: int, eps: float, num_warps: int | None = None, num_stages: int = 1,
               interpret: bool = False):
    """A GDN layer from its projections to its output projection's input, over snapshot planes, as one kernel.

    qkv:           [B, T, C]           the raw conv inputs, C = 2 Hk D + Hv D: q (Hk heads), k (Hk), v (Hv)
    z:             [B, T, Hv D]        the output gate
    beta, alpha:   [B, T, Hv]          raw write strength and decay (the projections' outputs)
    w_conv:        [C, Kc]             conv taps, oldest first
    dt_bias, a:    [Hv]                g = softplus(alpha + dt_bias) * a, a < 0
    norm:          [D]                 the gated RMS norm's weight (per head)
    conv_pool:     [N, C, Kc-1]        conv planes, updated in place (donate under jit to avoid a copy)
    ssm_pool:      [N, Hv, D, D]       float32 state planes, updated in place
    read_plane:    [B] int32           plane holding each row's input states (both pools)
    write_planes:  [B, T] int32        plane receiving the states after token t, -1 for none
    n_tokens:      [B] int32           each row's real tokens; the rest are padding (output 0, state unchanged)
    n_key_heads:   Hk; value head h uses key head h % Hk (GGUF's tiled order). D = Dk = Dv, a power of two.
    num_warps:     per program; default one per 2048 state entries, at most 8 (eight at D = 128, where the
                   [D, D] float32 state takes 64 registers of each thread)
    returns o [B, T, Hv D] float32 (gated-RMS-normed), conv_pool, ssm_pool.
    Reference: `gdn_decode_reference`.
    """
    n_rows, n_tokens_step, channels = qkv.shape
    n_planes, n_value_heads, d, _ = ssm_pool.shape
    n_taps = w_conv.shape[1]
    n_groups = channels // d
    if n_groups != 2 * n_key_heads + n_value_heads or d & (d - 1) or n_value_heads % n_key_heads:
        raise ValueError(f"qkv's {channels} channels are not 2 x {n_key_heads} + {n_value_heads} heads of {d}")
    kernel = functools.partial(_decode_kernel, n_key_heads=n_key_heads, eps=eps)
    num_warps = num_warps or min(8, max(1, d * d // 2048))
    whole = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    per_row = lambda *shape: pl.BlockSpec((None, *shape), lambda b, h: (b,) + (0,) * len(shape))
    conv_spec = whole((n_planes, n_groups, d, n_taps - 1))
    ssm_spec = whole(ssm_pool.shape)
    o, conv_pool, ssm_pool = pl.pallas_call(
        kernel,
        grid=(n_rows, n_key_heads),
        in_specs=[
            per_row(), per_row(), per_row(n_tokens_step),  # n_tokens, read_plane, write_planes
            per_row(n_tokens_step, n_groups, d), per_row(n_tokens_step, n_value_heads, d),  # qkv, z
            per_row(n_tokens_step, n_value_heads), per_row(n_tokens_step, n_value_heads),  # beta, alpha
            whole((n_groups, d, n_taps)), whole((n_value_heads,)), whole((n_value_heads,)), whole((d,)),
            conv_spec, ssm_spec,
        ],
        out_specs=[per_row(n_tokens_step, n_value_heads, d), conv_spec, ssm_spec],
        out_shape=[
            jax.ShapeDtypeStruct((n_rows, n_tokens_step, n_value_heads, d), jnp.float32),
            jax.ShapeDtypeStruct((n_planes, n_groups, d, n_taps - 1), conv_pool.dtype),
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
        ],
        input_output_aliases={11: 1, 12: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_decode",
    )(n_tokens.astype(jnp.int32), read_plane.astype(jnp.int32), write_planes.astype(jnp.int32),
      qkv.reshape(n_rows, n_tokens_step, n_groups, d), z.reshape(n_rows, n_tokens_step, n_value_heads, d), beta,
      alpha, w_conv.reshape(n_groups, d, n_taps), dt_bias, a, norm,
      conv_pool.reshape(n_planes, n_groups, d, n_taps - 1), ssm_pool)
    return o.reshape(n_rows, n_tokens_step, n_value_heads * d), conv_pool.reshape(n_planes, channels, -1), ssm_pool


def gdn_decode_reference(qkv, z, beta, alpha, w_conv, dt_bias, a, norm, conv_pool, ssm_pool, read_plane,
                         write_planes, n_tokens, *, n_key_heads: int, eps: float):
    """`gdn_decode`'s specification in jnp, step by step as the model's unfused layer computes it: shapes and meaning
    as `gdn_decode`; rows write planes in order (the aliasing contract makes the order moot)."""
    from jaxmodel.delta_rule import recurrent_scan
    from jaxmodel.layers import l2_norm, rms_norm

    B, T, C = qkv.shape
    n_value_heads, d = ssm_pool.shape[1], ssm_pool.shape[2]
    n_taps = w_conv.shape[1]
    live = (jnp.arange(T)[None, :] < n_tokens[:, None])[..., None]  # [B, T, 1]
    prev = conv_pool[read_plane]  # [B, C, Kc-1]
    conv = causal_conv_reference(prev, qkv, w_conv, n_tokens)  # [B, T, C]
    window = jnp.concatenate([prev, jnp.swapaxes(qkv, 1, 2)], axis=2)  # [B, C, Kc-1+T]
    after = jnp.stack([window[:, :, t + 1 : t + n_taps] for t in range(T)], axis=1)  # [B, T, C, Kc-1]
    targets = jnp.where(write_planes < 0, conv_pool.shape[0], write_planes).reshape(B * T)
    conv_pool = conv_pool.at[targets].set(after.reshape(B * T, C, n_taps - 1).astype(conv_pool.dtype), mode="drop")

    q = l2_norm(conv[..., : n_key_heads * d].reshape(B, T, n_key_heads, d), eps)
    k = l2_norm(conv[..., n_key_heads * d : 2 * n_key_heads * d].reshape(B, T, n_key_heads, d), eps)
    v = conv[..., 2 * n_key_heads * d :].reshape(B, T, n_value_heads, d)
    beta = jnp.where(live, jax.nn.sigmoid(beta), 0.0)
    g = jnp.where(live, jax.nn.softplus(alpha + dt_bias) * a, 0.0)
    o, ssm_pool = recurrent_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes)
    o = rms_norm(o, norm, eps) * jax.nn.silu(z.reshape(B, T, n_value_heads, d))
    return o.reshape(B, T, n_value_heads * d), conv_pool, ssm_pool
