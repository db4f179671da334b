"""Building blocks of the qwen35 forward pass (docs/model.md §4): norms, rope, paged gated attention, FFNs."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp

from .attention import attend
from .config import ModelConfig
from .kernels import cpu_matmul, row_product
from .kernels.cpu_matmul import (block_rows_matmul, block_rows_matmul_prologue, prologue_reference, q8_rows_matmul,
                                 q8_rows_matmul_prologue, rows_matmul)
from .weights import Attention, BlockRows, DenseFfn, Fused, GatheredInputs, MatmulWeight, Q8Rows, Transposed


@dataclass(frozen=True)
class Prologued:
    """A product's input still to be computed from x by one of the Q8_0 product's prologues (an RMS norm, SwiGLU's
    gate, the GDN output's gated norm; `cpu_matmul.q8_rows_matmul_prologue`). `linear` hands it to that kernel
    where the weight is Q8_0 blocks, which computes each live row just before quantizing it, and uses `value()`
    (jnp) with any other weight. At the bundled model's sizes each norm or gate cost XLA two or three operations
    that took longer to launch than to run."""

    prologue: str  # "rms_norm" | "swiglu" | "gated_rms_norm"
    x: jax.Array  # [..., K]; swiglu: [..., 2K], gate then up
    weight: jax.Array | None = None  # rms_norm: [K]; gated_rms_norm: [G], K a multiple of G
    gate: jax.Array | None = None  # gated_rms_norm: [..., K]
    eps: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n = self.x.shape
        return (*lead, n // 2 if self.prologue == "swiglu" else n)

    def value(self) -> jax.Array:
        return prologue_reference(self.prologue, self.x, self.weight, self.gate, self.eps)


def rms_normed(x: jax.Array, w: jax.Array, eps: float) -> Prologued:
    """rms_norm(x, w, eps) as a product's input (`Prologued`)."""
    return Prologued("rms_norm", x, w, eps=eps)


def as_array(x: jax.Array | Prologued) -> jax.Array:
    """x itself, or a `Prologued` input's value, for a consumer other than a product (the MoE router)."""
    return x.value() if isinstance(x, Prologued) else x


def as_matmul_input(x: jax.Array, w: jax.Array) -> jax.Array:
    """ggml's CPU kernels round the activation to f16 before a matmul with f16 weights; so do we, which is
    what F16 parity with llama.cpp needs. bf16 weights (the accelerator default, `jaxmodel.precision`) take a bf16
    activation, the product accumulating in float32. Weights loaded as float32 (the CPU default) take x unchanged."""
    if w.dtype == jnp.float16:
        return x.astype(jnp.float16).astype(jnp.float32)
    return x.astype(jnp.bfloat16) if w.dtype == jnp.bfloat16 else x


def matmul_precision(w: jax.Array) -> jax.lax.Precision:
    """float32 weights get IEEE float32 products everywhere (a GPU's default for float32 is TF32, which would break
    parity with llama.cpp); bf16 and f16 weights run at the backend's native rate."""
    return jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else jax.lax.Precision.DEFAULT


# Small-row products on XLA's CPU backend (see linear()). jaxlib 0.10 runs an f32 dot of one row with XLA's own
# matrix-vector kernel but hands every dot of 2+ rows to YNNPACK, which costs several times the one-row product at
# the 0.8B model's shapes although both stream the same weights once (docs/performance.md, "Model step").
ROWS_SPLIT_MAX = 2  # up to this many rows: one matrix-vector product per row
ROWS_SPLIT_MAX_WIDE = 4  # ... up to this many when n_out >= WIDE_N_OUT (the LM head)
WIDE_N_OUT = 16384
EIGEN_ROWS_MAX = 32  # above this (prefill chunks) YNNPACK's matrix product wins


def small_row_form(m: int, w: jax.Array) -> str:
    """Which product `linear` runs for m rows times w: "dot", "rows", "eigen", "pair" or "kernel" (see linear)."""
    n_out = w.shape[1]
    on_gpu = jax.default_backend() == "gpu"
    if (on_gpu and m <= row_product.MAX_ROWS and os.environ.get("GDNSPEC_GPU_ROW_KERNEL") == "1"
            and w.shape[0] * n_out < row_product.XLA_GEMM_MIN_ELEMENTS and row_product.plan(w.shape[0], n_out)):
        return "kernel"
    if m == 1 and on_gpu and os.environ.get("GDNSPEC_GPU_PAIR_ROWS") == "1":
        return "pair"
    if m <= 1 or m > EIGEN_ROWS_MAX or w.dtype != jnp.float32 or jax.default_backend() != "cpu":
        return "dot"
    return "rows" if m <= (ROWS_SPLIT_MAX_WIDE if n_out >= WIDE_N_OUT else ROWS_SPLIT_MAX) else "eigen"


def eigen_dot(x: jax.Array, w: jax.Array, precision: jax.lax.Precision) -> jax.Array:
    """x [M, K] @ w [K, N] as dot_general(x^T, w) contracting dim 0 of both. YNNPACK declines a column-major lhs, so
    XLA runs the product with Eigen; the barrier keeps XLA from folding the transpose back into a row-major dot."""
    xt = jax.lax.optimization_barrier(x.T)
    return jax.lax.dot_general(xt, w, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def paired_row_dot(x: jax.Array, w: jax.Array, precision: jax.lax.Precision) -> jax.Array:
    """x [1, K] @ w [K, N] as a product of two rows, x beside itself, whose two equal results are averaged (exactly:
    (a + a) / 2 = a). XLA's GPU compiler rewrites a vector-matrix dot whose matrix has fewer than 10 M elements into
    a multiply and a reduce ("dot strength reduction"), which at one row reads the weights at a fraction of the
    bandwidth a matrix product does (docs/performance.md, "On a GPU"); the barrier keeps it from seeing that the rows
    are one. GPU only, and only with GDNSPEC_GPU_PAIR_ROWS=1 until measured."""
    pair = jax.lax.optimization_barrier(jnp.concatenate([x, x]))
    y = jnp.dot(pair, w, preferred_element_type=jnp.float32, precision=precision)
    return (y[:1] + y[1:]) * 0.5


def _multiplies_blocks(w: BlockRows) -> bool:
    """Whether the CPU block product takes w as it is (else `linear` multiplies its dequantized values)."""
    return (w.blocks.ndim == 2 and w.compute_dtype == "float32" and w.qtype in cpu_matmul.BLOCK_TYPES
            and cpu_matmul.block_kernels())


def linear(x: jax.Array | Prologued, w: MatmulWeight, bias: jax.Array | None = None,
           live: jax.Array | None = None) -> jax.Array:
    """x [..., n_in] @ w [n_in, n_out] -> [..., n_out], float32.

    x `Prologued`: its value, which the Q8_0 kernel computes row by row (`q8_rows_matmul_prologue`), and jnp for
    other weights (or where the kernel library lacks the prologues: `cpu_matmul.TARGET_Q8_PROLOGUE` None).

    live [...] (bool, x's leading shape; optional): which rows are real. The CPU kernels (Q8_0 and transposed
    weights below) skip the others, padding of a step's shape bucket, and return 0 (plus the bias) for them; other
    forms compute every row. A row's result never depends on whether the other rows are live.

    w kept as its file's blocks (`BlockRows`: K-quants, Q4_0, Q5_0, IQ4_XS): the block product on CPU
    (`cpu_matmul.block_rows_matmul`), x quantized as llama.cpp quantizes it for the type; elsewhere, or for a type
    the kernels lack, the weight dequantized inside the step (`quant_blocks.dequantize`) and multiplied as float32.

    w kept as Q8_0 blocks (`Q8Rows`, what `load_model` does on CPU for a Q8_0 file when the kernels build): the
    Q8_0 product for every M (`cpu_matmul.q8_rows_matmul`), llama.cpp's CPU arithmetic, x's rows quantized to Q8_0;
    row m of the result does not depend on the other rows.

    w stored transposed (`Transposed`, [n_out, n_in], what `load_model` does on CPU when the kernel builds): the
    rows kernel (`jaxmodel.kernels.cpu_matmul.rows_matmul`) for every M, which reads each weight row once for a
    tile of rows and sums every row in the same order whatever M, so a token's product is the same in a prompt
    chunk as in a one-token step. (XLA's dot on [n_out, n_in] is a little faster on a full 128-row chunk but
    computes the padding too, so it loses on a partly filled chunk; docs/performance.md, "Padding costs nothing".)

    w as an array: the formulation is fixed at trace time from M and w (`small_row_form`); all compute the same f32
    product, only the summation order differs. On CPU, for float32 w:
      M <= 1 or M > 32: the plain dot;
      M = 2 (M <= 4 when n_out >= 16384, the LM head): M separate one-row products, each at the one-row rate;
      otherwise (M = 3..32): the dot on x^T (`eigen_dot`), which XLA runs with Eigen instead of YNNPACK.
    On GPU with GDNSPEC_GPU_PAIR_ROWS=1, one row multiplies as a pair of rows (`paired_row_dot`); with
    GDNSPEC_GPU_ROW_KERNEL=1, up to `row_product.MAX_ROWS` rows run the few-row product kernel
    (`kernels.row_product`), where its `plan` takes the weight's shape. Both off until measured on a GPU.
    The rule follows `python -m bench.matmul_cpu --summarize bench/results/matmul-cpu.json`: against the plain dot,
    over one 0.8B step's products, the one-row products gain at M = 2 and the dot on x^T at 3-32, about even at 64
    and twice as slow at 256 (docs/performance.md, "Model step"). Cache-resident weights (the bundled model's) gain
    more in the step than that chained benchmark shows (Eigen's few-row products cost a fraction of YNNPACK's there;
    `bench/results/small-weights-cpu.json`), so they take the same rule. f16/bf16 weights and other backends take
    the plain dot (no gain measured, or not measured).
    """
    if isinstance(w, GatheredInputs):
        return _gathered_linear(x, w, bias, live)
    lead = x.shape[:-1]
    m = math.prod(lead)
    live_rows = None if live is None else jnp.broadcast_to(live, lead).reshape(m)
    if isinstance(w, BlockRows) and not _multiplies_blocks(w):
        w = w.dequantized()
    if isinstance(x, Prologued):
        gate = None if x.gate is None else x.gate.reshape(m, -1)
        if isinstance(w, Q8Rows) and cpu_matmul.TARGET_Q8_PROLOGUE is not None:
            y = q8_rows_matmul_prologue(x.prologue, x.x.reshape(m, -1), w.quants, w.scales, live_rows, x.weight,
                                        gate, x.eps).reshape(*lead, w.shape[1])
            return y if bias is None else y + bias
        if isinstance(w, BlockRows):
            y = block_rows_matmul_prologue(x.prologue, x.x.reshape(m, -1), w.blocks, w.qtype, live_rows, x.weight,
                                           gate, x.eps, w.row_group).reshape(*lead, w.shape[1])
            return y if bias is None else y + bias
        x = x.value()
    x = as_matmul_input(x, w)
    precision = matmul_precision(w)
    n_in, n_out = w.shape[0], w.shape[1]
    if isinstance(w, Q8Rows):
        form = "q8_0"
    elif isinstance(w, BlockRows):
        form = "blocks"
    elif isinstance(w, Transposed):
        form = "transposed"
    else:
        form = small_row_form(m, w)
    if form == "q8_0":
        y = q8_rows_matmul(x.reshape(m, n_in), w.quants, w.scales, live_rows).reshape(*lead, n_out)
    elif form == "blocks":
        y = block_rows_matmul(x.reshape(m, n_in), w.blocks, w.qtype, live_rows, w.row_group).reshape(*lead, n_out)
    elif form == "transposed":
        y = rows_matmul(x.reshape(m, n_in), w.t, live_rows).reshape(*lead, n_out)
    elif form == "dot":
        y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32, precision=precision)
    elif form == "rows":
        rows = x.reshape(m, n_in)
        y = jnp.stack([jnp.dot(rows[i], w, preferred_element_type=jnp.float32, precision=precision)
                       for i in range(m)]).reshape(*lead, n_out)
    elif form == "pair":
        y = paired_row_dot(x.reshape(1, n_in), w, precision).reshape(*lead, n_out)
    elif form == "kernel":
        y = row_product.row_product(x.reshape(m, n_in), w, interpret=jax.default_backend() != "gpu")
        y = y.reshape(*lead, n_out)
    else:
        y = eigen_dot(x.reshape(m, n_in), w, precision).reshape(*lead, n_out)
    return y if bias is None else y + bias


def _gathered_linear(x: jax.Array | Prologued, w: GatheredInputs, bias, live) -> jax.Array:
    """`linear` for a `GatheredInputs` weight, inside `shard_map`: x [..., K / n] this device's inputs (a gated norm's
    input and gate both, its heads whole)."""
    gather = lambda a: jnp.take(jax.lax.all_gather(a, w.axis, axis=-1, tiled=True), jnp.asarray(w.order), axis=-1)
    if isinstance(x, Prologued) and x.prologue == "gated_rms_norm":
        x = dataclasses.replace(x, x=gather(x.x), gate=gather(x.gate))
    else:
        x = gather(as_array(x))
    y = linear(x, w.w, bias, live)
    return jnp.where(jax.lax.axis_index(w.axis) == 0, y, 0.0)


def project(x: jax.Array | Prologued, ws: Sequence[MatmulWeight | Fused | None],
            biases: Sequence[jax.Array | None] | None = None, live: jax.Array | None = None) -> list[jax.Array]:
    """[linear(x, w, b, live) for w, b in zip(ws, biases)] for weights as `weights.fuse_fields` stores them: a
    `Fused` weight stands for itself and the None fields after it, and runs as one product whose output is split."""
    out = []
    for w in ws:
        if isinstance(w, Fused):
            y = linear(x, w.w, live=live)
            out.extend(jnp.split(y, list(itertools.accumulate(w.sizes[:-1])), axis=-1))
        elif w is not None:
            out.append(linear(x, w, live=live))
    if len(out) != len(ws):
        raise ValueError(f"{len(ws)} projections expected, the weights hold {len(out)}")
    return [y if b is None else y + b for y, b in zip(out, biases or [None] * len(out), strict=True)]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (GGUF norm weights already hold HF's +1)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (ggml's rms_norm(x, eps/n) / sqrt(n))."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """NEOX-style rotation of the first R dims of each head, as imrope does for text tokens (docs/model.md §4.4).

    x [B, T, H, D], positions [B, T] -> [B, T, H, D]
    """
    half = cfg.rope_dim // 2
    inv_freq = cfg.rope_theta ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / cfg.rope_dim)
    inv_freq = inv_freq * jnp.asarray(cfg.rope_position_mask())
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, R/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], axis=-1)


def _attention_inputs(w: Attention, cfg: ModelConfig, x: jax.Array | Prologued, positions: jax.Array,
                      valid: jax.Array):
    """x [B, T, E] normed (or its `Prologued` norm), positions and valid [B, T] -> q [B, T, H, D] and its gate
    [B, T, H, D] (q normed and rotated), k, v [B, T, Hkv, D] (k normed and rotated)."""
    B, T, _ = x.shape
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    qg, k, v = project(x, (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias), live=valid)
    qg = qg.reshape(B, T, H, 2 * D)
    q = rope(rms_norm(qg[..., :D], w.q_norm, cfg.norm_eps), positions, cfg)
    k = rope(rms_norm(k.reshape(B, T, Hkv, D), w.k_norm, cfg.norm_eps), positions, cfg)
    return q, qg[..., D:], k, v.reshape(B, T, Hkv, D)


def _write_pages(k_pages, v_pages, k, v, positions, valid, page_table):
    """The pages [n_pages, page_size, Hkv, D] with k, v [B, T, Hkv, D] written at positions [B, T]; padding tokens
    (valid False) write into page 0, the trash page."""
    page_size = k_pages.shape[1]
    page = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    page = jnp.where(valid, page, 0)  # [B, T]
    slot = positions % page_size
    return k_pages.at[page, slot].set(k.astype(k_pages.dtype)), v_pages.at[page, slot].set(v.astype(v_pages.dtype))


def paged_attention(
    w: Attention,
    cfg: ModelConfig,
    x: jax.Array | Prologued,  # [B, T, E] normed input
    positions: jax.Array,  # [B, T]
    valid: jax.Array,  # [B, T] bool, False for padding tokens
    page_table: jax.Array,  # [B, P]
    k_pages: jax.Array,  # [n_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [n_pages, page_size, Hkv, D]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated causal attention over a paged KV cache (docs/model.md §4.1). Writes this step's K/V, then attends.

    Padding tokens write into page 0, the trash page. Only pages up to the batch's last live position are read
    (`jaxmodel.attention`), so the width P of the page table costs nothing. Returns y [B, T, E] and the updated
    pages.
    """
    B, T, _ = x.shape
    q, gate, k, v = _attention_inputs(w, cfg, x, positions, valid)
    k_pages, v_pages = _write_pages(k_pages, v_pages, k, v, positions, valid, page_table)
    out = attend(q, k_pages, v_pages, page_table, positions, valid).reshape(B, T, -1)
    out = out * jax.nn.sigmoid(gate.reshape(B, T, -1))
    return linear(out, w.o, live=valid), k_pages, v_pages


def write_kv(
    w: Attention, cfg: ModelConfig, x: jax.Array | Prologued, positions: jax.Array, valid: jax.Array,
    page_table: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The K/V `paged_attention` writes for the same inputs (shapes as there), bit for bit, without attending:
    a token's K and V depend on its own input only. Returns the updated pages."""
    _, _, k, v = _attention_inputs(w, cfg, x, positions, valid)
    return _write_pages(k_pages, v_pages, k, v, positions, valid, page_table)


def dense_ffn(w: DenseFfn, x: jax.Array | Prologued, live: jax.Array | None = None) -> jax.Array:
    """SwiGLU: (silu(x Wg) * x Wu) Wd. x [..., E], live [...] (see `linear`) -> [..., E]."""
    if isinstance(w.gate, Fused) and w.up is None and len(w.gate.sizes) == 2:
        hidden = Prologued("swiglu", linear(x, w.gate.w, live=live))  # gate and up as one product's halves
    else:
        gate, up = project(x, (w.gate, w.up), live=live)
        hidden = jax.nn.silu(gate) * up
    return linear(hidden, w.down, live=live)
