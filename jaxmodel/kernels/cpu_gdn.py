"""The token-serial gated delta rule over snapshot planes on CPU, as an XLA FFI custom call (cpu_gdn.cc): each
(row, value head) keeps its state in cache through the step's tokens and writes it into the planes named for it,
in place, in one fixed order, so a token's state is the same bits in a decoding step, a verify step and replay's
rebuild. Differentiable: its VJP is `recurrent_scan`'s (training
runs the same model code on CPU).

Built with the other CPU kernels (`cpu_matmul.build`, `cpu_matmul.available`). `jaxmodel.delta_rule` takes it on CPU
for every step, prompt chunks included (and replay's rebuild); the specification it is tested against is
`reference.reference_pool_update` (tests/test_cpu_gdn.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .cpu_matmul import TARGET_GDN


def gdn_recurrent_cpu(q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens):
    """Token-serial gated delta rule over snapshot planes, by the CPU kernel (requires `cpu_matmul.available()`).

    q, k:          [B, T, Hk, Dk]   L2-normalised; value head h uses key head h % Hk
    v:             [B, T, Hv, Dv]
    g, beta:       [B, T, Hv]       log-decay (<= 0) and write strength
    ssm_pool:      [N, Hv, Dk, Dv]  float32 planes, updated in place (donate it under jit to avoid a copy)
    read_plane:    [B] int32        plane holding each row's input state (clamped into the pool, as a gather)
    write_planes:  [B, T] int32     plane receiving the state after token t, -1 (or outside the pool) for none
    n_tokens:      [B] int32        the row's real tokens: from there on tokens are padding (output 0, no write)
    returns o [B, T, Hv, Dv] float32 (scaled by 1/sqrt(Dk)) and the pool [N, Hv, Dk, Dv].
    Every row reads its state before any row writes.
    """
    if ssm_pool.dtype != jnp.float32:
        raise ValueError(f"gdn_recurrent_cpu takes a float32 pool; got {ssm_pool.dtype}")
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
    return _differentiable(f32(q), f32(k), f32(v), f32(g), f32(beta), ssm_pool, i32(read_plane), i32(write_planes),
                           i32(n_tokens))


def _call(q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens):
    B, T = write_planes.shape
    out = (jax.ShapeDtypeStruct((B, T, v.shape[2], v.shape[3]), jnp.float32),
           jax.ShapeDtypeStruct(ssm_pool.shape, jnp.float32))
    return jax.ffi.ffi_call(TARGET_GDN, out, vmap_method="sequential", input_output_aliases={5: 1})(
        q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens)


def _xla_form(q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens):
    """The kernel's function in jnp (`recurrent_scan`, padding tokens masked): what its gradient is taken of."""
    from jaxmodel.delta_rule import recurrent_scan

    real = jnp.arange(write_planes.shape[1])[None, :] < n_tokens[:, None]  # [B, T]
    n_planes = ssm_pool.shape[0]
    writes = jnp.where(real & (write_planes < n_planes), write_planes, -1)
    out, pool = recurrent_scan(q, k, v, g, beta, ssm_pool, jnp.clip(read_plane, 0, n_planes - 1), writes)
    return jnp.where(real[..., None, None], out, 0.0), pool


@jax.custom_vjp
def _differentiable(q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens):
    return _call(q, k, v, g, beta, ssm_pool, read_plane, write_planes, n_tokens)


def _forward(*args):
    return _call(*args), args


def _backward(args, cotangents):
    *floats, read_plane, write_planes, n_tokens = args
    _, vjp = jax.vjp(lambda *f: _xla_form(*f, read_plane, write_planes, n_tokens), *floats)
    return (*vjp(cotangents), None, None, None)


_differentiable.defvjp(_forward, _backward)
