"""Pallas kernel: causal attention over the paged KV cache for decode and verify steps (few query tokens).

One program per (row b, KV head h). Its queries are the row's T tokens times the G = H / Hkv query heads that
share KV head h, laid out token-major as M rows (padded to a power of two >= 16, Triton's smallest matmul).
It walks the row's own pages, `pages_per_block` at a time, reading each block's pages through the page table,
with an online softmax (running max, running sum, accumulator), and stops after the row's last live page:
a row costs its own context, whatever the width of the page table; a padding row costs nothing.

Written for the Triton backend of Pallas (`jax.experimental.pallas.triton`); runs under `interpret=True` on
CPU. Tested against `paged_attention_reference` below (tests/test_paged_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so that a query with nothing to attend to yet (a padding row, or a block entirely in its future)
# gives exp(0) instead of exp(-inf - -inf) = nan; masked keys still get exactly 0 once a real key was seen.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
HIGHEST = jax.lax.Precision.HIGHEST  # IEEE float32 on GPU (its default for float32 dots is TF32)


def live_pages(positions: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    """Pages [B] each row attends to: through its last valid position; 0 for a padding row.

    positions, valid [B, T] -> [B] int32
    """
    last = jnp.max(jnp.where(valid, positions, -1), axis=1)
    return (last // page_size + 1).astype(jnp.int32)


def query_scores(q: jax.Array, keys: jax.Array, per_query: bool = False) -> jax.Array:
    """q [B, T, Hkv, G, D] . keys [B, S, Hkv, D] over D -> [B, Hkv, G, T, S] (unscaled).

    per_query: each score is its D products summed by XLA's reduction, in an order that does not depend on T.
    A dot's order does: XLA's CPU backend picks its product by the number of query rows (T x G), so a token's
    attention differed in its last bits between a decoding step and an 8-token verify step, and where
    activations are quantized to Q8_0 such bits can flip a rounding and change later tokens."""
    if not per_query:
        return jnp.einsum("btkgd,bskd->bkgts", q, keys, precision=HIGHEST)
    return jnp.sum(jnp.transpose(q, (0, 2, 3, 1, 4))[:, :, :, :, None, :]
                   * jnp.transpose(keys, (0, 2, 1, 3))[:, :, None, None], axis=-1)  # fmt: skip


def weighted_values(p: jax.Array, values: jax.Array, per_query: bool = False) -> jax.Array:
    """p [B, Hkv, G, T, S] . values [B, S, Hkv, D] over S -> [B, Hkv, G, T, D]; per_query as `query_scores`."""
    if not per_query:
        return jnp.einsum("bkgts,bskd->bkgtd", p, values, precision=HIGHEST)
    return jnp.sum(p[..., None] * jnp.transpose(values, (0, 2, 1, 3))[:, :, None, None], axis=-2)


def paged_attention_reference(q, k_pages, v_pages, page_table, positions, *, per_query: bool = False):
    """The full-table form: every row gathers every page of its page table, then one masked softmax.

    q:           [B, T, H, D]      roped queries; query head h uses KV head h // (H / Hkv)
    k_pages:     [N, S, Hkv, D]    the pool, S = page_size
    v_pages:     [N, S, Hkv, D]
    page_table:  [B, P] int32      page of positions [p * S, (p+1) * S)
    positions:   [B, T] int32      each query attends to keys at positions <= its own
    per_query:   the products as `query_scores` sums them, a query's output then the same bits whatever T
    returns      [B, T, H, D] float32. Costs O(P) per row whatever the context.
    """
    B, T, H, D = q.shape
    Hkv = k_pages.shape[2]
    keys = k_pages[page_table].reshape(B, -1, Hkv, D).astype(jnp.float32)  # [B, P*S, Hkv, D]
    values = v_pages[page_table].reshape(B, -1, Hkv, D).astype(jnp.float32)
    q = q.reshape(B, T, Hkv, H // Hkv, D)
    scores = query_scores(q, keys, per_query) * (D**-0.5)  # [B, Hkv, G, T, P*S]
    key_pos = jnp.arange(keys.shape[1])
    causal = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, P*S]
    scores = jnp.where(causal[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return weighted_values(probs, values, per_query).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _paged_attention_kernel(
    n_pages_ref,  # []          pages this row reads, 0 for a padding row
    table_ref,  # [Pp]          the row's page table, padded to whole blocks
    qpos_ref,  # [M]            position of each query row, -1 for padding (sees nothing)
    q_ref,  # [M, D]            query row t * G + g: token t, query head g of this KV head
    k_ref,  # [N, S, D]         this KV head's slice of the pool
    v_ref,  # [N, S, D]
    o_ref,  # [M, D]
    *,
    pages_per_block: int,
    scale: float,
    precision,
):
    n_rows, head_dim = q_ref.shape
    block_keys = pages_per_block * k_ref.shape[1]
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    q = q_ref[...].astype(jnp.float32)  # [M, D]
    qpos = qpos_ref[...]  # [M]

    def block(j, carry):
        m, l, acc = carry  # [M], [M], [M, D]
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)]  # [PB]
        k = k_ref[pages].reshape(block_keys, head_dim).astype(jnp.float32)  # [PB*S, D]
        v = v_ref[pages].reshape(block_keys, head_dim).astype(jnp.float32)
        key_pos = j * block_keys + jnp.arange(block_keys)  # [PB*S]
        scores = jnp.where(key_pos[None, :] <= qpos[:, None], dot(q, k.T) * scale, MASK_VALUE)  # [M, PB*S]
        m_next = jnp.maximum(m, jnp.max(scores, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[:, None])
        return m_next, correction * l + jnp.sum(p, axis=1), correction[:, None] * acc + dot(p, v)

    init = (jnp.full((n_rows,), MASK_VALUE, jnp.float32), jnp.zeros((n_rows,), jnp.float32),
            jnp.zeros((n_rows, head_dim), jnp.float32))
    n_blocks = (n_pages_ref[...] + pages_per_block - 1) // pages_per_block
    _, l, acc = jax.lax.fori_loop(0, n_blocks, block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    o_ref[...] = jnp.where(qpos[:, None] >= 0, out, 0.0).astype(o_ref.dtype)


def paged_attention_pallas_call(q_rows, qpos, k_pages, v_pages, table, n_pages, *, pages_per_block, precision,
                                num_warps, num_stages, interpret):
    """Build and run the `pallas_call` on query rows already grouped per KV head.

    q_rows [B, Hkv, M, D], qpos [B, M], table [B, Pp] (Pp a multiple of pages_per_block), n_pages [B]
    -> [B, Hkv, M, D] float32
    """
    n_rows, n_kv_heads, m, head_dim = q_rows.shape
    n_pool, page_size = k_pages.shape[:2]
    kernel = functools.partial(_paged_attention_kernel, pages_per_block=pages_per_block, scale=head_dim**-0.5,
                               precision=precision)
    pool_spec = pl.BlockSpec((n_pool, page_size, None, head_dim), lambda b, h: (0, 0, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(n_rows, n_kv_heads),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h: (b,)),  # n_pages
            pl.BlockSpec((None, table.shape[1]), lambda b, h: (b, 0)),  # table
            pl.BlockSpec((None, m), lambda b, h: (b, 0)),  # qpos
            pl.BlockSpec((None, None, m, head_dim), lambda b, h: (b, h, 0, 0)),  # q
            pool_spec,  # k_pages
            pool_spec,  # v_pages
        ],
        out_specs=pl.BlockSpec((None, None, m, head_dim), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention",
    )(n_pages, table, qpos, q_rows, k_pages, v_pages)


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=("pages_per_block", "precision", "num_warps", "num_stages",
                                             "interpret"))
def paged_attention_kernel(q, k_pages, v_pages, page_table, positions, valid, *, pages_per_block: int = 4,
                           precision=jax.lax.Precision.HIGHEST, num_warps: int = 8, num_stages: int = 2,
                           interpret: bool = False):
    """Causal attention over the paged KV cache, as a Pallas kernel, for steps of few query tokens.

    q:                [B, T, H, D]     roped queries; query head h uses KV head h // (H / Hkv)
    k_pages:          [N, S, Hkv, D]   the pool (this step's K/V already written), S = page_size
    v_pages:          [N, S, Hkv, D]
    page_table:       [B, P] int32     page of positions [p * S, (p+1) * S); only live pages are read
    positions:        [B, T] int32     each query attends to keys at positions <= its own
    valid:            [B, T] bool      False for padding tokens (their output is 0); a row reads its pages
                                       through its last valid position, a padding row none
    pages_per_block:  pages per step of the loop (rounded to a power of two, at most P's power of two);
                      the page table is padded with page 0 to whole blocks
    precision:        of the in-kernel matmuls (HIGHEST: IEEE float32 on GPU)
    num_warps, pages_per_block: sized so that a block's K and V ([64, 256] float32 each at D = 256) fit in
                      registers; estimates, not yet measured on a GPU
    returns           [B, T, H, D] float32.
    Per program M = T * H / Hkv query rows, padded to a power of two >= 16: meant for T up to ~16.
    D and S * pages_per_block must be powers of two (Triton block shapes).
    Reference: paged_attention_reference (equal on valid tokens).
    """
    B, T, H, D = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = H // n_kv_heads
    rows = T * group
    m = max(16, _power_of_two(rows))
    q_rows = q.reshape(B, T, n_kv_heads, group, D).transpose(0, 2, 1, 3, 4).reshape(B, n_kv_heads, rows, D)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, m - rows), (0, 0)))  # [B, Hkv, M, D]
    qpos = jnp.repeat(jnp.where(valid, positions, -1), group, axis=1)
    qpos = jnp.pad(qpos, ((0, 0), (0, m - rows)), constant_values=-1).astype(jnp.int32)  # [B, M]
    block = min(_power_of_two(pages_per_block), _power_of_two(page_table.shape[1]))
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % block))).astype(jnp.int32)  # [B, Pp]
    n_pages = live_pages(positions, valid, page_size)
    out = paged_attention_pallas_call(q_rows, qpos, k_pages, v_pages, table, n_pages, pages_per_block=block,
                                      precision=precision, num_warps=num_warps, num_stages=num_stages,
                                      interpret=interpret)  # [B, Hkv, M, D]
    out = out[:, :, :rows].reshape(B, n_kv_heads, T, group, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, H, D)
