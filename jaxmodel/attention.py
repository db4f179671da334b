"""Causal attention over the paged KV cache (docs/model.md §4.1), costing what the live context costs.

This module is the one place that chooses how attention over pages runs; `layers.paged_attention` calls
`attend` and never an implementation directly. Every row carries the page table of a full-length sequence
(`Shapes` in jaxmodel/executor/runtime.py), so reading the whole table would make a step cost --max-model-len; both
implementations stop at the last live page instead, with a bound computed on device (no new shapes).
The specification they are tested against is `jaxmodel.kernels.paged_attention.paged_attention_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_attention import paged_attention_cpu
from jaxmodel.kernels.paged_attention import (
    MASK_VALUE,
    live_pages,
    paged_attention_kernel,
    paged_attention_reference,
    query_scores,
    weighted_values,
)
from jaxmodel.xla_flags import step_invariant

# Implementations `attend(impl=...)` accepts: the full-table form, the jnp loop over blocks of pages, the Pallas
# kernel, the CPU kernel.
IMPLEMENTATIONS = ("reference", "blocked", "pallas", "cpu")
# Pages per iteration of the jnp loop, measured on CPU (see `attention_blocked`).
PAGES_PER_BLOCK = 8
# On GPU the kernel takes steps of up to this many query tokens per row (decode and verify); longer prefill
# chunks use the jnp loop, whose [T, keys] score blocks the kernel would have to hold per program.
GPU_KERNEL_MAX_TOKENS = 16
# On CPU the kernel (`kernels.cpu_attention`) takes every step whose score buffer (one tile of a task's queries,
# at most CPU_KERNEL_TILE of its T x H / Hkv, times the page table's keys, in float32) fits in this; wider steps (a
# page table of about a million positions) take the jnp loop over blocks of pages.
CPU_KERNEL_MAX_SCORE_BYTES = 64 << 20
CPU_KERNEL_TILE = 16  # cpu_attention.cc's kTile
# Benchmarks set this (and PAGES_PER_BLOCK) to force an implementation in a model step; read when it is traced.
FORCE_IMPL: str | None = None


def attention_blocked(q, k_pages, v_pages, page_table, positions, valid, *, pages_per_block: int = PAGES_PER_BLOCK,
                      per_query: bool = False):
    """Flash-style attention over blocks of pages, up to the last live page of the batch.

    q [B, T, H, D] roped; k_pages, v_pages [N, S, Hkv, D]; page_table [B, P]; positions, valid [B, T]
    -> [B, T, H, D] float32, equal to the reference on valid tokens.
    The loop runs ceil(max live pages / pages_per_block) times: the longest valid row sets it, padding rows
    (n_tokens = 0) never do. Each block gathers [B, pages_per_block * S] keys and updates a running max,
    sum and accumulator.
    pages_per_block, measured on this project's shared 2-core CPU (bench/attention.py, results in
    bench/results/attention-cpu.json): attention alone, 16 rows (4 of them padding) of ~100 tokens, T = 1,
    page tables for max_model_len 8192, ms for 4 / 8 / 16 pages: 0.52 / 0.36 / 0.54 at the bundled model's
    heads (H=4, Hkv=2, D=32), 2.9 / 1.4 / 3.7 at Qwen3.5-0.8B's (H=8, Hkv=2, D=256); the full table 84 and 589.
    per_query: the products as `query_scores` and `weighted_values` make them.
    """
    B, T, H, D = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    block = min(pages_per_block, page_table.shape[1])
    block_keys = block * page_size
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % block)))  # [B, Pp]
    n_blocks = (jnp.max(live_pages(positions, valid, page_size)) + block - 1) // block
    q = q.reshape(B, T, n_kv_heads, H // n_kv_heads, D)
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)  # numpy pools cannot take traced indices

    def step(j, carry):
        m, l, acc = carry  # [B, Hkv, G, T], [B, Hkv, G, T], [B, Hkv, G, T, D]
        pages = jax.lax.dynamic_slice_in_dim(table, j * block, block, axis=1)  # [B, PB]
        keys = k_pages[pages].reshape(B, block_keys, n_kv_heads, D).astype(jnp.float32)  # [B, PB*S, Hkv, D]
        values = v_pages[pages].reshape(B, block_keys, n_kv_heads, D).astype(jnp.float32)
        scores = query_scores(q, keys, per_query) * (D**-0.5)  # [B, Hkv, G, T, PB*S]
        key_pos = j * block_keys + jnp.arange(block_keys)
        causal = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, PB*S]
        scores = jnp.where(causal[:, None, None], scores, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(scores, axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[..., None])
        acc = correction[..., None] * acc + weighted_values(p, values, per_query)
        return m_next, correction * l + jnp.sum(p, axis=-1), acc

    stats = (B, n_kv_heads, H // n_kv_heads, T)
    init = (jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats + (D,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def choose_implementation(backend: str, n_tokens: int, n_pages: int, cpu_kernel: bool = False,
                          kernel_score_bytes: int = 0) -> str:
    """The implementation `attend` runs for this backend ("cpu", "gpu", ...), tokens per row and page-table width;
    cpu_kernel: whether the CPU kernels are built here (`cpu_matmul.available()`); kernel_score_bytes: the score
    buffer the CPU kernel would hold per task (`kernel_score_bytes`).

    On CPU the kernel takes decode, verify and prefill steps alike: it computes each query alone in one order, so a
    token's attention is the same bits whether its step feeds 1, 4 or 128 tokens (a decoding row batched with a
    prompt chunk included), and a 32-token batch of the bundled model scores as llama.cpp's does
    (tests/test_cpu_q8_matmul.py). It is also faster than XLA's per-query products on prompt chunks
    (docs/performance.md, "Prefill on CPU", which measures it on a 128-token step of the 0.8B shape). Otherwise
    decode and verify steps take a kernel, and a table of at most one block has nothing to skip: it takes the
    reference form, which (unlike a loop with a dynamic bound) can also be differentiated, as training does over
    whole sequences.
    """
    if backend == "cpu" and cpu_kernel and kernel_score_bytes <= CPU_KERNEL_MAX_SCORE_BYTES:
        return "cpu"
    if n_pages <= PAGES_PER_BLOCK:
        return "reference"
    if backend == "gpu" and n_tokens <= GPU_KERNEL_MAX_TOKENS:
        return "pallas"
    return "blocked"


def kernel_score_bytes(q_shape, k_pages_shape, n_pages: int) -> int:
    """Bytes of the CPU kernel's per-task score buffer for q [B, T, H, D], pages [N, S, Hkv, D] and a page table of
    n_pages: a tile of the T x H / Hkv queries (at most CPU_KERNEL_TILE) by n_pages x S keys, float32."""
    _, T, H, _ = q_shape
    _, S, Hkv, _ = k_pages_shape
    return min(T * (H // Hkv), CPU_KERNEL_TILE) * n_pages * S * 4


def attend(q, k_pages, v_pages, page_table, positions, valid, *, impl: str | None = None):
    """Shapes as `attention_blocked`; dispatches to the implementation for this backend and shape.

    impl: force one of IMPLEMENTATIONS (tests and benchmarks); the Pallas kernel runs interpreted off GPU, the CPU
    kernel needs the CPU backend.
    A token's attention must not depend on how many tokens its step feeds, so that a verify step computes what
    decoding steps would, bit for bit: the CPU kernel computes each query alone, and where it is not built the jnp
    forms sum per query on CPU (`query_scores`, unless `step_invariant()` is off).
    """
    backend = jax.default_backend()
    impl = impl or FORCE_IMPL or choose_implementation(
        backend, q.shape[1], page_table.shape[1], backend == "cpu" and cpu_matmul.available(),
        kernel_score_bytes(q.shape, k_pages.shape, page_table.shape[1]))
    per_query = backend == "cpu" and step_invariant()
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_table, positions, per_query=per_query)
    if impl == "blocked":
        return attention_blocked(q, k_pages, v_pages, page_table, positions, valid, pages_per_block=PAGES_PER_BLOCK,
                                 per_query=per_query)
    if impl == "cpu":
        return paged_attention_cpu(q, k_pages, v_pages, page_table, positions, valid)
    if impl == "pallas":
        return paged_attention_kernel(q, k_pages, v_pages, page_table, positions, valid, interpret=backend != "gpu")
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
