"""Mixture-of-experts FFN: softmax router, top-k experts renormalised, plus a sigmoid-gated shared expert.

    p = softmax(x Wr);  top-k of p;  w = p_sel / max(sum p_sel, 6.1035e-5)
    y = sum_j w_j down_j(silu(gate_j x) * up_j x) + sigmoid(x . w_sh) down_s(silu(gate_s x) * up_s x)

`moe_ffn_dense` evaluates every expert and zeroes the unselected ones: the reference. `moe_ffn` reads only the
routed experts' weights: for steps with few tokens (decode, verify) it gathers each token's k experts by index;
for longer steps it sorts the (token, expert) pairs by expert and runs a grouped matmul, one expert's weights per
tile of rows, so each routed expert's weights are read once per step however many of its tokens there are.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import as_matmul_input, dense_ffn, linear
from .weights import DenseFfn, MoeFfn

GROUP_TILE = 8  # rows per tile of the grouped matmul; each expert's rows are padded to a multiple of it


def route(w: MoeFfn, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., E] -> expert ids [..., k] and their renormalised weights [..., k]."""
    probs = jax.nn.softmax(linear(x, w.router), axis=-1)  # [..., X]
    top_p, top_i = jax.lax.top_k(probs, cfg.n_expert_used)
    return top_i, top_p / jnp.maximum(jnp.sum(top_p, axis=-1, keepdims=True), 6.1035e-5)


def shared_expert(w: MoeFfn, x: jax.Array) -> jax.Array:
    """x [..., E] -> [..., E]."""
    shared = linear(jax.nn.silu(linear(x, w.shared_gate)) * linear(x, w.shared_up), w.shared_down)
    return jax.nn.sigmoid(jnp.sum(x * w.shared_router, axis=-1, keepdims=True)) * shared


def moe_ffn_dense(w: MoeFfn, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The reference: every expert on every token, unselected experts weighted 0. x [..., E] -> [..., E]."""
    top_i, top_w = route(w, cfg, x)
    weights = jnp.sum(jax.nn.one_hot(top_i, cfg.n_expert, dtype=x.dtype) * top_w[..., None], axis=-2)  # [..., X]
    xg, xu = as_matmul_input(x, w.gate), as_matmul_input(x, w.up)
    hidden = jax.nn.silu(jnp.einsum("...e,xef->...xf", xg, w.gate)) * jnp.einsum("...e,xef->...xf", xu, w.up)
    per_expert = jnp.einsum("...xf,xfe->...xe", as_matmul_input(hidden, w.down), w.down)
    routed = jnp.einsum("...xe,...x->...e", per_expert, weights)
    return routed + shared_expert(w, x)


def routed_gathered(w: MoeFfn, x: jax.Array, top_i: jax.Array, top_w: jax.Array) -> jax.Array:
    """Each token's k experts gathered by index: N*k expert weight reads. x [N, E], top_i/top_w [N, k] -> [N, E]."""
    xg, xu = as_matmul_input(x, w.gate), as_matmul_input(x, w.up)
    f32 = jnp.float32
    hidden = jax.nn.silu(jnp.einsum("ne,nkef->nkf", xg, w.gate[top_i], preferred_element_type=f32)) * jnp.einsum(
        "ne,nkef->nkf", xu, w.up[top_i], preferred_element_type=f32
    )  # [N, k, Fe]
    out = jnp.einsum("nkf,nkfe->nke", as_matmul_input(hidden, w.down), w.down[top_i], preferred_element_type=f32)
    return jnp.einsum("nke,nk->ne", out, top_w)


def _expert_swiglu(w: MoeFfn, expert: jax.Array, x: jax.Array) -> jax.Array:
    """One expert on rows x [n, E] -> [n, E]."""
    gate = linear(x, w.gate[expert])
    return linear(jax.nn.silu(gate) * linear(x, w.up[expert]), w.down[expert])


def routed_grouped(w: MoeFfn, x: jax.Array, top_i: jax.Array, top_w: jax.Array, tile: int = GROUP_TILE) -> jax.Array:
    """Grouped matmul over (token, expert) pairs sorted by expert. x [N, E], top_i/top_w [N, k] -> [N, E].

    Each expert's pairs are padded to whole tiles, so every tile has one expert; tiles past the last used one are
    skipped. A used expert adds at most one partial tile, which bounds the (static) tile count.
    """
    N, E = x.shape
    k, X = top_i.shape[1], w.gate.shape[0]
    A = N * k
    expert = top_i.reshape(A)
    order = jnp.argsort(expert, stable=True)  # [A] pairs sorted by expert
    sorted_expert = expert[order]
    sizes = jnp.bincount(expert, length=X)  # [X]
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    slot = (padded_end - padded)[sorted_expert] + jnp.arange(A) - (jnp.cumsum(sizes) - sizes)[sorted_expert]  # [A]
    n_tiles = -(-A // tile) + min(X, A)
    rows = n_tiles * tile
    token = jnp.full(rows, N, jnp.int32).at[slot].set((order // k).astype(jnp.int32))  # N: the zero row
    weight = jnp.zeros(rows, jnp.float32).at[slot].set(top_w.reshape(A)[order])
    starts = jnp.arange(n_tiles) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), X - 1)  # [n_tiles]
    tile_used = starts < padded_end[-1]
    xs = jnp.concatenate([x, jnp.zeros((1, E), x.dtype)])[token].reshape(n_tiles, tile, E)

    def one_tile(args):
        rows_x, e, used = args
        return jax.lax.cond(used, lambda: _expert_swiglu(w, e, rows_x), lambda: jnp.zeros_like(rows_x))

    ys = jax.lax.map(one_tile, (xs, tile_expert, tile_used)).reshape(rows, E)
    return jnp.zeros((N + 1, E), jnp.float32).at[token].add(ys * weight[:, None])[:N]


def moe_ffn(w: MoeFfn, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Reads only the routed experts. x [..., E] -> [..., E]; equals `moe_ffn_dense` up to summation order."""
    lead, E = x.shape[:-1], x.shape[-1]
    n_tokens = math.prod(lead)
    flat = x.reshape(n_tokens, E)
    top_i, top_w = route(w, cfg, flat)
    # Gathering copies N*k expert matrices; the grouped form reads each used expert once but pays tile padding.
    if n_tokens * cfg.n_expert_used <= cfg.n_expert:
        routed = routed_gathered(w, flat, top_i, top_w)
    else:
        routed = routed_grouped(w, flat, top_i, top_w)
    return (routed + shared_expert(w, flat)).reshape(*lead, E)


def ffn(w: DenseFfn | MoeFfn, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return dense_ffn(w, x) if isinstance(w, DenseFfn) else moe_ffn(w, cfg, x)
