"""Device state: KV page pools and GDN plane pools, and the per-step batch that indexes them (DESIGN.md "State").

Plane 0 is the null plane (all zeros: a new sequence reads it; nobody writes it) and page 0 is the trash page
(padding tokens write their K/V there), so allocatable planes are 1..n_planes-1 and pages 1..n_pages-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .weights import pytree

NULL_PLANE = 0
TRASH_PAGE = 0


@pytree
class ModelState:
    k_pages: tuple[jax.Array, ...]  # per attention layer (+1 for the MTP block): [n_pages, page_size, Hkv, D]
    v_pages: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]  # per GDN layer: [n_planes, C, Kc-1] raw pre-conv inputs, oldest first
    ssm: tuple[jax.Array, ...]  # per GDN layer: [n_planes, Hv, Dk, Dv] float32

    @property
    def n_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def n_planes(self) -> int:
        return self.ssm[0].shape[0] if self.ssm else 0


@pytree
class StepBatch:
    """One padded batch for the jitted step. Rows with n_tokens = 0 are padding rows."""

    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32
    n_tokens: jax.Array  # [B] int32, real tokens per row (a prefix of T)
    page_table: jax.Array  # [B, P] int32, KV page of positions [p * page_size, (p+1) * page_size)
    read_plane: jax.Array  # [B] int32, GDN plane holding each row's input state
    write_planes: jax.Array  # [B, T] int32, plane receiving the state after token t, -1 for none
    logit_rows: jax.Array  # [B, R] int32, token indices whose logits are returned


@pytree
class StepOutput:
    logits: jax.Array  # [B, R, V] at batch.logit_rows
    hidden: jax.Array  # [B, T, E] post-final-norm hidden state of every token (what MTP consumes)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype=jnp.float32) -> int:
    """K and V bytes of one page across all attention layers, the MTP block included."""
    layers = len(cfg.attn_layers) + cfg.n_mtp
    return 2 * layers * page_size * cfg.n_head_kv * cfg.head_dim * jnp.dtype(dtype).itemsize


def bytes_per_plane(cfg: ModelConfig) -> int:
    """Conv and SSM state bytes of one plane across all GDN layers (float32)."""
    per_layer = cfg.conv_channels * (cfg.conv_kernel - 1) + cfg.ssm_heads * cfg.ssm_state * cfg.ssm_state
    return 4 * per_layer * len(cfg.gdn_layers)


def init_state(cfg: ModelConfig, n_pages: int, n_planes: int, page_size: int = 16, kv_dtype=jnp.float32) -> ModelState:
    """Zeroed pools. n_pages and n_planes include the trash page and the null plane."""
    attn_layers = len(cfg.attn_layers) + cfg.n_mtp
    kv_shape = (n_pages, page_size, cfg.n_head_kv, cfg.head_dim)
    n_gdn = len(cfg.gdn_layers)
    return ModelState(
        k_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(attn_layers)),
        v_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(attn_layers)),
        conv=tuple(jnp.zeros((n_planes, cfg.conv_channels, cfg.conv_kernel - 1), jnp.float32) for _ in range(n_gdn)),
        ssm=tuple(jnp.zeros((n_planes, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state), jnp.float32) for _ in range(n_gdn)),
    )


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum): batch, token and page-table sizes are bucketed so few shapes compile."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def single_row_batch(
    tokens, start: int, pages, read_plane: int, write_planes, *, page_size: int, logit_rows=None, t_bucket=None
) -> StepBatch:
    """A batch of one sequence feeding `tokens` at positions start.., as numpy arrays padded to buckets."""
    n = len(tokens)
    T = t_bucket or bucket(n)
    P = bucket(len(pages))
    tok = np.zeros((1, T), np.int32)
    tok[0, :n] = tokens
    pos = np.zeros((1, T), np.int32)
    pos[0, :n] = np.arange(start, start + n)
    table = np.zeros((1, P), np.int32)
    table[0, : len(pages)] = pages
    writes = np.full((1, T), -1, np.int32)
    writes[0, :n] = write_planes
    rows = np.arange(T, dtype=np.int32)[None] if logit_rows is None else np.asarray(logit_rows, np.int32)[None]
    return StepBatch(
        tokens=tok,
        positions=pos,
        n_tokens=np.array([n], np.int32),
        page_table=table,
        read_plane=np.array([read_plane], np.int32),
        write_planes=writes,
        logit_rows=rows,
    )
