"""Weight precision per backend: bf16 matmul weights on accelerators, float32 on CPU.

On a GPU a decode step streams every weight once, so halving their bytes nearly halves the step; the matmuls take
bf16 activations and accumulate in float32 (`layers.linear`), and everything that carries state stays float32 (the
residual stream, norms, the GDN recurrence and its planes, the conv state, KV pages). On CPU XLA's bf16 matmuls are
slower than its float32 ones, so weights stay float32 there (dequantised from the file as before).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from .weights import Weights

WEIGHT_DTYPES = ("float32", "bfloat16")

# 2-D (or larger) arrays that are not matmul weights, or whose rounding would change a discrete choice:
# the depthwise conv taps (applied elementwise to the conv window) and MoE routers (top-k selection).
KEPT_FLOAT32 = frozenset({"conv", "router"})


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
    in KEPT_FLOAT32) in `dtype`; vectors (norms, biases, decay parameters) stay as they are. Tied arrays stay tied."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    target = jnp.dtype(dtype)
    converted: dict[int, object] = {}

    def cast(path, x):
        name = getattr(path[-1], "name", None)
        if np.ndim(x) < 2 or name in KEPT_FLOAT32 or x.dtype != np.float32:
            return x  # F16 weights kept for exact F16 parity stay F16
        if id(x) not in converted:
            converted[id(x)] = np.asarray(x, dtype=target) if isinstance(x, np.ndarray) else x.astype(target)
        return converted[id(x)]

    return jax.tree_util.tree_map_with_path(cast, weights)
