"""Mixture-of-experts FFN: softmax router, top-k experts renormalised, plus a sigmoid-gated shared expert.

    p = softmax(x Wr);  top-k of p;  w = p_sel / max(sum p_sel, 6.1035e-5)
    y = sum_j w_j down_j(silu(gate_j x) * up_j x) + sigmoid(x . w_sh) down_s(silu(gate_s x) * up_s x)

`moe_ffn_dense` evaluates every expert and zeroes the unselected ones: the reference. `moe_ffn` reads only the
routed experts' weights: for steps of a few tokens (one decode row, a short verify) each token reads its k
experts by index; for longer steps it sorts the (token, expert) pairs by expert and runs a grouped matmul, one
expert's weights per tile of rows, so each routed expert's weights are read about once per step however many of
its tokens there are. `jax.lax.ragged_dot` is the library's grouped matmul, but XLA's CPU backend lowers it to a
product masked over every expert, dearer than the dense form (bench/moe.py), hence the tiles.

Under expert parallelism (`jaxmodel.sharding`) a device holds a consecutive share of the experts: it routes every
token, runs only the pairs routed to its own experts (the others are skipped, not computed and zeroed), and the
caller sums the devices' outputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import Prologued, as_array, as_matmul_input, dense_ffn, linear, matmul_precision, project
from .weights import BlockRows, DenseFfn, MoeFfn

GATHER_MAX_TOKENS = 4  # steps with at most this many tokens read each pair's expert on its own
MAX_GROUP_TILE = 8  # most rows per tile of the grouped matmul; each expert's rows are padded to whole tiles


def route(w: MoeFfn, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., E] -> expert ids [..., k] and their renormalised weights [..., k]."""
    probs = jax.nn.softmax(linear(x, w.router), axis=-1)  # [..., X]
    top_p, top_i = jax.lax.top_k(probs, cfg.n_expert_used)
    return top_i, top_p / jnp.maximum(jnp.sum(top_p, axis=-1, keepdims=True), 6.1035e-5)


def shared_expert(w: MoeFfn, x: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """x [..., E], live [...] (see `layers.linear`) -> [..., E]."""
    shared_gate, shared_up = project(x, (w.shared_gate, w.shared_up), live=live)
    shared = linear(jax.nn.silu(shared_gate) * shared_up, w.shared_down, live=live)
    return jax.nn.sigmoid(jnp.sum(x * w.shared_router, axis=-1, keepdims=True)) * shared


def moe_ffn_dense(w: MoeFfn, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The reference: every expert on every token, unselected experts weighted 0. x [..., E] -> [..., E]."""
    top_i, top_w = route(w, cfg, x)
    weights = jnp.sum(jax.nn.one_hot(top_i, cfg.n_expert, dtype=x.dtype) * top_w[..., None], axis=-2)  # [..., X]
    w_gate, w_up, w_down = (e.dequantized() if isinstance(e, BlockRows) else e for e in (w.gate, w.up, w.down))
    xg, xu = as_matmul_input(x, w_gate), as_matmul_input(x, w_up)
    hidden = (jax.nn.silu(jnp.einsum("...e,xef->...xf", xg, w_gate, precision=matmul_precision(w_gate)))
              * jnp.einsum("...e,xef->...xf", xu, w_up, precision=matmul_precision(w_up)))
    per_expert = jnp.einsum("...xf,xfe->...xe", as_matmul_input(hidden, w_down), w_down,
                            precision=matmul_precision(w_down))
    routed = jnp.einsum("...xe,...x->...e", per_expert, weights)
    return routed + shared_expert(w, x)


def _expert_swiglu(w: MoeFfn, expert: jax.Array, x: jax.Array) -> jax.Array:
    """One expert, its weights read by index, on rows x [n, E] -> [n, E]."""
    gate = linear(x, w.gate[expert])
    return linear(jax.nn.silu(gate) * linear(x, w.up[expert]), w.down[expert])


def routed_gathered(w: MoeFfn, x: jax.Array, top_i: jax.Array, top_w: jax.Array,
                    owned: jax.Array | None = None) -> jax.Array:
    """Each (token, expert) pair reads its expert's weights by index: N*k expert reads, no copies (a gather of
    the weights into [N, k, E, Fe] first measured 2 to 8 times slower on CPU). x [N, E], top_i/top_w [N, k] ->
    [N, E]. owned [N, k]: the pairs whose expert this device holds (expert parallelism); the others add 0 and
    read nothing."""
    N, k = top_i.shape
    pairs = (jnp.repeat(x, k, axis=0), top_i.reshape(N * k))
    if owned is None:
        ys = jax.lax.map(lambda pair: _expert_swiglu(w, pair[1], pair[0][None])[0], pairs)  # [N k, E]
    else:

        def one_pair(pair):
            row, expert, mine = pair
            return jax.lax.cond(mine, lambda: _expert_swiglu(w, expert, row[None])[0], lambda: jnp.zeros_like(row))

        ys = jax.lax.map(one_pair, pairs + (owned.reshape(N * k),))
    return jnp.einsum("nke,nk->ne", ys.reshape(N, k, -1), top_w)


def group_tile(n_pairs: int, n_expert: int) -> int:
    """Rows per tile: about twice the expected pairs per used expert (a power of two, 1 to MAX_GROUP_TILE), so
    that padding stays below half of the rows while tiles stay few."""
    per_expert = 2 * n_pairs // min(n_expert, n_pairs)
    return min(MAX_GROUP_TILE, 1 << max(per_expert.bit_length() - 1, 0))


def routed_grouped(w: MoeFfn, x: jax.Array, top_i: jax.Array, top_w: jax.Array, tile: int | None = None,
                   owned: jax.Array | None = None) -> jax.Array:
    """Grouped matmul over (token, expert) pairs sorted by expert. x [N, E], top_i/top_w [N, k] -> [N, E].

    Each expert's pairs are padded to whole tiles, so every tile has one expert; tiles past the last used one are
    skipped. A used expert adds at most one partial tile, which bounds the (static) tile count. owned [N, k]: the
    pairs whose expert this device holds (expert parallelism); the others sort as one more expert, after the
    device's own, whose tiles are skipped.
    """
    N, E = x.shape
    k, X = top_i.shape[1], w.gate.shape[0]
    A = N * k
    tile = tile or group_tile(A, X)
    expert = top_i.reshape(A)
    n_sorted = X  # the experts the pairs sort into: the device's own, then (expert parallelism) the others as one
    if owned is not None:
        expert, n_sorted = jnp.where(owned.reshape(A), expert, X), X + 1
    order = jnp.argsort(expert, stable=True)  # [A] pairs sorted by expert
    sorted_expert = expert[order]
    sizes = jnp.bincount(expert, length=n_sorted)  # [n_sorted]
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    slot = (padded_end - padded)[sorted_expert] + jnp.arange(A) - (jnp.cumsum(sizes) - sizes)[sorted_expert]  # [A]
    n_tiles = -(-A // tile) + min(n_sorted, A)
    rows = n_tiles * tile
    token = jnp.full(rows, N, jnp.int32).at[slot].set((order // k).astype(jnp.int32))  # N: the zero row
    weight = jnp.zeros(rows, jnp.float32).at[slot].set(top_w.reshape(A)[order])
    starts = jnp.arange(n_tiles) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), X - 1)  # [n_tiles]
    tile_used = starts < padded_end[X - 1]
    xs = jnp.concatenate([x, jnp.zeros((1, E), x.dtype)])[token].reshape(n_tiles, tile, E)

    def one_tile(args):
        rows_x, e, used = args
        return jax.lax.cond(used, lambda: _expert_swiglu(w, e, rows_x), lambda: jnp.zeros_like(rows_x))

    ys = jax.lax.map(one_tile, (xs, tile_expert, tile_used)).reshape(rows, E)
    return jnp.zeros((N + 1, E), jnp.float32).at[token].add(ys * weight[:, None])[:N]


def moe_ffn(w: MoeFfn, cfg: ModelConfig, x: jax.Array, live: jax.Array | None = None,
            first_expert: jax.Array | None = None, add_shared: jax.Array | bool = True) -> jax.Array:
    """Reads only the routed experts. x [..., E] -> [..., E]; equals `moe_ffn_dense` up to summation order.
    live [...]: rows that are padding skip the shared expert's products (`layers.linear`); they are still routed.
    first_expert: w holds the router's experts first_expert, first_expert + 1, ... only (expert parallelism: a
    device's share; the pairs routed to other experts add nothing here); add_shared (may be traced): whether the
    shared expert is added (under expert parallelism, on one device of the experts' axis)."""
    lead, E = x.shape[:-1], x.shape[-1]
    n_tokens = math.prod(lead)
    flat = x.reshape(n_tokens, E)
    top_i, top_w = route(w, cfg, flat)
    owned, tile = None, None
    if first_expert is not None:
        n_own = w.gate.shape[0]
        top_i = top_i - first_expert
        owned = (top_i >= 0) & (top_i < n_own)
        top_i = jnp.clip(top_i, 0, n_own - 1)
        expected_pairs = max(n_tokens * cfg.n_expert_used * n_own // cfg.n_expert, 1)
        tile = group_tile(expected_pairs, n_own)
    if n_tokens <= GATHER_MAX_TOKENS:
        routed = routed_gathered(w, flat, top_i, top_w, owned)
    else:
        routed = routed_grouped(w, flat, top_i, top_w, tile, owned)
    routed = routed.reshape(*lead, E)
    if add_shared is True:
        return routed + shared_expert(w, x, live)
    return routed + jax.lax.cond(add_shared, lambda: shared_expert(w, x, live), lambda: jnp.zeros_like(x))


def ffn(w: DenseFfn | MoeFfn, cfg: ModelConfig, x: jax.Array | Prologued, live: jax.Array | None = None,
        **experts) -> jax.Array:
    """x [..., E] (or a `Prologued` input, which the dense FFN's product computes), live [...] (padding rows false;
    see `layers.linear`) -> [..., E]. experts: a MoE layer's expert-parallel share (`moe_ffn`)."""
    return dense_ffn(w, x, live) if isinstance(w, DenseFfn) else moe_ffn(w, cfg, as_array(x), live, **experts)
