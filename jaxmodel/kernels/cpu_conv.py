"""The GDN mixer's causal depthwise conv on CPU, its sums as an XLA FFI custom call (cpu_conv.cc), silu by XLA: the
channels are the vector lanes, and each sum is one fixed chain of FMAs from the oldest tap (XLA's order at one
token), so a channel's value is the same bits in a decoding step, a verify step, a prompt chunk, a batch of any size
and replay's rebuild (which convolves some channels alone). Differentiable: its VJP is the reference's (training runs
the same model code on CPU).

`causal_conv_planes_cpu` is the same conv reading each row's history from the GDN mixer's conv planes and writing
the state after each token back in place, as `causal_conv_planes_reference` does in jnp.

Built with the other CPU kernels (`cpu_matmul.build`, `cpu_matmul.available`); `jaxmodel.gdn` takes it on CPU where
they are available, for steps of more than one token or row. Tests: tests/test_cpu_conv.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu_matmul


def causal_conv_reference(prev: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array | None = None
                          ) -> jax.Array:
    """The specification, in jnp: silu of the causal depthwise conv over each row's window [prev | x]. XLA's form,
    which `gdn.causal_conv` takes for steps of one row of one token and off CPU.

    prev:     [B, C, Kc-1]  a conv plane: the row's Kc-1 earlier raw inputs, oldest first
    x:        [B, T, C]     this step's raw inputs
    w:        [C, Kc]       taps, oldest first (GGUF's order)
    n_tokens: [B] int       the row's tokens; from n_tokens[b] on, padding (None: all T are tokens)
    returns   [B, T, C]:    out[b, t, c] = silu(sum_j window[b, c, t + j] w[c, j]), window = [prev | x^T] [B, C, Kc-1+T];
                            0 at padding
    """
    return jnp.where(_live(n_tokens, x)[..., None], jax.nn.silu(_conv_sums(prev, x, w)), 0.0)


def _conv_sums(prev, x, w):
    T = x.shape[1]
    window = jnp.concatenate([prev, jnp.swapaxes(x, 1, 2)], axis=2)  # [B, C, Kc-1+T]
    taps = jnp.stack([window[:, :, j : j + T] for j in range(w.shape[1])], axis=-1)  # [B, C, T, Kc]
    return jnp.einsum("bctk,ck->btc", taps, w)


def _lengths(n_tokens, x):
    B, T = x.shape[:2]
    return jnp.full((B,), T, jnp.int32) if n_tokens is None else jnp.asarray(n_tokens, jnp.int32)


def _live(n_tokens, x):  # [B, T]
    return jnp.arange(x.shape[1])[None, :] < _lengths(n_tokens, x)[:, None]


def causal_conv_cpu(prev: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array | None = None) -> jax.Array:
    """`causal_conv_reference` by the CPU kernel (requires `cpu_matmul.available()`); shapes as there, float32.
    Equal to the reference within float32 rounding, and bit for bit where XLA sums the taps as the kernel does (one
    FMA per tap from the oldest: at one token); an output depends on its own channel's inputs only, computed alike
    for every B, T and C. Padding tokens cost nothing."""
    if prev.ndim != 3 or x.ndim != 3 or w.ndim != 2:
        raise ValueError(f"causal_conv_cpu takes prev [B, C, Kc-1], x [B, T, C], w [C, Kc]; got "
                         f"{prev.shape}, {x.shape}, {w.shape}")
    B, T, C = x.shape
    if prev.shape != (B, C, w.shape[1] - 1) or w.shape[0] != C:
        raise ValueError(f"causal_conv_cpu: prev {prev.shape}, x {x.shape} and w {w.shape} disagree "
                         f"(prev [B, C, Kc-1], x [B, T, C], w [C, Kc])")
    if n_tokens is not None and jnp.shape(n_tokens) != (B,):
        raise ValueError(f"causal_conv_cpu: n_tokens {jnp.shape(n_tokens)} is not [B] = [{B}]")
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)  # noqa: E731
    return jax.nn.silu(_differentiable(f32(prev), f32(x), f32(w), _lengths(n_tokens, x)))


def _call(prev, x, w, n_tokens):
    # The kernel reads the history and the taps' weights as rows of channels ([B, Kc-1, C], [Kc, C]), as it reads x.
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return jax.ffi.ffi_call(cpu_matmul.TARGET_CONV, out, vmap_method="sequential")(
        jnp.swapaxes(prev, 1, 2), x, w.T, n_tokens)


@jax.custom_vjp
def _differentiable(prev, x, w, n_tokens):
    return _call(prev, x, w, n_tokens)


def _forward(prev, x, w, n_tokens):
    return _call(prev, x, w, n_tokens), (prev, x, w, n_tokens)


def _backward(args, cotangent):
    prev, x, w, n_tokens = args
    live = _live(n_tokens, x)[..., None]
    _, vjp = jax.vjp(lambda p, x, w: jnp.where(live, _conv_sums(p, x, w), 0.0), prev, x, w)
    return (*vjp(cotangent), None)


_differentiable.defvjp(_forward, _backward)


def causal_conv_planes_reference(planes: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array,
                                 read_plane: jax.Array, write_planes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The conv with its state in planes, in jnp: each row reads its history from a plane and stores the state after
    each of its tokens in another, as the GDN mixer keeps its conv state.

    planes:       [N, C, Kc-1]  conv planes: a row's Kc-1 latest raw inputs, oldest first
    x:            [B, T, C]     this step's raw inputs
    w:            [C, Kc]       taps, oldest first
    n_tokens:     [B] int       the row's tokens; the rest are padding
    read_plane:   [B] int       the plane holding the row's history (clamped into [0, N))
    write_planes: [B, T] int    where the state after token t goes; outside [0, N): nowhere
    returns       (out [B, T, C] as `causal_conv_reference`, planes with the written states)
    """
    sums, planes = _planes_sums(planes, x, w, n_tokens, read_plane, write_planes)
    return jax.nn.silu(sums), planes  # silu(0) = 0: padding stays 0


def _planes_sums(planes, x, w, n_tokens, read_plane, write_planes):
    """The planes kernel's results in jnp: the sums (0 at padding; not their silu) and the planes written."""
    N, T, Kc = planes.shape[0], x.shape[1], w.shape[1]
    prev = planes[jnp.clip(read_plane, 0, N - 1)]  # [B, C, Kc-1]
    window = jnp.concatenate([prev, jnp.swapaxes(x, 1, 2).astype(planes.dtype)], axis=2)  # [B, C, Kc-1+T]
    after = jnp.stack([window[:, :, t + 1 : t + Kc] for t in range(T)], axis=1)  # [B, T, C, Kc-1]
    targets = jnp.where((write_planes < 0) | (write_planes >= N), N, write_planes).reshape(-1)
    planes = planes.at[targets].set(after.reshape(-1, *planes.shape[1:]), mode="drop")
    return jnp.where(_live(n_tokens, x)[..., None], _conv_sums(prev, x, w), 0.0), planes


def causal_conv_planes_cpu(planes: jax.Array, x: jax.Array, w: jax.Array, n_tokens: jax.Array,
                           read_plane: jax.Array, write_planes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`causal_conv_planes_reference` by the CPU kernel (requires `cpu_matmul.available()`), float32: the history
    read from its plane, the sums as `causal_conv_cpu` computes them (the same bits), the states written in place,
    without XLA's gather, concatenation and scatter around the conv. Every row reads its plane before any row
    writes. Differentiable (the reference's VJP)."""
    if planes.ndim != 3 or x.ndim != 3 or w.ndim != 2:
        raise ValueError(f"causal_conv_planes_cpu takes planes [N, C, Kc-1], x [B, T, C], w [C, Kc]; got "
                         f"{planes.shape}, {x.shape}, {w.shape}")
    B, T, C = x.shape
    if planes.shape[1:] != (C, w.shape[1] - 1) or w.shape[0] != C:
        raise ValueError(f"causal_conv_planes_cpu: planes {planes.shape}, x {x.shape} and w {w.shape} disagree "
                         f"(planes [N, C, Kc-1], x [B, T, C], w [C, Kc])")
    if jnp.shape(n_tokens) != (B,) or jnp.shape(read_plane) != (B,) or jnp.shape(write_planes) != (B, T):
        raise ValueError(f"causal_conv_planes_cpu: n_tokens {jnp.shape(n_tokens)}, read_plane "
                         f"{jnp.shape(read_plane)} and write_planes {jnp.shape(write_planes)} are not [B], [B] and "
                         f"[B, T] = [{B}], [{B}], [{B}, {T}]")
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    sums, planes = _planes_differentiable(planes.astype(jnp.float32), x.astype(jnp.float32),
                                          w.astype(jnp.float32), i32(n_tokens), i32(read_plane), i32(write_planes))
    return jax.nn.silu(sums), planes


def _planes_call(planes, x, w, n_tokens, read_plane, write_planes):
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(planes.shape, jnp.float32))
    return jax.ffi.ffi_call(cpu_matmul.TARGET_CONV_PLANES, out, vmap_method="sequential",
                            input_output_aliases={0: 1})(planes, x, w, n_tokens, read_plane, write_planes)


@jax.custom_vjp
def _planes_differentiable(planes, x, w, n_tokens, read_plane, write_planes):
    return _planes_call(planes, x, w, n_tokens, read_plane, write_planes)


def _planes_forward(planes, x, w, n_tokens, read_plane, write_planes):
    args = (planes, x, w, n_tokens, read_plane, write_planes)
    return _planes_call(*args), args


def _planes_backward(args, cotangents):
    planes, x, w, n_tokens, read_plane, write_planes = args
    _, vjp = jax.vjp(lambda p, x, w: _planes_sums(p, x, w, n_tokens, read_plane, write_planes), planes, x, w)
    return (*vjp(cotangents), None, None, None)


_planes_differentiable.defvjp(_planes_forward, _planes_backward)
