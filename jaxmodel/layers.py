"""Building blocks of the qwen35 forward pass (docs/model.md §4): norms, rope, paged gated attention, FFNs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention import attend
from .config import ModelConfig
from .weights import Attention, DenseFfn


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


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x [..., n_in] @ w [n_in, n_out] -> [..., n_out], float32."""
    y = jnp.einsum("...i,io->...o", as_matmul_input(x, w), w, preferred_element_type=jnp.float32,
                   precision=matmul_precision(w))
    return y if bias is None else y + bias


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


def paged_attention(
    w: Attention,
    cfg: ModelConfig,
    x: jax.Array,  # [B, T, E] normed input
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
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    page_size = k_pages.shape[1]
    qg = linear(x, w.q, w.q_bias).reshape(B, T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = linear(x, w.k, w.k_bias).reshape(B, T, Hkv, D)
    v = linear(x, w.v, w.v_bias).reshape(B, T, Hkv, D)
    q = rope(rms_norm(q, w.q_norm, cfg.norm_eps), positions, cfg)
    k = rope(rms_norm(k, w.k_norm, cfg.norm_eps), positions, cfg)

    page = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    page = jnp.where(valid, page, 0)  # [B, T]
    slot = positions % page_size
    k_pages = k_pages.at[page, slot].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[page, slot].set(v.astype(v_pages.dtype))

    out = attend(q, k_pages, v_pages, page_table, positions, valid).reshape(B, T, H * D)
    out = out * jax.nn.sigmoid(gate.reshape(B, T, H * D))
    return linear(out, w.o), k_pages, v_pages


def dense_ffn(w: DenseFfn, x: jax.Array) -> jax.Array:
    """SwiGLU: (silu(x Wg) * x Wu) Wd. x [..., E] -> [..., E]."""
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)
