"""Causal attention over the paged KV cache on CPU, as an XLA FFI custom call (cpu_attention.cc): the queries that
share a KV head (a step's heads and tokens) walk the keys together, each key and value loaded once for up to four
of them, while each query's result is computed in one fixed order, so a token's attention is the same bits whatever
the number of tokens its step feeds; each row reads only its own live pages.

Built with the other CPU kernels (`cpu_matmul.build`, `cpu_matmul.available`). `jaxmodel.attention.attend` takes it
on CPU for decode, verify and prefill steps (`attention.choose_implementation`); the specification it is tested
against is `paged_attention.paged_attention_reference` (tests/test_cpu_attention.py), whose VJP is its gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .cpu_matmul import TARGET_ATTENTION, TARGET_ATTENTION_F16
from .paged_attention import paged_attention_reference


# The pages' dtypes the kernel reads; a float16 key or value is widened exactly as it is read.
PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))


def paged_attention_cpu(q, k_pages, v_pages, page_table, positions, valid):
    """Causal attention over the paged KV cache, by the CPU kernel (requires `cpu_matmul.available()`).

    q:           [B, T, H, D]     roped queries; query head h uses KV head h // (H / Hkv)
    k_pages:     [N, S, Hkv, D]   the pool (this step's K/V already written), S = page_size, float32 or float16
    v_pages:     [N, S, Hkv, D]
    page_table:  [B, P] int32     page of positions [p * S, (p+1) * S); only live pages are read
    positions:   [B, T] int32     each query attends to keys at positions <= its own
    valid:       [B, T] bool      False for padding tokens (their output is 0)
    returns      [B, T, H, D] float32, equal to the reference on valid tokens; query (b, t, h) depends on its own
                 q, position and row's pages only, summed in the same order for every T.
    A position past the page table, or a live table entry outside the pool, fails the call with a message.
    """
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in PAGE_DTYPES:
        raise ValueError(f"paged_attention_cpu takes float32 or float16 pages; got {k_pages.dtype}, {v_pages.dtype}")
    return _differentiable(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), positions, valid)


def _call(q, k_pages, v_pages, page_table, positions, valid):
    qpos = jnp.where(valid, positions, -1).astype(jnp.int32)  # [B, T]
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    target = TARGET_ATTENTION if k_pages.dtype == jnp.float32 else TARGET_ATTENTION_F16
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(q, k_pages, v_pages, page_table, qpos)


@jax.custom_vjp
def _differentiable(q, k_pages, v_pages, page_table, positions, valid):
    return _call(q, k_pages, v_pages, page_table, positions, valid)


def _forward(*args):
    return _call(*args), args


def _backward(args, cotangent):
    """The reference form's VJP (training's gradient); padding tokens, whose output is 0, pass none back."""
    q, k_pages, v_pages, page_table, positions, valid = args
    cotangent = jnp.where(valid[:, :, None, None], cotangent, 0.0)
    _, vjp = jax.vjp(lambda *f: paged_attention_reference(*f, page_table, positions), q, k_pages, v_pages)
    return (*vjp(cotangent), None, None, None)


_differentiable.defvjp(_forward, _backward)
