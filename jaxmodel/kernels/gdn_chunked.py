"""Pallas kernel: the chunked (WY / UT-transform) gated delta rule for prefill chunks.

One program per (row b, value head h, Dv block j). It loads its [Dk, BV] slice of the input state from plane
read_plane[b] and walks the tokens C at a time. Within a chunk, with G the cumulative log-decay and
A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i:
    T = (I + A)^-1                      (forward substitution, A strictly lower triangular)
    u = T (beta v),  w = T (beta exp(G) k)
    v_new = u - w S                     (the per-token deltas)
    o = (exp(G) q) S + (q k^T * exp(G_i - G_j), j <= i) v_new
    S <- exp(G_last) S + (exp(G_last - G) k)^T v_new
so everything but the substitution is matmuls. The final state goes to plane final_plane[b] (skipped when -1);
the pool is aliased input -> output. This is flash-linear-attention's `chunk_gated_delta_rule` (naive.py), fused
per head.

Written for the Triton backend of Pallas; runs under `interpret=True` on CPU. Tested against
`jaxmodel.kernels.reference.reference_pool_update(..., final_only=True)` (tests/test_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower-triangular [C, C] a, by forward substitution one row at a time.

    Row i of the inverse is e_i - sum_{j<i} a[i, j] row_j; rows are picked and placed with masks because a
    register tensor cannot be indexed by a loop counter.
    """
    size = a.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    positions = jax.lax.broadcasted_iota(jnp.int32, (size,), 0)

    def substitute(i, inverse):
        a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C]
        new_row = (positions == i).astype(a.dtype) - jnp.sum(a_row[:, None] * inverse, axis=0)  # [C]
        return jnp.where(rows == i, new_row[None, :], inverse)

    return jax.lax.fori_loop(1, size, substitute, (rows == cols).astype(a.dtype))


def _chunked_kernel(
    read_ref,  # []                 plane holding this row's input state
    final_ref,  # []                plane receiving the final state, -1 for none
    q_ref,  # [Tp, Dk]              Tp = T padded to a multiple of C with identity tokens
    k_ref,  # [Tp, Dk]
    v_ref,  # [Tp, BV]
    g_ref,  # [Tp]
    beta_ref,  # [Tp]
    pool_in_ref,  # [N, Dk, BV]      aliased with pool_ref
    o_ref,  # [Tp, BV]
    pool_ref,  # [N, Dk, BV]
    *,
    chunk: int,
    scale: float,
    precision,
):
    n_chunks = q_ref.shape[0] // chunk
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    causal, strict = rows >= cols, rows > cols
    state = pool_in_ref[read_ref[...]].astype(jnp.float32)  # [Dk, BV]

    def chunk_step(c, state):
        span = pl.ds(c * chunk, chunk)
        q = q_ref[span, :].astype(jnp.float32)  # [C, Dk]
        k = k_ref[span, :].astype(jnp.float32)  # [C, Dk]
        v = v_ref[span, :].astype(jnp.float32)  # [C, BV]
        g = g_ref[span].astype(jnp.float32)  # [C]
        beta = beta_ref[span].astype(jnp.float32)  # [C]
        g_cum = jnp.cumsum(g)  # [C]
        g_last = jnp.sum(g)
        # Masked before exp: above the diagonal G_i - G_j is positive and may overflow.
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, g_cum[:, None] - g_cum[None, :], 0.0)), 0.0)  # [C, C]
        a = jnp.where(strict, beta[:, None] * dot(k, k.T) * decay, 0.0)  # [C, C]
        inverse = unit_lower_inverse(a)
        u = dot(inverse, beta[:, None] * v)  # [C, BV]
        w = dot(inverse, (beta * jnp.exp(g_cum))[:, None] * k)  # [C, Dk]
        v_new = u - dot(w, state)  # [C, BV]
        scores = jnp.where(causal, dot(q, k.T) * decay, 0.0)  # [C, C]
        o = dot(q * jnp.exp(g_cum)[:, None], state) + dot(scores, v_new)  # [C, BV]
        o_ref[span, :] = (o * scale).astype(o_ref.dtype)
        k_to_end = k * jnp.exp(g_last - g_cum)[:, None]  # [C, Dk]
        return state * jnp.exp(g_last) + dot(k_to_end.T, v_new)

    state = jax.lax.fori_loop(0, n_chunks, chunk_step, state)
    plane = final_ref[...]

    @pl.when(plane >= 0)
    def _store():
        pool_ref[plane] = state.astype(pool_ref.dtype)


def chunked_pallas_call(q, k, v, g, beta, ssm_pool, read_plane, final_plane, *, chunk, block_v, precision,
                        num_warps, num_stages, interpret):
    """Build and run the `pallas_call` on inputs whose T is already a multiple of `chunk`."""
    n_rows, n_tokens, n_key_heads, dk = q.shape
    n_planes, n_value_heads, _, dv = ssm_pool.shape
    if dv % block_v:
        raise ValueError(f"Dv={dv} is not a multiple of block_v={block_v}")
    grid = (n_rows, n_value_heads, dv // block_v)
    key_head = lambda b, h, j: (b, 0, h % n_key_heads, 0)
    kernel = functools.partial(_chunked_kernel, chunk=chunk, scale=dk**-0.5, precision=precision)
    pool_spec = pl.BlockSpec((n_planes, None, dk, block_v), lambda b, h, j: (0, h, 0, j))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, j: (b,)),  # read_plane
            pl.BlockSpec((None,), lambda b, h, j: (b,)),  # final_plane
            pl.BlockSpec((None, n_tokens, None, dk), key_head),  # q
            pl.BlockSpec((None, n_tokens, None, dk), key_head),  # k
            pl.BlockSpec((None, n_tokens, None, block_v), lambda b, h, j: (b, 0, h, j)),  # v
            pl.BlockSpec((None, n_tokens, None), lambda b, h, j: (b, 0, h)),  # g
            pl.BlockSpec((None, n_tokens, None), lambda b, h, j: (b, 0, h)),  # beta
            pool_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, n_tokens, None, block_v), lambda b, h, j: (b, 0, h, j)),  # o
            pool_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_rows, n_tokens, n_value_heads, dv), jnp.float32),
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
        ],
        input_output_aliases={7: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunked",
    )(read_plane, final_plane, q, k, v, g, beta, ssm_pool)


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "precision", "num_warps", "num_stages",
                                             "interpret"))
def gdn_chunked(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, chunk: int = 32,
                block_v: int | None = None, precision=jax.lax.Precision.HIGHEST, num_warps: int = 4,
                num_stages: int = 2, interpret: bool = False):
    """Chunked gated delta rule for prefill chunks (the `final_only` contract), as a Pallas kernel.

    q, k:          [B, T, Hk, Dk]   L2-normalised; value head h uses key head h % Hk
    v:             [B, T, Hv, Dv]
    g, beta:       [B, T, Hv]       log-decay (<= 0) and write strength; padding tokens carry 0, 0
    ssm_pool:      [N, Hv, Dk, Dv]  float32 planes, updated in place (donate it under jit to avoid a copy)
    read_plane:    [B] int32        plane holding each row's input state
    write_planes:  [B, T] int32     at most one plane >= 0 per row: it receives the state after all T tokens
    chunk:         C, tokens per chunk (a power of two); T is padded to a multiple of C with identity tokens
                   (g = beta = 0, q = k = v = 0)
    block_v:       Dv columns per program (divides Dv; default min(Dv, 32)); Dk and block_v powers of two.
                   On GPU C, Dk and block_v must be >= 16 (Triton's smallest matmul).
    precision:     of the in-kernel matmuls (HIGHEST: IEEE float32 on GPU)
    returns o [B, T, Hv, Dv] float32 (scaled by 1/sqrt(Dk)) and the pool [N, Hv, Dk, Dv].
    Reference: jaxmodel.kernels.reference.reference_pool_update(..., final_only=True).
    """
    n_tokens, dv = q.shape[1], v.shape[-1]
    pad = -n_tokens % chunk
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    final_plane = jnp.max(write_planes, axis=1).astype(jnp.int32)  # [B]
    o, pool = chunked_pallas_call(
        padded(q), padded(k), padded(v), padded(g), padded(beta), ssm_pool, read_plane.astype(jnp.int32),
        final_plane, chunk=chunk, block_v=block_v or min(dv, 32), precision=precision, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)
    return o[:, :n_tokens], pool
