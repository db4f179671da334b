"""Pallas kernel: the token-serial gated delta rule over snapshot planes (verify and decode steps).

One program per (row b, value head h, Dv block j). It loads its [Dk, BV] slice of the input state from
plane read_plane[b], walks the T tokens with the state in registers, stores the state after token t into plane
write_planes[b, t] (skipped when -1) and writes the outputs. The pool is aliased input -> output, so on GPU
the planes are written in place and planes nobody names are never touched.

Written for the Triton backend of Pallas (`jax.experimental.pallas.triton`); runs under `interpret=True` on
CPU. Tested against `jaxmodel.kernels.reference.reference_pool_update` (tests/test_kernels.py).

Aliasing contract (as on GPU): every program reads its input state before it writes, and a plane one row
reads must not be written by another row of the same call (the shared null plane 0 is only ever read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _recurrent_kernel(
    read_ref,  # []                    plane holding this row's input state
    write_ref,  # [T]                  plane receiving the state after token t, -1 for none
    q_ref,  # [T, Dk]
    k_ref,  # [T, Dk]
    v_ref,  # [T, BV]
    g_ref,  # [T]
    beta_ref,  # [T]
    pool_in_ref,  # [N, Dk, BV]         aliased with pool_ref
    o_ref,  # [T, BV]
    pool_ref,  # [N, Dk, BV]
    *,
    scale: float,
):
    n_tokens = q_ref.shape[0]
    state = pool_in_ref[read_ref[...]].astype(jnp.float32)  # [Dk, BV]

    def step(t, state):
        q = q_ref[t].astype(jnp.float32)  # [Dk]
        k = k_ref[t].astype(jnp.float32)  # [Dk]
        v = v_ref[t].astype(jnp.float32)  # [BV]
        state = state * jnp.exp(g_ref[t].astype(jnp.float32))
        recalled = jnp.sum(state * k[:, None], axis=0)  # [BV]
        delta = beta_ref[t].astype(jnp.float32) * (v - recalled)
        state = state + k[:, None] * delta[None, :]
        o_ref[t] = (jnp.sum(state * q[:, None], axis=0) * scale).astype(o_ref.dtype)
        plane = write_ref[t]

        @pl.when(plane >= 0)
        def _store():
            pool_ref[plane] = state.astype(pool_ref.dtype)

        return state

    jax.lax.fori_loop(0, n_tokens, step, state)


def recurrent_pallas_call(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, block_v, num_warps,
                          num_stages, interpret):
    """Build and run the `pallas_call`; shapes and meaning as `gdn_recurrent`."""
    n_rows, n_tokens, n_key_heads, dk = q.shape
    n_planes, n_value_heads, _, dv = ssm_pool.shape
    if dv % block_v:
        raise ValueError(f"Dv={dv} is not a multiple of block_v={block_v}")
    grid = (n_rows, n_value_heads, dv // block_v)
    key_head = lambda b, h, j: (b, 0, h % n_key_heads, 0)
    kernel = functools.partial(_recurrent_kernel, scale=dk**-0.5)
    pool_spec = pl.BlockSpec((n_planes, None, dk, block_v), lambda b, h, j: (0, h, 0, j))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, j: (b,)),  # read_plane
            pl.BlockSpec((None, n_tokens), lambda b, h, j: (b, 0)),  # write_planes
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
        name="gdn_recurrent",
    )(read_plane, write_planes, q, k, v, g, beta, ssm_pool)


# On an H100 at Qwen3-Next's GDN shapes, 32 columns and one warp per program read and write the state near a plain
# copy's bandwidth, well above 8 columns, and are also the fastest at batch 1 (bench/results/gpu/gdn-kernels.json,
# "tune"; docs/performance.md, "On a GPU").
DEFAULT_BLOCK_V = 32


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def gdn_recurrent(q, k, v, g, beta, ssm_pool, read_plane, write_planes, *, block_v: int | None = None,
                  num_warps: int = 1, num_stages: int = 2, interpret: bool = False):
    """Token-serial gated delta rule over snapshot planes, as a Pallas kernel.

    q, k:          [B, T, Hk, Dk]   L2-normalised; value head h uses key head h % Hk
    v:             [B, T, Hv, Dv]
    g, beta:       [B, T, Hv]       log-decay (<= 0) and write strength; padding tokens carry 0, 0
    ssm_pool:      [N, Hv, Dk, Dv]  float32 planes, updated in place (donate it under jit to avoid a copy)
    read_plane:    [B] int32        plane holding each row's input state
    write_planes:  [B, T] int32     plane receiving the state after token t, -1 for none
    block_v:       Dv columns per program (divides Dv; default min(Dv, 32)); Dk and block_v powers of two
    returns o [B, T, Hv, Dv] float32 (scaled by 1/sqrt(Dk)) and the pool [N, Hv, Dk, Dv].
    Reference: jaxmodel.kernels.reference.reference_pool_update.
    """
    dv = v.shape[-1]
    return recurrent_pallas_call(
        q, k, v, g, beta, ssm_pool, read_plane.astype(jnp.int32), write_planes.astype(jnp.int32),
        block_v=block_v or min(dv, DEFAULT_BLOCK_V), num_warps=num_warps, num_stages=num_stages, interpret=interpret)
