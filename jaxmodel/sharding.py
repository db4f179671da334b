"""Tensor parallelism (Megatron-style) and expert parallelism over a device mesh (docs/design.md "Tensor
parallelism").

The mesh is 2-D, (EXPERT_AXIS "ep", AXIS "tp"), ep-major: `expert_parallel` groups of `tensor_parallel`
neighbouring devices. Everything below is split over "tp" and repeated over "ep", except the routed experts of MoE
layers, which are split over "ep" along the expert axis (each group holds n_expert / ep whole experts), and over
"tp" along their hidden columns as any FFN. With one group (ep 1) this is plain tensor parallelism; with tp 1, plain
expert parallelism (everything but the routed experts replicated).

Each device holds its own heads: attention q heads and their KV heads (and KV pages), GDN value heads with their key
heads (projections, conv channels, conv and SSM planes, replay records), a slice of every FFN's hidden columns (the
routed experts' too), and a slice of the vocabulary (embedding rows, output head columns). Every block (attention,
GDN, FFN, the embedding lookup) runs inside `jax.shard_map` on its device's heads, with the model's own code and
kernels at the shard's shapes (`TensorParallel.local`), and ends in one `psum` of its [B, T, E] output; the output
head's logits come out split over the vocabulary. Under expert parallelism every device routes all tokens and runs
only its own experts' pairs; the MoE block's one psum then runs over both axes, and the shared expert (split over
"tp" only) is added by the first group alone, so that it is counted once. Everything else (norms, the residual
stream, verification, sampling, the draft chains, the host's bookkeeping) is replicated and runs as one SPMD
program under `jax.jit`.

Weights are laid out device-major before they are placed: the global array of a split weight is its shards
concatenated along the split axis, so that `NamedSharding` hands each device a contiguous block holding exactly its
heads in the order the local config expects (GDN value heads in tiled order over the device's key heads). Where a
model has fewer KV heads (or GDN key heads) than devices, each one is repeated on the devices whose query (value)
heads use it, as vLLM does; pools then hold that many copies.

The sharded path multiplies float weights: block-quantized weights (Q8_0, K-quants) are dequantized when a model
is sharded, fused products are split back into their parts, and large float32 weights are stored transposed for the
CPU few-row kernel where the kernels build, as `load_model` does.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .kernels import cpu_matmul
from .weights import (Attention, BlockRows, DenseFfn, Fused, GatedDeltaNet, Layer, MoeFfn, Mtp, Q8Rows, Transposed,
                      Weights, embedding_rows)

AXIS = "tp"
EXPERT_AXIS = "ep"
REPLICATED = P()

# The fields `weights.fuse_fields` may store as one `Fused` weight, per weights class, in order.
_FUSED_FIELDS = {Attention: ("q", "k", "v"), GatedDeltaNet: ("qkv", "gate", "beta", "alpha"),
                 DenseFfn: ("gate", "up"), MoeFfn: ("shared_gate", "shared_up")}


@dataclass(frozen=True)
class TensorParallel:
    """A model's split over `mesh` (axes EXPERT_AXIS, AXIS): `local` is one shard's config (its heads and hidden
    widths; n_expert stays the model's, the router's width, a shard's own experts being its weights' leading
    axis), which the blocks run under inside `shard_map`; `pools` the config whose shapes the state pools have
    globally (repeated KV and key heads counted). `vocab_split`: the embedding and output head are split over the
    vocabulary (else replicated: a vocabulary that does not divide, or one device along AXIS)."""

    mesh: Mesh
    local: ModelConfig
    pools: ModelConfig
    vocab_split: bool

    @property
    def size(self) -> int:
        """Devices along AXIS (tensor parallelism)."""
        return self.mesh.shape[AXIS]

    @property
    def experts(self) -> int:
        """Devices along EXPERT_AXIS (expert parallelism): groups that split the routed experts between them."""
        return self.mesh.shape.get(EXPERT_AXIS, 1)


def make_mesh(n: int, devices=None, expert_parallel: int = 1) -> Mesh:
    """A mesh (EXPERT_AXIS, AXIS) of expert_parallel x n of the first devices, each group along AXIS of neighbouring
    devices (the tensor-parallel all-reduces, one or two per layer, run within a group; the experts' one per MoE
    layer across groups)."""
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or expert_parallel < 1 or n * expert_parallel > len(devices):
        raise ValueError(f"tensor parallel {n} x expert parallel {expert_parallel}: this process sees "
                         f"{len(devices)} device(s)")
    return Mesh(np.array(devices[: n * expert_parallel]).reshape(expert_parallel, n), (EXPERT_AXIS, AXIS))


# ------------------------------------------------------------------------------------------- which heads go where


def _split_heads(n_heads: int, n: int, what: str) -> list[list[int]]:
    """The heads each of n devices holds: n_heads / n consecutive heads each, or, with fewer heads than devices
    (n a multiple of n_heads), head d // (n / n_heads) on device d."""
    if n_heads % n == 0:
        per = n_heads // n
        return [list(range(d * per, (d + 1) * per)) for d in range(n)]
    if n % n_heads == 0:
        return [[d // (n // n_heads)] for d in range(n)]
    raise ValueError(f"{what}: {n_heads} heads do not split over {n} devices")


def check_divides(cfg: ModelConfig, n: int) -> None:
    """Raise ValueError naming the first width of cfg that does not split over n devices."""
    _layout(cfg, n)


@dataclass(frozen=True)
class _Layout:
    q_heads: list[list[int]]  # per device
    kv_heads: list[list[int]]
    key_heads: list[list[int]]  # GDN
    value_heads: list[list[int]]  # GDN, local tiled order: value head i uses local key head i % len(key_heads[d])


def _layout(cfg: ModelConfig, n: int) -> _Layout:
    q_heads = _split_heads(cfg.n_head, n, "attention heads")
    if cfg.n_head % n:
        raise ValueError(f"attention heads: {cfg.n_head} heads do not split over {n} devices")
    kv_heads = _split_heads(cfg.n_head_kv, n, "KV heads")
    key_heads = _split_heads(cfg.ssm_groups, n, "GDN key heads")
    if cfg.ssm_heads % n:
        raise ValueError(f"GDN value heads: {cfg.ssm_heads} heads do not split over {n} devices")
    Hk, per_key = cfg.ssm_groups, cfg.ssm_heads // cfg.ssm_groups  # value heads per key head
    value_heads = []
    for d in range(n):
        keys = key_heads[d]
        if len(keys) > 1 or Hk >= n:  # whole key heads: every value head of them, in local tiled order
            value_heads.append([r * Hk + k for r in range(per_key) for k in keys])
        else:  # a key head shared by n / Hk devices: a part of its value heads each
            share, part = per_key // (n // Hk), d % (n // Hk)
            value_heads.append([r * Hk + keys[0] for r in range(part * share, (part + 1) * share)])
    for name, width in (("FFN", cfg.n_ff), ("expert FFN", cfg.n_ff_expert), ("shared expert FFN", cfg.n_ff_shared)):
        if width % n:
            raise ValueError(f"{name}: width {width} does not split over {n} devices")
    return _Layout(q_heads, kv_heads, key_heads, value_heads)


def check_experts_divide(cfg: ModelConfig, n_groups: int) -> None:
    """Raise ValueError where cfg's routed experts do not split over n_groups (> 1) expert-parallel groups."""
    if n_groups > 1 and not cfg.is_moe:
        raise ValueError(f"expert parallel {n_groups}: a {cfg.arch} model has no routed experts")
    if cfg.n_expert % n_groups:
        raise ValueError(f"routed experts: {cfg.n_expert} experts do not split over {n_groups} groups")


def tensor_parallel(cfg: ModelConfig, mesh: Mesh) -> TensorParallel:
    """The split of cfg over mesh (ValueError where a width or the expert count does not divide)."""
    n = mesh.shape[AXIS]
    check_experts_divide(cfg, mesh.shape.get(EXPERT_AXIS, 1))
    lay = _layout(cfg, n)
    kv, keys = len(lay.kv_heads[0]), len(lay.key_heads[0])
    local = cfg.replace(n_head=cfg.n_head // n, n_head_kv=kv, ssm_groups=keys, ssm_heads=cfg.ssm_heads // n,
                        n_ff=cfg.n_ff // n, n_ff_expert=cfg.n_ff_expert // n, n_ff_shared=cfg.n_ff_shared // n,
                        tensor_parallel=None)  # fmt: skip
    pools = cfg.replace(n_head_kv=n * kv, ssm_groups=n * keys, tensor_parallel=None)
    return TensorParallel(mesh, local, pools, vocab_split=n > 1 and cfg.n_vocab % n == 0)


# ---------------------------------------------------------------------------------------------- weight layout


def _dense(w) -> np.ndarray | None:
    """A matmul weight (any stored form) as a float numpy array [..., n_in, n_out]; None stays None."""
    if w is None:
        return None
    if isinstance(w, Transposed):
        return np.asarray(w.t).T
    if isinstance(w, Q8Rows):
        quants, scales = (np.asarray(x) for x in w.file_order())
        n_out, n_in = quants.shape
        values = quants.reshape(n_out, n_in // 32, 32).astype(np.float32) * scales[..., None]
        return values.reshape(n_out, n_in).T
    if isinstance(w, BlockRows):
        return np.asarray(w.dequantized())
    return np.asarray(w)


def _unfused(obj):
    """A weights dataclass with its `Fused` products split back into their fields, every matmul weight dense."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    names = _FUSED_FIELDS.get(type(obj), ())
    for i, name in enumerate(names):
        w = values[name]
        if isinstance(w, Fused):
            parts = np.split(_dense(w.w), np.cumsum(w.sizes[:-1]), axis=-1)
            values.update(dict(zip(names[i : i + len(parts)], parts, strict=True)))
    return type(obj)(**{k: v if isinstance(v, (tuple, type(None))) or k == "out_heads" else _dense(v)
                        for k, v in values.items()})


def _take(x: np.ndarray, axis: int, per_device: list[list[int]]) -> np.ndarray:
    """x's entries `per_device[d]` along axis, for each device in turn, concatenated (device-major)."""
    return np.concatenate([np.take(x, idx, axis=axis) for idx in per_device], axis=axis)


def _span(heads: list[list[int]], width: int, offset: int = 0) -> list[list[int]]:
    """Per device, the indices of its heads' `width` consecutive entries each (after `offset`)."""
    return [[offset + h * width + j for h in hs for j in range(width)] for hs in heads]


def _chunks(width: int, n: int) -> list[list[int]]:
    per = width // n
    return [list(range(d * per, (d + 1) * per)) for d in range(n)]


def _concat_lists(*parts: list[list[int]]) -> list[list[int]]:
    return [sum(ps, []) for ps in zip(*parts, strict=True)]


def _lay_out_attention(w: Attention, cfg: ModelConfig, lay: _Layout) -> Attention:
    D = cfg.head_dim
    q_cols, kv_cols, o_rows = _span(lay.q_heads, 2 * D), _span(lay.kv_heads, D), _span(lay.q_heads, D)
    bias = lambda b, cols: None if b is None else _take(b, -1, cols)
    return dataclasses.replace(w, q=_take(w.q, -1, q_cols), k=_take(w.k, -1, kv_cols), v=_take(w.v, -1, kv_cols),
                               o=_take(w.o, -2, o_rows), q_bias=bias(w.q_bias, q_cols),
                               k_bias=bias(w.k_bias, kv_cols), v_bias=bias(w.v_bias, kv_cols))


def _lay_out_gdn(w: GatedDeltaNet, cfg: ModelConfig, lay: _Layout) -> GatedDeltaNet:
    Hk, Dk = cfg.ssm_groups, cfg.ssm_state
    out = w.out
    if w.out_heads is not None:  # out's inputs in the file's head order: into tiled order
        out = out.reshape(cfg.ssm_heads, Dk, -1)[np.argsort(w.out_heads)].reshape(out.shape)
    channels = _concat_lists(_span(lay.key_heads, Dk), _span(lay.key_heads, Dk, Hk * Dk),
                             _span(lay.value_heads, Dk, 2 * Hk * Dk))
    values = _span(lay.value_heads, Dk)
    return GatedDeltaNet(qkv=_take(w.qkv, -1, channels), gate=_take(w.gate, -1, values),
                         conv=_take(np.asarray(w.conv), 0, channels), dt_bias=_take(np.asarray(w.dt_bias), 0,
                                                                                    lay.value_heads),
                         a=_take(np.asarray(w.a), 0, lay.value_heads), beta=_take(w.beta, -1, lay.value_heads),
                         alpha=_take(w.alpha, -1, lay.value_heads), norm=w.norm, out=_take(out, -2, values))


def _lay_out_ffn(w: DenseFfn | MoeFfn, n: int) -> DenseFfn | MoeFfn:
    if isinstance(w, DenseFfn):
        cols = _chunks(w.gate.shape[-1], n)
        return DenseFfn(gate=_take(w.gate, -1, cols), up=_take(w.up, -1, cols), down=_take(w.down, -2, cols))
    cols, shared = _chunks(w.gate.shape[-1], n), _chunks(w.shared_gate.shape[-1], n)
    return dataclasses.replace(w, gate=_take(w.gate, -1, cols), up=_take(w.up, -1, cols),
                               down=_take(w.down, -2, cols), shared_gate=_take(w.shared_gate, -1, shared),
                               shared_up=_take(w.shared_up, -1, shared), shared_down=_take(w.shared_down, -2, shared))


def _lay_out_layer(layer: Layer, cfg: ModelConfig, lay: _Layout, n: int) -> Layer:
    mixer, ffn = _unfused(layer.mixer), _unfused(layer.ffn)
    mixer = (_lay_out_gdn(mixer, cfg, lay) if isinstance(mixer, GatedDeltaNet)
             else _lay_out_attention(mixer, cfg, lay))  # fmt: skip
    return Layer(attn_norm=np.asarray(layer.attn_norm), post_norm=np.asarray(layer.post_norm), mixer=mixer,
                 ffn=_lay_out_ffn(ffn, n))


def _table(x) -> np.ndarray:
    """An embedding table [V, E] as a float numpy array."""
    if isinstance(x, BlockRows):
        return np.asarray(x.dequantized()).T
    return np.asarray(x)


def lay_out_weights(weights: Weights, cfg: ModelConfig, n: int) -> Weights:
    """The weights as dense numpy arrays laid out device-major for n devices (see the module's docstring)."""
    lay = _layout(cfg, n)
    mtp = weights.mtp
    if mtp is not None:
        mtp = Mtp(eh_proj=_dense(mtp.eh_proj), enorm=np.asarray(mtp.enorm), hnorm=np.asarray(mtp.hnorm),
                  head_norm=np.asarray(mtp.head_norm), embed=_table(mtp.embed), head=_dense(mtp.head),
                  layer=_lay_out_layer(mtp.layer, cfg, lay, n))
    return Weights(embed=_table(weights.embed), output_norm=np.asarray(weights.output_norm),
                   output=_dense(weights.output), layers=tuple(_lay_out_layer(l, cfg, lay, n) for l in weights.layers),
                   mtp=mtp)


# -------------------------------------------------------------------------------------------------- the specs


def _matmul_spec(w, split: str):
    """The spec of a matmul weight [.., n_in, n_out] (or its `Transposed` form) split over its "out"puts (column
    parallel) or "in"puts (row parallel)."""
    if w is None:
        return None
    if isinstance(w, Transposed):
        return Transposed(P(AXIS, None) if split == "out" else P(None, AXIS))
    lead = (None,) * (np.ndim(w) - 2)
    return P(*lead, None, AXIS) if split == "out" else P(*lead, AXIS, None)


def _vector_spec(x):
    return None if x is None else P(AXIS)


def mixer_specs(w: Attention | GatedDeltaNet):
    if isinstance(w, Attention):
        return dataclasses.replace(
            w, q=_matmul_spec(w.q, "out"), k=_matmul_spec(w.k, "out"), v=_matmul_spec(w.v, "out"),
            o=_matmul_spec(w.o, "in"), q_norm=REPLICATED, k_norm=REPLICATED, q_bias=_vector_spec(w.q_bias),
            k_bias=_vector_spec(w.k_bias), v_bias=_vector_spec(w.v_bias))  # fmt: skip
    return dataclasses.replace(
        w, qkv=_matmul_spec(w.qkv, "out"), gate=_matmul_spec(w.gate, "out"), conv=P(AXIS, None), dt_bias=P(AXIS),
        a=P(AXIS), beta=_matmul_spec(w.beta, "out"), alpha=_matmul_spec(w.alpha, "out"), norm=REPLICATED,
        out=_matmul_spec(w.out, "in"))  # fmt: skip


def ffn_specs(w: DenseFfn | MoeFfn):
    if isinstance(w, DenseFfn):
        return DenseFfn(gate=_matmul_spec(w.gate, "out"), up=_matmul_spec(w.up, "out"),
                        down=_matmul_spec(w.down, "in"))
    # The routed experts [X, n_in, n_out]: whole experts over EXPERT_AXIS, their columns over AXIS.
    return MoeFfn(router=REPLICATED, gate=P(EXPERT_AXIS, None, AXIS), up=P(EXPERT_AXIS, None, AXIS),
                  down=P(EXPERT_AXIS, AXIS, None), shared_router=REPLICATED,
                  shared_gate=_matmul_spec(w.shared_gate, "out"), shared_up=_matmul_spec(w.shared_up, "out"),
                  shared_down=_matmul_spec(w.shared_down, "in"))


def _layer_specs(layer: Layer) -> Layer:
    return Layer(attn_norm=REPLICATED, post_norm=REPLICATED, mixer=mixer_specs(layer.mixer), ffn=ffn_specs(layer.ffn))


def _head_spec(w, vocab_split: bool):
    return _matmul_spec(w, "out") if vocab_split else jax.tree.map(lambda _: REPLICATED, w)


def weight_specs(weights: Weights, vocab_split: bool):
    """The PartitionSpec of every leaf of laid-out weights (`lay_out_weights`), as a tree of their classes."""
    table = P(AXIS, None) if vocab_split else REPLICATED
    mtp = weights.mtp
    if mtp is not None:
        mtp = Mtp(eh_proj=jax.tree.map(lambda _: REPLICATED, mtp.eh_proj), enorm=REPLICATED, hnorm=REPLICATED,
                  head_norm=REPLICATED, embed=table, head=_head_spec(mtp.head, vocab_split),
                  layer=_layer_specs(mtp.layer))
    return Weights(embed=table, output_norm=REPLICATED, output=_head_spec(weights.output, vocab_split),
                   layers=tuple(_layer_specs(l) for l in weights.layers), mtp=mtp)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def named(mesh: Mesh, specs):
    """A tree of PartitionSpecs as NamedShardings on mesh."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_weights(weights: Weights, cfg: ModelConfig, tp: TensorParallel, transpose: bool) -> Weights:
    """The weights laid out for tp's mesh and placed on it. transpose: store large float32 matmul weights
    transposed for the CPU few-row kernel (`precision.transpose_matmul_weights`), as `load_model` does."""
    from .precision import transpose_matmul_weights

    laid = lay_out_weights(weights, cfg, tp.size)
    if transpose:
        laid = transpose_matmul_weights(laid)
    return jax.device_put(laid, named(tp.mesh, weight_specs(laid, tp.vocab_split)))


def uses_row_kernel(weights: Weights) -> bool:
    """Whether weights hold `Transposed` weights (a model loaded for the CPU few-row kernel)."""
    leaves = jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, Transposed))
    return any(isinstance(x, Transposed) for x in leaves) and cpu_matmul.available()


# ------------------------------------------------------------------------------------------------------ state

KV_SPEC = P(None, None, AXIS, None)  # [n_pages, page_size, Hkv, D]
CONV_SPEC = P(None, AXIS, None)  # [n_planes, C, Kc-1]
SSM_SPEC = P(None, AXIS, None, None)  # [n_planes, Hv, Dk, Dv]
REPLAY_SPEC = P(None, None, AXIS)  # [n_slots, n_tokens, C + 2 Hv]: per device its channels, then its g and beta


def state_specs(state):
    """The spec of every leaf of a `ModelState`: pools split over their heads, the hidden pool and the MTP head's
    backlog replicated."""
    return dataclasses.replace(
        state, k_pages=tuple(KV_SPEC for _ in state.k_pages), v_pages=tuple(KV_SPEC for _ in state.v_pages),
        conv=tuple(CONV_SPEC for _ in state.conv), ssm=tuple(SSM_SPEC for _ in state.ssm), hidden=REPLICATED,
        replay=tuple(REPLAY_SPEC for _ in state.replay),
        backlog=None if state.backlog is None else jax.tree.map(lambda _: REPLICATED, state.backlog))  # fmt: skip


def constrain_state(state, tp: TensorParallel):
    """state with its sharding pinned to `state_specs` inside a jitted step, so that the state a step returns is
    placed as the one it took (its donated buffers are reused, and the next step finds the same executable)."""
    return jax.lax.with_sharding_constraint(state, named(tp.mesh, state_specs(state)))


def keeping_state_sharding(fn: Callable, tp: TensorParallel | None) -> Callable:
    """fn(...) -> (out, state) with the returned state constrained (`constrain_state`); fn itself without tp."""
    if tp is None:
        return fn

    def pinned(*args, **kwargs):
        out, state = fn(*args, **kwargs)
        return out, constrain_state(state, tp)

    return pinned


# ------------------------------------------------------------------------------------------------- the blocks


def _per_shard(tp: TensorParallel, body: Callable, in_specs, out_specs):
    return jax.shard_map(body, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _psum(tp: TensorParallel, x: jax.Array, *axes: str) -> jax.Array:
    """`psum` over those of axes that span more than one device: XLA keeps an all-reduce over one device (expert
    parallelism alone has "tp" of one)."""
    axes = tuple(a for a in axes if tp.mesh.shape[a] > 1)
    return jax.lax.psum(x, axes) if axes else x


def _tree_spec(tree, spec):
    return jax.tree.map(lambda _: spec, tree)


def embed(tp: TensorParallel, table, tokens: jax.Array) -> jax.Array:
    """`embedding_rows(table, tokens)` with table [V, E] split over the vocabulary: each device looks up the tokens
    in its rows (0 elsewhere) and one psum sums them (one nonzero term each: exact)."""
    if not tp.vocab_split:
        return embedding_rows(table, tokens)

    def body(table, tokens):
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(AXIS) * rows
        inside = (local >= 0) & (local < rows)
        found = embedding_rows(table, jnp.where(inside, local, 0))
        return _psum(tp, jnp.where(inside[..., None], found, 0.0), AXIS)

    return _per_shard(tp, body, (P(AXIS, None), REPLICATED), REPLICATED)(table, tokens)


def head_logits(tp: TensorParallel, logits_at: Callable, hidden: jax.Array, rows: jax.Array, head, n_tokens):
    """logits_at(hidden, rows, head, n_tokens) -> [B, R, V] with head [E, V] split over the vocabulary: each
    device computes its vocabulary's logits, and one all-gather hands every device all of them, for verification,
    sampling and drafting to run replicated (left split, XLA's own partitioning of those gathers the logits
    several times over, in pieces)."""
    if not tp.vocab_split:
        return logits_at(hidden, rows, head, n_tokens)

    def body(hidden, rows, head, n_tokens):
        return jax.lax.all_gather(logits_at(hidden, rows, head, n_tokens), AXIS, axis=2, tiled=True)

    return _per_shard(tp, body, (REPLICATED, REPLICATED, _head_spec(head, True), REPLICATED),
                      REPLICATED)(hidden, rows, head, n_tokens)


def attention_block(tp: TensorParallel, attention: Callable, w: Attention, x: jax.Array, norm: jax.Array,
                    positions, valid, page_table, k_pages, v_pages):
    """attention(w, local cfg, x, norm, positions, valid, page_table, k_pages, v_pages) -> (y, k_pages, v_pages)
    per shard on its heads and KV pages, y summed over the shards (one psum)."""

    def body(w, x, norm, positions, valid, page_table, k_pages, v_pages):
        y, k_pages, v_pages = attention(w, tp.local, x, norm, positions, valid, page_table, k_pages, v_pages)
        return _psum(tp, y, AXIS), k_pages, v_pages

    in_specs = (mixer_specs(w), REPLICATED, REPLICATED, REPLICATED, REPLICATED, REPLICATED, KV_SPEC, KV_SPEC)
    return _per_shard(tp, body, in_specs, (REPLICATED, KV_SPEC, KV_SPEC))(
        w, x, norm, positions, valid, page_table, k_pages, v_pages)


def kv_write_block(tp: TensorParallel, write: Callable, w: Attention, x: jax.Array, norm: jax.Array, positions,
                   valid, page_table, k_pages, v_pages):
    """write(w, local cfg, x, norm, positions, valid, page_table, k_pages, v_pages) -> (k_pages, v_pages) per
    shard: K/V written without attending, no collective."""

    def body(w, x, norm, positions, valid, page_table, k_pages, v_pages):
        return write(w, tp.local, x, norm, positions, valid, page_table, k_pages, v_pages)

    in_specs = (mixer_specs(w), REPLICATED, REPLICATED, REPLICATED, REPLICATED, REPLICATED, KV_SPEC, KV_SPEC)
    return _per_shard(tp, body, in_specs, (KV_SPEC, KV_SPEC))(w, x, norm, positions, valid, page_table, k_pages,
                                                              v_pages)


def gdn_block(tp: TensorParallel, mixer: Callable, w: GatedDeltaNet, x: jax.Array, norm: jax.Array, valid, n_tokens,
              conv, ssm, read_plane, write_planes, replay, slot, first):
    """mixer(w, local cfg, x, norm, valid, n_tokens, conv, ssm, read_plane, write_planes, replay, slot, first)
    -> (y, conv, ssm, replay) per shard on its value heads, planes and replay records; y summed (one psum).
    replay, slot and first may be None (no recording)."""

    def body(w, x, norm, valid, n_tokens, conv, ssm, read_plane, write_planes, replay, slot, first):
        y, conv, ssm, replay = mixer(w, tp.local, x, norm, valid, n_tokens, conv, ssm, read_plane, write_planes,
                                     replay, slot, first)
        return _psum(tp, y, AXIS), conv, ssm, replay

    in_specs = (mixer_specs(w), REPLICATED, REPLICATED, REPLICATED, REPLICATED, CONV_SPEC, SSM_SPEC, REPLICATED,
                REPLICATED, REPLAY_SPEC, REPLICATED, REPLICATED)
    return _per_shard(tp, body, in_specs, (REPLICATED, CONV_SPEC, SSM_SPEC, REPLAY_SPEC))(
        w, x, norm, valid, n_tokens, conv, ssm, read_plane, write_planes, replay, slot, first)


def ffn_block(tp: TensorParallel, ffn: Callable, w: DenseFfn | MoeFfn, x: jax.Array, norm: jax.Array, valid):
    """ffn(w, local cfg, x, norm, valid, **experts) -> y per shard on its hidden columns (every routed expert's),
    summed (one psum); routing is replicated. Under expert parallelism (a MoE layer, tp.experts > 1) each shard
    also holds only its group's experts: ffn is told their first index and whether to add the shared expert (the
    first group only), and the one psum runs over both axes (`moe.moe_ffn`)."""
    if not isinstance(w, MoeFfn) or tp.experts == 1:

        def body(w, x, norm, valid):
            return _psum(tp, ffn(w, tp.local, x, norm, valid), AXIS)

    else:

        def body(w, x, norm, valid):
            group = jax.lax.axis_index(EXPERT_AXIS)
            y = ffn(w, tp.local, x, norm, valid, first_expert=group * w.gate.shape[0], add_shared=group == 0)
            return _psum(tp, y, EXPERT_AXIS, AXIS)

    return _per_shard(tp, body, (ffn_specs(w), REPLICATED, REPLICATED, REPLICATED), REPLICATED)(w, x, norm, valid)


def rebuild_block(tp: TensorParallel, rebuild: Callable, mixers: list[GatedDeltaNet], conv: list, ssm: list,
                  replay: list, source, target, slot, n_keep):
    """rebuild(mixers, local cfg, conv, ssm, replay, source, target, slot, n_keep) -> (conv, ssm) per shard on its
    planes and replay records, no collective (`gdn.gdn_rebuild`)."""

    def body(mixers, conv, ssm, replay, source, target, slot, n_keep):
        return rebuild(mixers, tp.local, conv, ssm, replay, source, target, slot, n_keep)

    in_specs = ([mixer_specs(w) for w in mixers], [CONV_SPEC] * len(conv), [SSM_SPEC] * len(ssm),
                [REPLAY_SPEC] * len(replay), REPLICATED, REPLICATED, REPLICATED, REPLICATED)
    return _per_shard(tp, body, in_specs, ([CONV_SPEC] * len(conv), [SSM_SPEC] * len(ssm)))(
        mixers, conv, ssm, replay, source, target, slot, n_keep)


# ------------------------------------------------------------------------------------------------- inspection

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE_OP = re.compile(r"= [^=]*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective a compiled module's HLO text (`jax.stages.Compiled.as_text()`) holds, each
    counted once (an async pair's start only)."""
    counts = {name: 0 for name in COLLECTIVES}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_OP.search(line)
        if match:
            counts[match.group(1)] += 1
    return counts
