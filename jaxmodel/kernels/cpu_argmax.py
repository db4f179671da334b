"""The index of each row's largest value on CPU, as an XLA FFI custom call (cpu_argmax.cc): greedy decoding's and
greedy verification's token, and each MTP draft's.

XLA's CPU backend reduces (value, index) pairs one element at a time; the kernel compares eight lanes at once and
picks what `jnp.argmax` picks (the first of equal maxima, the first NaN where there is one), so greedy output does
not change. Built with the other CPU kernels (`cpu_matmul.build`, `cpu_matmul.available`); `greedy_tokens` takes it
where they are available. Tests: tests/test_cpu_argmax.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu_matmul
from .cpu_matmul import TARGET_ARGMAX


def argmax_rows(x: jax.Array) -> jax.Array:
    """x [..., V] float32 -> [...] int32, the index of each row's largest value, by the kernel (requires
    `cpu_matmul.available()`); equal to `jnp.argmax(x, axis=-1)`."""
    if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"argmax_rows takes float32 x [..., V] with V >= 1; got {x.dtype}{x.shape}")
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call(TARGET_ARGMAX, out, vmap_method="broadcast_all")(x)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> [...] int32, each row's argmax: by the kernel on CPU where it is built, else XLA's."""
    if jax.default_backend() == "cpu" and logits.dtype == jnp.float32 and cpu_matmul.available():
        return argmax_rows(logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
