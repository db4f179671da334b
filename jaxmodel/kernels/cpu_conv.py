"""The GDN mixer's causal depthwise conv on CPU, its sums as an XLA FFI custom call (cpu_conv.cc), silu by XLA: the
channels are the vector lanes, and each sum is one fixed chain of FMAs from the oldest tap (XLA's order at one
token), so a channel's value is the same bits in a decoding step, a verify step, a prompt chunk, a batch of any size
and replay's rebuild (which convolves some channels alone). Differentiable: its VJP is the reference's (training runs
the same model code on CPU).

Built with the other CPU kernels (`cpu_matmul.build`, `cpu_matmul.available`); `jaxmodel.gdn.causal_conv` takes it
on CPU where they are available, for steps of more than one token. Tests: tests/test_cpu_conv.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu_matmul


def causal_conv_reference(history: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array | None = None
                          ) -> jax.Array:
    """The specification, in jnp: silu of the causal depthwise conv over each row's window [history | x].

    history:  [B, Kc-1, C]  the row's Kc-1 earlier raw inputs, oldest first (a conv plane)
    x:        [B, T, C]     this step's raw inputs
    w:        [C, Kc]       taps, oldest first (GGUF's order)
    n_tokens: [B] int       the row's tokens; from n_tokens[b] on, padding (None: all T are tokens)
    returns   [B, T, C]:    out[b, t, c] = silu(sum_j window[b, t + j, c] w[c, j]), window = [history | x] [B, Kc-1+T, C];
                            0 at padding
    """
    return jax.nn.silu(_conv_sums(history, x, w, _lengths(n_tokens, x)))


def _conv_sums(history, x, w, n_tokens):
    T, Kc = x.shape[1], w.shape[1]
    window = jnp.concatenate([history, x], axis=1)
    taps = jnp.stack([window[:, j : j + T] for j in range(Kc)], axis=-1)  # [B, T, C, Kc]
    live = jnp.arange(T)[None, :] < n_tokens[:, None]  # [B, T]
    return jnp.where(live[..., None], jnp.einsum("btck,ck->btc", taps, w), 0.0)


def _lengths(n_tokens, x):
    B, T = x.shape[:2]
    return jnp.full((B,), T, jnp.int32) if n_tokens is None else jnp.asarray(n_tokens, jnp.int32)


def causal_conv_cpu(history: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array | None = None) -> jax.Array:
    """`causal_conv_reference` by the CPU kernel (requires `cpu_matmul.available()`); shapes as there, float32.
    Equal to the reference within float32 rounding, and bit for bit where XLA sums the taps as the kernel does (one
    FMA per tap from the oldest: at one token); an output depends on its own channel's inputs only, computed alike
    for every B, T and C. Padding tokens cost nothing."""
    if history.ndim != 3 or x.ndim != 3 or w.ndim != 2:
        raise ValueError(f"causal_conv_cpu takes history [B, Kc-1, C], x [B, T, C], w [C, Kc]; got "
                         f"{history.shape}, {x.shape}, {w.shape}")
    B, T, C = x.shape
    if history.shape != (B, w.shape[1] - 1, C) or w.shape[0] != C:
        raise ValueError(f"causal_conv_cpu: history {history.shape}, x {x.shape} and w {w.shape} disagree "
                         f"(history [B, Kc-1, C], x [B, T, C], w [C, Kc])")
    if n_tokens is not None and jnp.shape(n_tokens) != (B,):
        raise ValueError(f"causal_conv_cpu: n_tokens {jnp.shape(n_tokens)} is not [B] = [{B}]")
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)  # noqa: E731
    return jax.nn.silu(_differentiable(f32(history), f32(x), f32(w), _lengths(n_tokens, x)))


def _call(history, x, w, n_tokens):
    # The kernel reads the taps' weights as rows of channels [Kc, C], as it reads the window.
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call(cpu_matmul.TARGET_CONV, out, vmap_method="sequential")(history, x, w.T, n_tokens)


@jax.custom_vjp
def _differentiable(history, x, w, n_tokens):
    return _call(history, x, w, n_tokens)


def _forward(history, x, w, n_tokens):
    return _call(history, x, w, n_tokens), (history, x, w, n_tokens)


def _backward(args, cotangent):
    history, x, w, n_tokens = args
    _, vjp = jax.vjp(lambda h, x, w: _conv_sums(h, x, w, n_tokens), history, x, w)
    return (*vjp(cotangent), None)


_differentiable.defvjp(_forward, _backward)
