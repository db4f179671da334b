"""The qwen35 / qwen35moe / qwen3next forward pass as pure functions over the weights pytree and the state pools.

`forward` serves prefill, decode and verification alike: a padded batch of rows, each feeding some tokens from
its own KV pages and GDN planes (docs/design.md "State: pools and tables"). `Model` wraps the jitted step with a small API.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT

from . import quant_blocks, sharding
from .config import ModelConfig
from .gdn import gdn_mixer, gdn_rebuild
from .gguf_io import read_gguf, to_device
from .gguf_layout import open_gguf
from .host_memory import THREAD_HEAP_BYTES, release_freed_memory, retain_freed_memory
from .layers import linear, paged_attention, rms_norm, rms_normed, write_kv
from .moe import ffn
from .kernels import cpu_matmul
from .precision import cast_matmul_weights, default_weight_dtype, group_block_rows, transpose_matmul_weights
from .state import (
    ModelState, Row, StepBatch, StepOutput, bucket, bytes_per_plane, init_state, pack_batch, scatter_planes,
)  # fmt: skip
from .weights import Layer, Mtp, Weights, embedding_rows, first_columns, fuse_layer, fuse_projections, pytree


@pytree
class Record:
    """Which rows of a step record replay inputs (docs/design.md "Rollback", replay): slot [B] the replay slot of
    the row (-1: none), first [B] the row's first recorded token (its first draft, or `last`)."""

    slot: jax.Array
    first: jax.Array


def _logits_at(hidden: jax.Array, rows: jax.Array, head: jax.Array, n_tokens: jax.Array) -> jax.Array:
    """hidden [B, T, E], rows [B, R], head [E, V], n_tokens [B] -> logits [B, R, V]. A logit row at a token past
    its row's n_tokens is padding (a later iteration feeding fewer drafts than its width): the CPU kernels skip
    it and return 0 there (`linear`'s live)."""
    return linear(jnp.take_along_axis(hidden, rows[..., None], axis=1), head, live=rows < n_tokens[:, None])


def _head(cfg: ModelConfig, hidden: jax.Array, rows: jax.Array, head, n_tokens: jax.Array,
          vocab: int | None = None) -> jax.Array:
    """`_logits_at` for the first `vocab` token ids (all when None); split over the vocabulary under tensor
    parallelism (`sharding.head_logits`, which computes all of them and keeps the first)."""
    tp = cfg.tensor_parallel
    if tp is None or not tp.vocab_split:
        return _logits_at(hidden, rows, first_columns(head, vocab), n_tokens)
    logits = sharding.head_logits(tp, _logits_at, hidden, rows, head, n_tokens)
    return logits if vocab is None else logits[..., :vocab]


def _embed(cfg: ModelConfig, table, tokens: jax.Array) -> jax.Array:
    tp = cfg.tensor_parallel
    return embedding_rows(table, tokens) if tp is None else sharding.embed(tp, table, tokens)


# The blocks on their normed input x and the norm's weight, as `forward` runs them on one device and
# `sharding`'s blocks run them per shard (under the shard's config, then summing y over the shards).


def _attention_normed(w, cfg, x, norm, positions, valid, page_table, k_pages, v_pages):
    return paged_attention(w, cfg, rms_normed(x, norm, cfg.norm_eps), positions, valid, page_table, k_pages, v_pages)


def _kv_write_normed(w, cfg, x, norm, positions, valid, page_table, k_pages, v_pages):
    return write_kv(w, cfg, rms_normed(x, norm, cfg.norm_eps), positions, valid, page_table, k_pages, v_pages)


def _gdn_normed(w, cfg, x, norm, valid, n_tokens, conv, ssm, read_plane, write_planes, replay, slot, first, *,
                final_only: bool):
    return gdn_mixer(w, cfg, rms_normed(x, norm, cfg.norm_eps), valid, n_tokens, conv, ssm, read_plane,
                     write_planes, final_only, replay, slot, first)


def _ffn_normed(w, cfg, x, norm, valid, **experts):
    return ffn(w, cfg, rms_normed(x, norm, cfg.norm_eps), valid, **experts)


def _attention(w, cfg: ModelConfig, x, norm, *args):
    tp = cfg.tensor_parallel
    return _attention_normed(w, cfg, x, norm, *args) if tp is None else sharding.attention_block(
        tp, _attention_normed, w, x, norm, *args)


def _kv_write(w, cfg: ModelConfig, x, norm, *args):
    tp = cfg.tensor_parallel
    return _kv_write_normed(w, cfg, x, norm, *args) if tp is None else sharding.kv_write_block(
        tp, _kv_write_normed, w, x, norm, *args)


def _gdn(w, cfg: ModelConfig, x, norm, *args, final_only: bool):
    tp = cfg.tensor_parallel
    mixer = functools.partial(_gdn_normed, final_only=final_only)
    return mixer(w, cfg, x, norm, *args) if tp is None else sharding.gdn_block(tp, mixer, w, x, norm, *args)


def _ffn(w, cfg: ModelConfig, x, norm, valid):
    tp = cfg.tensor_parallel
    return _ffn_normed(w, cfg, x, norm, valid) if tp is None else sharding.ffn_block(tp, _ffn_normed, w, x, norm,
                                                                                      valid)


def forward(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, state: ModelState, final_only: bool = False,
    record: Record | None = None,
) -> tuple[StepOutput, ModelState]:
    """One step of the target model over a padded batch.

    batch: tokens/positions/write_planes [B, T], n_tokens/read_plane [B], page_table [B, P], logit_rows [B, R].
    final_only: every row writes at most its final state (a prefill chunk), enabling the chunked GDN form.
    record: rows whose GDN inputs go to the replay pool (`rebuild` reads them), if the state has one.
    Returns logits [B, R, V], post-norm hidden [B, T, E] and the state with this step's K/V and planes written.
    """
    T = batch.tokens.shape[1]
    valid = jnp.arange(T)[None, :] < batch.n_tokens[:, None]  # [B, T]
    x = _embed(cfg, weights.embed, batch.tokens)  # [B, T, E]
    k_pages, v_pages = list(state.k_pages), list(state.v_pages)
    conv, ssm, replay = list(state.conv), list(state.ssm), list(state.replay)
    recording = record is not None and bool(replay)
    attn_index = {layer: i for i, layer in enumerate(cfg.attn_layers)}
    gdn_index = {layer: i for i, layer in enumerate(cfg.gdn_layers)}
    for li, layer in enumerate(weights.layers):
        if cfg.recurrent[li]:
            j = gdn_index[li]
            y, conv[j], ssm[j], pool = _gdn(
                layer.mixer, cfg, x, layer.attn_norm, valid, batch.n_tokens, conv[j], ssm[j],
                batch.read_plane, batch.write_planes,
                replay[j] if recording else None, record.slot if recording else None,
                record.first if recording else None, final_only=final_only,
            )  # fmt: skip
            if recording:
                replay[j] = pool
        else:
            j = attn_index[li]
            y, k_pages[j], v_pages[j] = _attention(
                layer.mixer, cfg, x, layer.attn_norm, batch.positions, valid, batch.page_table, k_pages[j],
                v_pages[j]
            )
        x = _residual_ffn(layer, cfg, x + y, valid)
    hidden = rms_norm(x, weights.output_norm, cfg.norm_eps)
    out = StepOutput(logits=_head(cfg, hidden, batch.logit_rows, weights.output, batch.n_tokens), hidden=hidden)
    new_state = ModelState(k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv), ssm=tuple(ssm),
                           hidden=_write_hidden(state.hidden, hidden, batch, final_only), replay=tuple(replay),
                           backlog=state.backlog)
    return out, new_state


def rebuild(weights: Weights, cfg: ModelConfig, state: ModelState, source: jax.Array, target: jax.Array,
            slot: jax.Array, n_keep: jax.Array, hidden: jax.Array) -> ModelState:
    """Replay rollback (docs/design.md "Rollback"): advance each row's `source` plane [B] by the first n_keep [B]
    tokens recorded in its replay slot [B], in every GDN layer, write the result to its `target` plane [B] (-1:
    none), and store `hidden` [B, E] (the target's post-norm hidden of the last kept token) beside it. No
    projection and no other layer runs: `gdn.gdn_rebuild`."""
    if not cfg.gdn_layers:
        return state
    mixers = [weights.layers[li].mixer for li in cfg.gdn_layers]
    tp = cfg.tensor_parallel
    args = (list(state.conv), list(state.ssm), list(state.replay), source, target, slot, n_keep)
    conv, ssm = (gdn_rebuild(mixers, cfg, *args) if tp is None
                 else sharding.rebuild_block(tp, gdn_rebuild, mixers, *args))  # fmt: skip
    return dataclasses.replace(state, conv=tuple(conv), ssm=tuple(ssm),
                               hidden=scatter_planes(state.hidden, target, hidden))


def _write_hidden(pool: jax.Array, hidden: jax.Array, batch: StepBatch, final_only: bool) -> jax.Array:
    """The hidden pool [N, E] with each written plane holding the hidden [B, T, E] of its token."""
    B, T, E = hidden.shape
    if final_only:
        last = jnp.take_along_axis(hidden, jnp.maximum(batch.n_tokens - 1, 0)[:, None, None], axis=1)[:, 0]
        return scatter_planes(pool, jnp.max(batch.write_planes, axis=1), last)
    return scatter_planes(pool, batch.write_planes.reshape(B * T), hidden.reshape(B * T, E))


def _residual_ffn(layer: Layer, cfg: ModelConfig, x: jax.Array, valid: jax.Array) -> jax.Array:
    """x [B, T, E], valid [B, T] -> [B, T, E]."""
    return x + _ffn(layer.ffn, cfg, x, layer.post_norm, valid)


def mtp_forward(
    weights: Weights, cfg: ModelConfig, batch: StepBatch, hidden_in: jax.Array, state: ModelState,
    vocab: int | None = None,
) -> tuple[StepOutput, ModelState]:
    """The MTP block (docs/model.md §6.1) on (token x_t at position t, hidden h_{t-1}) pairs.

    hidden_in [B, T, E]: the target's post-norm hidden at t-1 (or the MTP's own, when chaining drafts).
    Uses the last KV layer of `state` (the MTP block's own pages, indexed by the same page table); the plane
    fields of `batch` are unused. Returns logits [B, R, V] for token t+1 and the MTP's post-norm hidden [B, T, E].
    vocab: logits for token ids below it only ([B, R, vocab]), a drafting vocabulary (see `jaxmodel.speculative`).
    """
    mtp: Mtp = weights.mtp
    valid, u = _mtp_inputs(mtp, cfg, batch, hidden_in)
    y, k_mtp, v_mtp = _attention(mtp.layer.mixer, cfg, u, mtp.layer.attn_norm, batch.positions, valid,
                                 batch.page_table, state.k_pages[-1], state.v_pages[-1])  # fmt: skip
    u = _residual_ffn(mtp.layer, cfg, u + y, valid)
    hidden = rms_norm(u, mtp.head_norm, cfg.norm_eps)
    out = StepOutput(logits=_head(cfg, hidden, batch.logit_rows, mtp.head, batch.n_tokens, vocab), hidden=hidden)
    new_state = dataclasses.replace(state, k_pages=state.k_pages[:-1] + (k_mtp,),
                                    v_pages=state.v_pages[:-1] + (v_mtp,))
    return out, new_state


def _mtp_inputs(mtp: Mtp, cfg: ModelConfig, batch: StepBatch, hidden_in: jax.Array):
    """The MTP block's valid tokens [B, T] and its residual input u [B, T, E] (the attention's input before its
    norm)."""
    T = batch.tokens.shape[1]
    valid = jnp.arange(T)[None, :] < batch.n_tokens[:, None]
    e = rms_norm(_embed(cfg, mtp.embed, batch.tokens), mtp.enorm, cfg.norm_eps)
    hh = rms_norm(hidden_in, mtp.hnorm, cfg.norm_eps)
    return valid, linear(jnp.concatenate([e, hh], axis=-1), mtp.eh_proj, live=valid)


def mtp_write_kv(weights: Weights, cfg: ModelConfig, batch: StepBatch, hidden_in: jax.Array,
                 state: ModelState) -> ModelState:
    """The MTP block's KV for (token, hidden_in) pairs as `mtp_forward` writes it, bit for bit, without attending,
    the FFN or the head: what a catch-up needs where no draft follows (a position's K and V depend on its own
    token and h_{t-1} only). Shapes as `mtp_forward`."""
    valid, u = _mtp_inputs(weights.mtp, cfg, batch, hidden_in)
    k_mtp, v_mtp = _kv_write(weights.mtp.layer.mixer, cfg, u, weights.mtp.layer.attn_norm, batch.positions, valid,
                             batch.page_table, state.k_pages[-1], state.v_pages[-1])  # fmt: skip
    return dataclasses.replace(state, k_pages=state.k_pages[:-1] + (k_mtp,), v_pages=state.v_pages[:-1] + (v_mtp,))


class Model:
    """A loaded model: static config, device weights and the jitted steps (state donated)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, *, path: str | None = None,
                 layout_report: "sharding.LayoutReport | None" = None):
        self.cfg = cfg
        self.weights = to_device(weights)
        self.path = path
        self.layout_report = layout_report  # a sharded model's: what splitting its weights did
        tp = cfg.tensor_parallel
        self.step = jax.jit(sharding.keeping_state_sharding(functools.partial(forward, cfg=cfg), tp),
                            static_argnames="final_only", donate_argnames="state")
        self.mtp_step = jax.jit(sharding.keeping_state_sharding(functools.partial(mtp_forward, cfg=cfg), tp),
                                donate_argnames="state")

    def sharded(self, n: int, devices=None, expert_parallel: int = 1) -> "Model":
        """This model split over n devices (tensor parallelism, `jaxmodel.sharding`), and its routed experts
        besides over expert_parallel groups of n (expert parallelism; a MoE model): its weights laid out and placed
        on a mesh of the first n x expert_parallel `devices` (default: `jax.devices()`), every block running per
        shard. Block-quantized weights are split along whole blocks (`layout_report` says which could not be and were
        held whole), products that share an input fused on each device. ValueError where a head count or the expert
        count does not divide."""
        if self.cfg.tensor_parallel is not None:
            raise ValueError("the model is sharded already")
        tp = sharding.tensor_parallel(self.cfg, sharding.make_mesh(n, devices, expert_parallel),
                                      sharding.FfnUnits.of(self.weights))
        cfg = self.cfg.replace(tensor_parallel=tp)
        weights, report = sharding.shard_weights(self.weights, self.cfg, tp,
                                                 transpose=sharding.uses_row_kernel(self.weights))
        return Model(cfg, weights, path=self.path, layout_report=report)

    @property
    def state_cfg(self) -> ModelConfig:
        """The config whose shapes the state pools have: the model's, except where a sharded model repeats KV or
        GDN key heads on several devices (`sharding.TensorParallel.pools`)."""
        tp = self.cfg.tensor_parallel
        return self.cfg if tp is None else tp.pools

    @property
    def weights_bytes(self) -> int:
        """The bytes the weights hold on the device (a tied array counted once): the file's blocks where they stay
        quantized, else their float copies."""
        return sum({id(x): int(x.nbytes) for x in jax.tree_util.tree_leaves(self.weights)}.values())

    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None

    def new_state(self, n_pages: int, n_planes: int, page_size: int = 16, replay_slots: int = 0,
                  replay_tokens: int = 0, kv_dtype=jnp.float32, backlog_slots: int = 0,
                  backlog_tokens: int = 0) -> ModelState:
        make = functools.partial(init_state, self.state_cfg, n_pages, n_planes, page_size, kv_dtype=kv_dtype,
                                 replay_slots=replay_slots, replay_tokens=replay_tokens, backlog_slots=backlog_slots,
                                 backlog_tokens=backlog_tokens)  # fmt: skip
        tp = self.cfg.tensor_parallel
        if tp is None:
            return make()
        # Zeroed in place on each device: a pool never exists whole on one.
        specs = sharding.state_specs(jax.eval_shape(make))
        return jax.jit(make, out_shardings=sharding.named(tp.mesh, specs))()

    def score(self, token_ids, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """Logits [T, V] and post-norm hidden [T, E] of one fresh sequence, through the batched step.

        Long inputs are fed in chunks, each reading the plane the previous one wrote.
        """
        token_ids = list(token_ids)
        page_size = 16
        pages = list(range(1, bucket(-(-len(token_ids) // page_size)) + 1))
        state = self.new_state(n_pages=len(pages) + 1, n_planes=3, page_size=page_size)
        logits, hidden = [], []
        read_plane = 0
        for start in range(0, len(token_ids), chunk):
            part = token_ids[start : start + chunk]
            write_plane = 1 if read_plane != 1 else 2
            writes = [-1] * (len(part) - 1) + [write_plane]
            batch = pack_batch([Row(part, start, pages, read_plane, writes, range(len(part)))])
            out, state = self.step(self.weights, batch=batch, state=state)
            logits.append(np.asarray(out.logits[0, : len(part)]))
            hidden.append(np.asarray(out.hidden[0, : len(part)]))
            read_plane = write_plane
        return np.concatenate(logits), np.concatenate(hidden)

    def score_mtp(self, token_ids, hidden_in) -> tuple[np.ndarray, np.ndarray]:
        """MTP logits [T, V] and hidden [T, E] for (token_ids[t] at position t, hidden_in[t] = h_{t-1}) pairs."""
        if not self.has_mtp:
            raise ValueError(f"{self.path or 'model'} has no MTP block")
        token_ids = list(token_ids)
        T = len(token_ids)
        page_size = 16
        pages = list(range(1, bucket(-(-T // page_size)) + 1))
        state = self.new_state(n_pages=len(pages) + 1, n_planes=1, page_size=page_size)
        batch = pack_batch([Row(token_ids, 0, pages, 0, [-1] * T, range(T))])
        h = np.zeros(batch.tokens.shape + (self.cfg.n_embd,), np.float32)
        h[0, :T] = hidden_in
        out, _ = self.mtp_step(self.weights, batch=batch, hidden_in=h, state=state)
        return np.asarray(out.logits[0, :T]), np.asarray(out.hidden[0, :T])


# The ggml types `load_model` keeps as the file's bytes on CPU (`weights.BlockRows`) for the block product; Q8_0
# matmul weights keep their own interleaved form (`weights.Q8Rows`).
BLOCK_KEPT = frozenset({QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS})


def kept_block_types(backend: str, use_kernels: bool, weight_dtype: str, quantized: bool | None) -> frozenset:
    """The ggml types `load_model` keeps as the file's bytes (`weights.BlockRows`), the others being dequantized
    at load. quantized None: the backend's choice; on an accelerator every block type (its products dequantize
    each weight inside the step, so device memory holds the file's bytes, not a bf16 copy of twice their size);
    on CPU the block product's types (BLOCK_KEPT), where its kernels build and weights are float32, else none
    (XLA's float products). True: every block type on any backend (on CPU the types the kernels lack are
    dequantized inside the step, the accelerators' form, which tests run on CPU); False: none."""
    if quantized is False:
        return frozenset()
    if backend == "cpu" and quantized is None:
        multiplies = use_kernels and cpu_matmul.block_kernels() and weight_dtype == "float32"
        return BLOCK_KEPT if multiplies else frozenset()
    return frozenset(quant_blocks.FORMATS)


def load_model(path: str | os.PathLike, *, load_mtp: bool = True, keep_f16: bool = False,
               weight_dtype: str | None = None, cpu_kernel: bool = True, fuse: bool = True,
               quantized: bool | None = None) -> Model:
    """Load a qwen35 / qwen35moe / qwen3next GGUF (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
    IQ4_NL, IQ4_XS; dequantised to float32, except on CPU: see cpu_kernel).

    keep_f16: keep F16 tensors in f16; their matmuls then round activations to f16 as llama.cpp does on CPU
    (exact F16 parity; slower on CPU, see docs/design.md). weight_dtype: "float32" or "bfloat16" for the matmul
    weights (`jaxmodel.precision`); None: the default backend's choice (bfloat16 on GPU, float32 on CPU).
    cpu_kernel: on CPU, where the kernels build (`jaxmodel.kernels.cpu_matmul`), keep Q8_0 matmul weights as the
    file's blocks for the Q8_0 product (`weights.Q8Rows`; with float32 weights), the matmul weights, expert stacks
    and embedding tables of the types in BLOCK_KEPT as the file's bytes for the block product (`weights.BlockRows`)
    and store the large float32 ones
    for the few-row kernel (`precision.transpose_matmul_weights`); False dequantizes everything to float32 and
    keeps XLA's products (benchmarks compare both). fuse: store the products that share an input as one where
    their forms match (`weights.fuse_projections`; through the CPU kernels results are unchanged).
    quantized: which block-quantized weights stay the file's bytes (`kept_block_types`); by default all of them on
    an accelerator, dequantized inside the step to weight_dtype (the values a load-time copy would hold).
    """
    weight_dtype = weight_dtype or default_weight_dtype()
    use_kernels = cpu_kernel and cpu_matmul.available()
    keep_blocks = kept_block_types(jax.default_backend(), use_kernels, weight_dtype, quantized)
    # A file of block-quantized weights: each layer is fused and placed on the device as it is read, so the load's
    # peak stays within a layer of the weights' own bytes (float files keep the order of the steps below).
    reader = open_gguf(str(path))  # opened once: parsing the header is most of a small file's load
    blocks_file = bool(keep_blocks) and any(t.tensor_type in keep_blocks for t in reader.tensors)
    # Weights the block kernels multiply in row groups go into them (`precision.group_block_rows`), a layer at a time.
    grouped = group_block_rows if use_kernels and cpu_matmul.block_kernels() else (lambda tree, tables=(): tree)
    finish_layer = ((lambda layer: to_device(grouped(fuse_layer(layer) if fuse else layer)))
                    if blocks_file else None)  # fmt: skip
    cfg, weights, _ = read_gguf(path, load_mtp=load_mtp, keep_f16=keep_f16,
                                keep_q8_0=use_kernels and weight_dtype == "float32", keep_blocks=keep_blocks,
                                finish_layer=finish_layer, reader=reader)
    weights = grouped(weights, tables=(weights.embed, weights.mtp and weights.mtp.embed))
    # A verify step's temporaries hold about one GDN plane per fed token; where 4 tokens' outgrow a thread's heap,
    # only the main arena keeps them for the next step (jaxmodel.host_memory).
    retain_freed_memory(single_arena=4 * bytes_per_plane(cfg) > THREAD_HEAP_BYTES)
    weights = cast_matmul_weights(weights, weight_dtype)
    if use_kernels:
        weights = transpose_matmul_weights(weights)
    if fuse:
        weights = fuse_projections(weights)
    model = Model(cfg, weights, path=str(path))
    del weights
    release_freed_memory()
    return model
