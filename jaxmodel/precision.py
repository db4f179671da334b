"""Weight precision per backend: bf16 matmul weights on accelerators, float32 on CPU.

On a GPU a decode step streams every weight once, so halving their bytes nearly halves the step; the matmuls take
bf16 activations and accumulate in float32 (`layers.linear`), and everything that carries state stays float32 (the
residual stream, norms, the GDN recurrence and its planes, the conv state, KV pages). On CPU XLA's bf16 matmuls are
slower than its float32 ones, so weights stay float32 there (dequantised from the file as before).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from .kernels.cpu_matmul import row_groups
from .weights import BlockRows, Transposed, Weights

WEIGHT_DTYPES = ("float32", "bfloat16")

# 2-D (or larger) arrays that are not matmul weights, or whose rounding would change a discrete choice:
# the depthwise conv taps (applied elementwise to the conv window), MoE routers (top-k selection) and the block
# scales of Q8_0 weights (`weights.Q8Rows`).
KEPT_FLOAT32 = frozenset({"conv", "router", "scales"})
# 2-D arrays that `transpose_matmul_weights` leaves as they are: embedding tables (row lookups, not products) and
# the same non-matmul or discrete-choice arrays as above.
NOT_TRANSPOSED = KEPT_FLOAT32 | {"embed"}
# Weights the few-row kernel takes: at least this many inputs and bytes. Shorter rows leave it summing lanes more
# than streaming, and small weights stay in cache, where XLA's own one-row product is faster: the kernel slowed
# the bundled model (short rows, small weights) and sped up the 0.8B shape's steps (`bench/cpu_kernel.py`;
# docs/performance.md, "Model step").
TRANSPOSE_MIN_INPUTS = 512
TRANSPOSE_MIN_BYTES = 1 << 20


def default_weight_dtype(backend: str | None = None) -> str:
    """$GDNSPEC_WEIGHT_DTYPE if set; else bfloat16 on GPU and TPU, float32 on CPU (the current default backend
    when none is given)."""
    chosen = os.environ.get("GDNSPEC_WEIGHT_DTYPE")
    if chosen:
        if chosen not in WEIGHT_DTYPES:
            raise ValueError(f"GDNSPEC_WEIGHT_DTYPE={chosen!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
        return chosen
    return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def cast_matmul_weights(weights: Weights, dtype: str) -> Weights:
    """`weights` with every float32 matmul weight and embedding table (arrays of 2 or more dims, but not those named
    in KEPT_FLOAT32) in `dtype`, and every `BlockRows` weight dequantized to `dtype` in the step; vectors (norms,
    biases, decay parameters) stay as they are. Tied arrays stay tied."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    target = jnp.dtype(dtype)

    def chosen(name, x) -> bool:
        return np.ndim(x) >= 2 and name not in KEPT_FLOAT32 and x.dtype == np.float32  # F16 kept for F16 parity

    def cast(x):
        return np.asarray(x, dtype=target) if isinstance(x, np.ndarray) else x.astype(target)

    def computed_in_target(x):  # blocks stay blocks; their dequantized values are rounded to dtype in the step
        return dataclasses.replace(x, compute_dtype=dtype) if isinstance(x, BlockRows) else x

    weights = jax.tree_util.tree_map(computed_in_target, weights, is_leaf=lambda x: isinstance(x, BlockRows))
    return _convert_tied_once(weights, chosen, cast)


def _convert_tied_once(weights: Weights, chosen, convert) -> Weights:
    """`weights` with convert(x) in place of every leaf x for which chosen(field name, x) holds; an array shared by
    several fields (tied weights) is converted once and stays shared."""
    converted: dict[int, object] = {}

    def visit(path, x):
        if not chosen(getattr(path[-1], "name", None), x):
            return x
        if id(x) not in converted:
            converted[id(x)] = convert(x)
        return converted[id(x)]

    return jax.tree_util.tree_map_with_path(visit, weights)


def group_block_rows(tree, tables=()):
    """`tree` (the weights, or one layer) with every 2-D float32 `BlockRows` weight of a type this machine's CPU
    products over row groups take (`cpu_matmul.row_groups`: Q4_0, and Q4_K, Q5_K and Q6_K with the 512-bit forms)
    in row groups (`BlockRows.grouped`); `tables` (embedding tables, whose rows are looked up, and the heads tied to
    them) and MoE expert stacks stay in the file's order. A weight shared by several fields is converted once and stays shared."""
    kept = {id(t) for t in tables}
    converted: dict[int, BlockRows] = {}
    types = row_groups()

    def visit(x):
        if (not isinstance(x, BlockRows) or id(x) in kept or x.blocks.ndim != 2 or x.row_group != 1
                or x.compute_dtype != "float32" or x.qtype not in types):
            return x
        if id(x) not in converted:
            converted[id(x)] = x.grouped()
        return converted[id(x)]

    return jax.tree_util.tree_map(visit, tree, is_leaf=lambda x: isinstance(x, BlockRows))


def takes_rows_kernel(name: str | None, x) -> bool:
    """Whether `transpose_matmul_weights` stores the leaf `name` (its field name) transposed for the kernel."""
    return (np.ndim(x) == 2 and name not in NOT_TRANSPOSED and x.dtype == np.float32
            and x.shape[0] >= TRANSPOSE_MIN_INPUTS and x.size * 4 >= TRANSPOSE_MIN_BYTES)


def transpose_matmul_weights(weights: Weights) -> Weights:
    """`weights` with every 2-D float32 matmul weight [n_in, n_out] of at least TRANSPOSE_MIN_INPUTS inputs and
    TRANSPOSE_MIN_BYTES stored as `Transposed` ([n_out, n_in]), the layout of the CPU few-row kernel
    (`jaxmodel.kernels.cpu_matmul`); embeddings, conv taps, routers, MoE expert stacks (3-D), f16/bf16 weights and
    smaller weights stay as they are. Tied arrays stay tied, and an output head that is the embedding's
    transpose shares the embedding's array. The old and new arrays coexist until the caller drops the
    old tree (load time only)."""
    embed = weights.embed

    def transpose(x):
        if isinstance(embed, np.ndarray) and x.shape == embed.shape[::-1] and np.array_equal(x.T, embed):
            return Transposed(embed)
        return Transposed(np.ascontiguousarray(np.asarray(x).T))

    return _convert_tied_once(weights, takes_rows_kernel, transpose)
