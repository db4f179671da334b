"""Device state: KV page pools and GDN plane pools, and the per-step batch that indexes them (docs/design.md "State: pools and tables").

Plane 0 is the null plane (all zeros: a new sequence reads it; nobody writes it) and page 0 is the trash page
(padding tokens write their K/V there), so allocatable planes are 1..n_planes-1 and pages 1..n_pages-1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .weights import pytree

NULL_PLANE = 0
TRASH_PAGE = 0


@pytree
class HeadBacklog:
    """The MTP head's held catch-up, per slot (one per running sequence whose request names the head): the MTP inputs
    of committed tokens whose head KV is not written yet. A row whose head does not draft in a call holds its
    catch-up here instead of running the head; the KV is written in one pass when the head drafts again or the
    slot would overflow (`jaxmodel.speculative.BacklogInputs`), and never where the sequence ends first."""

    tokens: jax.Array  # [S, D] int32
    positions: jax.Array  # [S, D] int32
    hidden: jax.Array  # [S, D, E] float32: h_{p-1}, the target's post-norm hidden before each token's position p

    @property
    def capacity(self) -> int:
        """Tokens one slot holds."""
        return self.tokens.shape[1]


@pytree
class ModelState:
    k_pages: tuple[jax.Array, ...]  # per attention layer (+1 for the MTP block): [n_pages, page_size, Hkv, D]
    v_pages: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]  # per GDN layer: [n_planes, C, Kc-1] raw pre-conv inputs, oldest first
    ssm: tuple[jax.Array, ...]  # per GDN layer: [n_planes, Hv, Dk, Dv] float32
    # [n_planes, E] the target's post-norm hidden after the plane's last token: what the MTP block pairs with the
    # next token. Kept beside the GDN state so that every rollback moves it too.
    hidden: jax.Array
    # Replay records (docs/design.md "Rollback"), per GDN layer: [n_slots, n_tokens, C + 2 Hv], one slot per row of
    # a step, holding the raw conv inputs, g and beta of the row's drafts, written by the forward and read after
    # verification in the same device call to rebuild the state after the last accepted draft. () when the
    # runtime has no replay pool.
    replay: tuple[jax.Array, ...] = ()
    backlog: HeadBacklog | None = None  # the MTP head's held catch-up; None without an MTP head or a backlog pool

    @property
    def n_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def n_planes(self) -> int:
        return self.ssm[0].shape[0] if self.ssm else 0

    @property
    def replay_tokens(self) -> int:
        """Draft tokens a replay slot records (0: no replay pool)."""
        return self.replay[0].shape[1] if self.replay else 0


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


KV_DTYPES = ("float32", "float16")  # what KV pages may hold (the CPU attention kernel reads both)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype=jnp.float32) -> int:
    """K and V bytes of one page across all attention layers, the MTP block included."""
    layers = len(cfg.attn_layers) + cfg.n_mtp
    return 2 * layers * page_size * cfg.n_head_kv * cfg.head_dim * jnp.dtype(dtype).itemsize


def bytes_per_plane(cfg: ModelConfig) -> int:
    """Conv and SSM state bytes of one plane across all GDN layers, plus its hidden row (float32)."""
    per_layer = cfg.conv_channels * (cfg.conv_kernel - 1) + cfg.ssm_heads * cfg.ssm_state * cfg.ssm_state
    return 4 * (per_layer * len(cfg.gdn_layers) + cfg.n_embd)


def replay_width(cfg: ModelConfig) -> int:
    """Floats one replay record holds per token and GDN layer: the raw conv inputs (C), g and beta (Hv each)."""
    return cfg.conv_channels + 2 * cfg.ssm_heads


def replay_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes of one token's replay record across all GDN layers (float32)."""
    return 4 * replay_width(cfg) * len(cfg.gdn_layers)


def backlog_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes one held token takes in the MTP head's backlog (`HeadBacklog`): its id, position and h_{p-1}."""
    return 8 + 4 * cfg.n_embd


def init_state(cfg: ModelConfig, n_pages: int, n_planes: int, page_size: int = 16, kv_dtype=jnp.float32,
               replay_slots: int = 0, replay_tokens: int = 0, backlog_slots: int = 0,
               backlog_tokens: int = 0) -> ModelState:
    """Zeroed pools. n_pages and n_planes include the trash page and the null plane. replay_slots x replay_tokens:
    the replay pool (rows of a step x draft tokens recorded per row); none when either is 0. backlog_slots x
    backlog_tokens: the MTP head's backlog (`HeadBacklog`); none when either is 0 or the model has no MTP block."""
    backlog = None
    if cfg.n_mtp and backlog_slots and backlog_tokens:
        backlog = HeadBacklog(tokens=jnp.zeros((backlog_slots, backlog_tokens), jnp.int32),
                              positions=jnp.zeros((backlog_slots, backlog_tokens), jnp.int32),
                              hidden=jnp.zeros((backlog_slots, backlog_tokens, cfg.n_embd), jnp.float32))
    attn_layers = len(cfg.attn_layers) + cfg.n_mtp
    kv_shape = (n_pages, page_size, cfg.n_head_kv, cfg.head_dim)
    n_gdn = len(cfg.gdn_layers)
    return ModelState(
        k_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(attn_layers)),
        v_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(attn_layers)),
        conv=tuple(jnp.zeros((n_planes, cfg.conv_channels, cfg.conv_kernel - 1), jnp.float32) for _ in range(n_gdn)),
        ssm=tuple(jnp.zeros((n_planes, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state), jnp.float32) for _ in range(n_gdn)),
        hidden=jnp.zeros((n_planes, cfg.n_embd), jnp.float32),
        replay=tuple(jnp.zeros((replay_slots, replay_tokens, replay_width(cfg)), jnp.float32)
                     for _ in range(n_gdn) if replay_slots and replay_tokens),
        backlog=backlog,
    )


def scatter_planes(pool: jax.Array, targets: jax.Array, values: jax.Array) -> jax.Array:
    """pool [N, ...] <- values [M, ...] at planes targets [M]; -1 targets are dropped (sent out of bounds, which
    the scatter drops: no copy of the pool)."""
    targets = jnp.where(targets < 0, pool.shape[0], targets)
    return pool.at[targets].set(values.astype(pool.dtype), mode="drop")


def read_planes(pool: jax.Array, planes: jax.Array) -> jax.Array:
    """pool [N, ...] at planes [B] -> [B, ...].

    A one-index gather becomes a slice that XLA fuses into several consumers; it then copies the whole pool
    (twice) before updating it in place. Gathering the null plane beside it keeps the read a gather.
    """
    if planes.shape[0] == 1:
        return pool[jnp.concatenate([planes, jnp.zeros_like(planes)])][:1]
    return pool[planes]


def copy_state(state: ModelState, planes: jax.Array, pages: jax.Array) -> ModelState:
    """The state with planes and pages copied: planes [N, 2] and pages [M, 2] int32 (source, target) pairs. Every
    source is read before any target is written; (0, 0) pairs pad (the null plane and the trash page onto
    themselves). A plane is its conv and SSM state in every GDN layer and its hidden row; a page, its K and V in
    every attention layer."""

    def copy(pool: jax.Array, pairs: jax.Array) -> jax.Array:
        return pool.at[pairs[:, 1]].set(pool[pairs[:, 0]])

    return replace(state, k_pages=tuple(copy(k, pages) for k in state.k_pages),
                   v_pages=tuple(copy(v, pages) for v in state.v_pages),
                   conv=tuple(copy(c, planes) for c in state.conv), ssm=tuple(copy(h, planes) for h in state.ssm),
                   hidden=copy(state.hidden, planes))


def bucket(n: int, minimum: int = 1, base: int = 2) -> int:
    """The smallest power of `base` >= max(n, minimum): sizes are bucketed so that few shapes compile."""
    n, size = max(n, minimum), 1
    while size < n:
        size *= base
    return size


@dataclass(frozen=True)
class Row:
    """One sequence's share of a step: feed `tokens` at positions start.. (host-side, before padding)."""

    tokens: Sequence[int]
    start: int  # position of tokens[0]
    pages: Sequence[int]  # the sequence's KV pages, in position order
    read_plane: int
    write_planes: Sequence[int]  # one per token, -1 for none
    logit_rows: Sequence[int] = ()  # token indices whose logits are wanted


def pack_batch(rows: Sequence[Row], *, B: int | None = None, T: int | None = None, P: int | None = None,
               R: int | None = None) -> StepBatch:
    """Pad rows into a bucketed StepBatch of numpy arrays. Missing rows are padding rows (n_tokens = 0).

    A single row stays a batch of 1: XLA's CPU matmul of 2 rows costs over twice that of one, more than the
    plane-pool copy XLA inserts for a one-row, one-token step.
    """
    B = B or bucket(len(rows))
    T = T or bucket(max(len(r.tokens) for r in rows))
    P = P or bucket(max(len(r.pages) for r in rows))
    R = R or bucket(max(max(len(r.logit_rows) for r in rows), 1))
    batch = StepBatch(
        tokens=np.zeros((B, T), np.int32),
        positions=np.zeros((B, T), np.int32),
        n_tokens=np.zeros((B,), np.int32),
        page_table=np.full((B, P), TRASH_PAGE, np.int32),
        read_plane=np.full((B,), NULL_PLANE, np.int32),
        write_planes=np.full((B, T), -1, np.int32),
        logit_rows=np.zeros((B, R), np.int32),
    )
    for b, row in enumerate(rows):
        n = len(row.tokens)
        if n > T or len(row.pages) > P or len(row.logit_rows) > R or len(row.write_planes) != n:
            raise ValueError(f"row {b} does not fit the batch shape (T={T}, P={P}, R={R}) or has {len(row.write_planes)} write planes for {n} tokens")
        batch.tokens[b, :n] = row.tokens
        batch.positions[b, :n] = np.arange(row.start, row.start + n)
        batch.n_tokens[b] = n
        batch.page_table[b, : len(row.pages)] = row.pages
        batch.read_plane[b] = row.read_plane
        batch.write_planes[b, :n] = row.write_planes
        batch.logit_rows[b, : len(row.logit_rows)] = row.logit_rows
    return batch
