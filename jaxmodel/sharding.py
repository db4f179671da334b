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

Block-quantized weights (Q8_0, K-quants, ...) stay the file's blocks, split along whole blocks: a column-parallel
weight by its rows (outputs), whose blocks are their own; a row-parallel one (attention o, GDN out, FFN down) by the
blocks of each row, where every device's inputs are whole blocks. Each block's product is then one device's, the
activation quantized over the same block, and only the psum adds the shards' partial sums. An FFN's hidden columns
split in whole blocks of its down projection, as evenly as they go, the devices with fewer padded by zero columns
(`ffn_columns`), so its width need not divide. A GDN out or attention o whose device inputs are not whole blocks
(heads narrower than a block) is held whole on every device and multiplies all-gathered inputs on one
(`weights.GatheredInputs`). Products that share an input are fused on each device (`fuse_on_each_device`), and large
float32 weights are stored transposed for the CPU few-row kernel where the kernels build, as `load_model` does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gguf import GGMLQuantizationType as QT

from . import quant_blocks
from .config import ModelConfig
from .kernels import cpu_matmul
from .weights import (Attention, BlockRows, DenseFfn, Fused, GatedDeltaNet, GatheredInputs, Layer, MoeFfn, Mtp,
                      Q8Rows, Transposed, Weights, embedding_rows, fuse_fields)

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
    units: FfnUnits  # the blocks FFN columns split in, which `local`'s FFN widths count

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
    """Raise ValueError naming the first head count of cfg that does not split over n devices (FFN widths always
    do: `ffn_columns` pads them)."""
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
    return _Layout(q_heads, kv_heads, key_heads, value_heads)


def check_experts_divide(cfg: ModelConfig, n_groups: int) -> None:
    """Raise ValueError where cfg's routed experts do not split over n_groups (> 1) expert-parallel groups."""
    if n_groups > 1 and not cfg.is_moe:
        raise ValueError(f"expert parallel {n_groups}: a {cfg.arch} model has no routed experts")
    if cfg.n_expert % n_groups:
        raise ValueError(f"routed experts: {cfg.n_expert} experts do not split over {n_groups} groups")


def tensor_parallel(cfg: ModelConfig, mesh: Mesh, units: "FfnUnits | None" = None) -> TensorParallel:
    """The split of cfg over mesh (ValueError where a head count or the expert count does not divide), its FFN
    widths split in whole `units` (`FfnUnits.of` the weights; default: float weights)."""
    n = mesh.shape[AXIS]
    units = units or FfnUnits()
    check_experts_divide(cfg, mesh.shape.get(EXPERT_AXIS, 1))
    lay = _layout(cfg, n)
    kv, keys = len(lay.kv_heads[0]), len(lay.key_heads[0])
    width = lambda w, unit: len(ffn_columns(w, n, unit)[0]) if w else 0
    local = cfg.replace(n_head=cfg.n_head // n, n_head_kv=kv, ssm_groups=keys, ssm_heads=cfg.ssm_heads // n,
                        n_ff=width(cfg.n_ff, units.dense), n_ff_expert=width(cfg.n_ff_expert, units.expert),
                        n_ff_shared=width(cfg.n_ff_shared, units.shared), tensor_parallel=None)  # fmt: skip
    pools = cfg.replace(n_head_kv=n * kv, ssm_groups=n * keys, tensor_parallel=None)
    return TensorParallel(mesh, local, pools, vocab_split=n > 1 and cfg.n_vocab % n == 0, units=units)


# ---------------------------------------------------------------------------------------------- weight layout
#
# Index lists name, per device, the outputs (column parallel) or inputs (row parallel) of a weight it holds, in its
# order; -1 is a zero output or input, padding an FFN's hidden columns to the same width on every device.


@dataclass
class LayoutReport:
    """What laying out one model's weights did: `blocks_kept` block-quantized weights (Q8_0, K-quants, ...) split
    along whole blocks; `gathered` the row-parallel ones whose device inputs are not whole blocks, held whole on
    every device (`GatheredInputs`); `padding_bytes` the zero blocks or columns added so that every device holds an
    FFN width of whole blocks."""

    blocks_kept: int = 0
    gathered: list[str] = dataclasses.field(default_factory=list)
    padding_bytes: int = 0

    def summary(self) -> str:
        text = f"{self.blocks_kept} quantized weights split along their blocks"
        if self.gathered:
            shown = ", ".join(self.gathered[:4]) + (", ..." if len(self.gathered) > 4 else "")
            text += f", {len(self.gathered)} held whole on each device (inputs not whole blocks per device: {shown})"
        if self.padding_bytes:
            size = (f"{self.padding_bytes / 2**20:.1f} MiB" if self.padding_bytes >= 2**20 // 10
                    else f"{self.padding_bytes / 2**10:.0f} KiB")
            text += f", {size} of zero padding (FFN widths of whole blocks per device)"
        return text


def _select(x: np.ndarray, axis: int, index) -> np.ndarray:
    """x's entries `index` along axis, in that order, -1 giving zeros."""
    index = np.asarray(index, dtype=np.int64)
    if (index >= 0).all():
        return np.take(x, index, axis=axis)
    zero = np.zeros_like(np.take(x, [0], axis=axis))
    return np.take(np.concatenate([x, zero], axis=axis), np.where(index < 0, x.shape[axis], index), axis=axis)


def _block_indices(index, block: int) -> np.ndarray | None:
    """The blocks of `block` inputs that `index` (inputs, -1 zeros) consists of, in order (-1 a zero block); None
    where it is not whole blocks."""
    index = np.asarray(index, dtype=np.int64)
    if len(index) % block:
        return None
    first = index.reshape(-1, block)[:, 0]
    zero = first < 0
    expected = np.where(zero[:, None], -1, first[:, None] + np.arange(block))
    if not (index.reshape(-1, block) == expected).all() or (first[~zero] % block).any():
        return None
    return np.where(zero, -1, first // block)


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


def _file_order(w: BlockRows) -> np.ndarray:
    return np.asarray(w.file_order().blocks)


def _joined_blocks(w: BlockRows, parts: list[np.ndarray], axis: int) -> BlockRows:
    """Each device's blocks (the file's order), in w's row order (row groups per device), concatenated."""
    local = [dataclasses.replace(w, blocks=b, row_group=1) for b in parts]
    local = [x.grouped() for x in local] if w.row_group > 1 else local
    return dataclasses.replace(w, blocks=np.concatenate([np.asarray(x.blocks) for x in local], axis=axis))


def _joined_q8(parts: list[tuple[np.ndarray, np.ndarray]], axis: int) -> Q8Rows:
    local = [Q8Rows.from_file_order(q, s) for q, s in parts]
    return Q8Rows(*(np.concatenate([np.asarray(getattr(x, f)) for x in local], axis=axis)
                    for f in ("quants", "scales")))


def _split_outputs(w, per_device: list, report: LayoutReport) -> object:
    """w [.., n_in, n_out] split over its outputs (column parallel), each device's outputs `per_device[d]`,
    device-major; block weights keep their blocks (a row's are its own)."""
    if w is None:
        return None
    if isinstance(w, BlockRows):
        report.blocks_kept += 1
        blocks = _file_order(w)
        return _joined_blocks(w, [_select(blocks, -2, idx) for idx in per_device], axis=-2)
    if isinstance(w, Q8Rows):
        report.blocks_kept += 1
        quants, scales = (np.asarray(x) for x in w.file_order())
        return _joined_q8([(_select(quants, 0, idx), _select(scales, 0, idx)) for idx in per_device], axis=0)
    return _select(_dense(w), -1, np.concatenate(per_device))


def _split_inputs(w, per_device: list, report: LayoutReport, where: str, inputs: np.ndarray | None = None) -> object:
    """w [.., n_in, n_out] split over its inputs (row parallel), each device's inputs `per_device[d]`,
    device-major. A block weight keeps its blocks where every device's inputs are whole blocks; else it is held
    whole (`GatheredInputs`, noted in report), `inputs` (default: the lists themselves) naming w's input at each
    position of the devices' lists concatenated."""
    if w is None:
        return None
    fmt = _block_format(w)
    if fmt is not None:
        chosen = [_block_indices(idx, fmt.block) for idx in per_device]
        if all(b is not None for b in chosen):
            report.blocks_kept += 1
            if isinstance(w, Q8Rows):
                quants, scales = (np.asarray(x) for x in w.file_order())
                return _joined_q8([(_select(quants, 1, idx), _select(scales, 1, b))
                                   for idx, b in zip(per_device, chosen)], axis=1)
            blocks = _file_order(w)
            per_block = blocks.reshape(*blocks.shape[:-1], -1, fmt.block_bytes)
            return _joined_blocks(w, [_select(per_block, -2, b).reshape(*blocks.shape[:-1], -1) for b in chosen],
                                  axis=-1)
        report.gathered.append(where)
        inputs = np.concatenate(per_device) if inputs is None else inputs
        return GatheredInputs(w, tuple(int(i) for i in np.argsort(inputs)), AXIS)
    return _select(_dense(w), -2, np.concatenate(per_device))


def _kept(w) -> object:
    """A weight that is not split (replicated): as stored, a transposed one as a plain array (the transposition for
    the CPU kernel is redone after the layout)."""
    return _dense(w) if isinstance(w, Transposed) else w


def _parts(w: Fused) -> list:
    """A fused weight's parts, each in the fused weight's form."""
    bounds = np.cumsum((0,) + w.sizes)
    cut = lambda a, b: slice(int(a), int(b))
    if isinstance(w.w, (BlockRows, Q8Rows)):
        return [w.w.outputs(cut(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    if isinstance(w.w, Transposed):
        return [Transposed(w.w.t[cut(a, b)]) for a, b in zip(bounds[:-1], bounds[1:])]
    return [w.w[:, cut(a, b)] for a, b in zip(bounds[:-1], bounds[1:])]


def _unfused(obj):
    """A weights dataclass with its `Fused` products split back into their fields."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    names = _FUSED_FIELDS.get(type(obj), ())
    for i, name in enumerate(names):
        w = values[name]
        if isinstance(w, Fused):
            values.update(dict(zip(names[i : i + len(w.sizes)], _parts(w), strict=True)))
    return type(obj)(**values)


def _span(heads: list[list[int]], width: int, offset: int = 0) -> list[list[int]]:
    """Per device, the indices of its heads' `width` consecutive entries each (after `offset`)."""
    return [[offset + h * width + j for h in hs for j in range(width)] for hs in heads]


def _chunks(width: int, n: int) -> list[list[int]]:
    per = width // n
    return [list(range(d * per, (d + 1) * per)) for d in range(n)]


def _concat_lists(*parts: list[list[int]]) -> list[list[int]]:
    return [sum(ps, []) for ps in zip(*parts, strict=True)]


def _block_format(w) -> quant_blocks.BlockFormat | None:
    """The ggml block format w is stored in (None for a float weight)."""
    if isinstance(w, BlockRows):
        return quant_blocks.FORMATS[w.qtype]
    return quant_blocks.FORMATS[QT.Q8_0] if isinstance(w, Q8Rows) else None


def _block_size(w) -> int:
    """The inputs of one of w's quantization blocks (1 for a float weight)."""
    fmt = _block_format(w)
    return 1 if fmt is None else fmt.block


def ffn_columns(width: int, n: int, unit: int = 1) -> list[list[int]]:
    """The hidden columns of an FFN of `width` each of n devices holds: consecutive runs of whole `unit`s (the down
    projection's quantization block), as even as they go, each padded with zero columns (-1) to the widest.

    Example: width 512 in blocks of 256 over 4 devices: [0..255], [256..511], and two devices of 256 zero columns;
    over 2 devices, [0..255] and [256..511] without padding."""
    n_units, extra = divmod(width // unit, n)
    per_device = (n_units + (extra > 0)) * unit
    columns, start = [], 0
    for d in range(n):
        count = (n_units + (d < extra)) * unit
        columns.append(list(range(start, start + count)) + [-1] * (per_device - count))
        start += count
    return columns


@dataclass(frozen=True)
class FfnUnits:
    """The quantization block each kind of FFN's hidden columns split in (the least common multiple of its down
    projections' blocks over the layers; 1: float weights), so every device holds whole blocks of them."""

    dense: int = 1
    expert: int = 1
    shared: int = 1

    @staticmethod
    def of(weights: Weights) -> "FfnUnits":
        dense, expert, shared = 1, 1, 1
        layers = list(weights.layers) + ([weights.mtp.layer] if weights.mtp is not None else [])
        for layer in layers:
            if isinstance(layer.ffn, DenseFfn):
                dense = math.lcm(dense, _block_size(layer.ffn.down))
            else:
                expert = math.lcm(expert, _block_size(layer.ffn.down))
                shared = math.lcm(shared, _block_size(layer.ffn.shared_down))
        return FfnUnits(dense, expert, shared)


def _lay_out_attention(w: Attention, cfg: ModelConfig, lay: _Layout, report: LayoutReport, where: str) -> Attention:
    D = cfg.head_dim
    q_cols, kv_cols, o_rows = _span(lay.q_heads, 2 * D), _span(lay.kv_heads, D), _span(lay.q_heads, D)
    bias = lambda b, cols: None if b is None else _select(np.asarray(b), -1, np.concatenate(cols))
    return dataclasses.replace(w, q=_split_outputs(w.q, q_cols, report), k=_split_outputs(w.k, kv_cols, report),
                               v=_split_outputs(w.v, kv_cols, report),
                               o=_split_inputs(w.o, o_rows, report, where + " o"),
                               q_norm=np.asarray(w.q_norm), k_norm=np.asarray(w.k_norm),
                               q_bias=bias(w.q_bias, q_cols), k_bias=bias(w.k_bias, kv_cols),
                               v_bias=bias(w.v_bias, kv_cols))  # fmt: skip


def _gdn_out(w: GatedDeltaNet, cfg: ModelConfig, lay: _Layout, report: LayoutReport, where: str):
    """The GDN output projection split over the devices' value heads, and the local `out_heads`. A block `out`
    whose inputs keep the file's head order (`out_heads`, qwen3next) is split along its file order, each device
    naming where its heads' inputs lie; where that takes blocks apart it is held whole (`GatheredInputs`), each
    device's output heads in tiled order."""
    Dv = cfg.ssm_state
    tiled = _span(lay.value_heads, Dv)
    if w.out_heads is None:
        return _split_inputs(w.out, tiled, report, where), None
    place = np.argsort(w.out_heads)  # tiled head -> its input group in the file
    if not isinstance(w.out, BlockRows):  # a float weight: its inputs into tiled order, then split
        dense = _dense(w.out)
        dense = dense.reshape(cfg.ssm_heads, Dv, -1)[place].reshape(dense.shape)
        return _select(dense, -2, np.concatenate(tiled)), None
    groups = [sorted(int(place[h]) for h in heads) for heads in lay.value_heads]
    local = {tuple(heads.index(w.out_heads[j]) for j in g) for heads, g in zip(lay.value_heads, groups)}
    if len(local) == 1 and all(_block_indices(idx, _block_size(w.out)) is not None for idx in _span(groups, Dv)):
        return _split_inputs(w.out, _span(groups, Dv), report, where), local.pop()
    inputs = np.concatenate(tiled)  # each gathered input's place among the weight's (the file's order)
    return _split_inputs(w.out, tiled, report, where, place[inputs // Dv] * Dv + inputs % Dv), None


def _lay_out_gdn(w: GatedDeltaNet, cfg: ModelConfig, lay: _Layout, report: LayoutReport,
                 where: str) -> GatedDeltaNet:
    Hk, Dk = cfg.ssm_groups, cfg.ssm_state
    channels = _concat_lists(_span(lay.key_heads, Dk), _span(lay.key_heads, Dk, Hk * Dk),
                             _span(lay.value_heads, Dk, 2 * Hk * Dk))
    values = _span(lay.value_heads, Dk)
    pick = lambda x, per_device: _select(np.asarray(x), 0, np.concatenate(per_device))
    out, out_heads = _gdn_out(w, cfg, lay, report, where + " out")
    return GatedDeltaNet(qkv=_split_outputs(w.qkv, channels, report), gate=_split_outputs(w.gate, values, report),
                         conv=pick(w.conv, channels), dt_bias=pick(w.dt_bias, lay.value_heads),
                         a=pick(w.a, lay.value_heads), beta=_split_outputs(w.beta, lay.value_heads, report),
                         alpha=_split_outputs(w.alpha, lay.value_heads, report), norm=np.asarray(w.norm), out=out,
                         out_heads=out_heads)  # fmt: skip


def _swiglu_columns(gate, up, down, columns: list[list[int]], report: LayoutReport, where: str) -> tuple:
    """An FFN's gate, up and down split over its hidden columns (`ffn_columns`); their zero columns counted."""
    laid = (_split_outputs(gate, columns, report), _split_outputs(up, columns, report),
            _split_inputs(down, columns, report, where))
    padding = sum(c.count(-1) for c in columns) / sum(len(c) for c in columns)
    report.padding_bytes += int(padding * sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(laid)))
    return laid


def _lay_out_ffn(w: DenseFfn | MoeFfn, n: int, units: FfnUnits, report: LayoutReport,
                 where: str) -> DenseFfn | MoeFfn:
    if isinstance(w, DenseFfn):
        return DenseFfn(*_swiglu_columns(w.gate, w.up, w.down, ffn_columns(w.gate.shape[-1], n, units.dense), report,
                                         where + " down"))
    gate, up, down = _swiglu_columns(w.gate, w.up, w.down, ffn_columns(w.gate.shape[-1], n, units.expert), report,
                                     where + " experts' down")
    shared_gate, shared_up, shared_down = _swiglu_columns(
        w.shared_gate, w.shared_up, w.shared_down, ffn_columns(w.shared_gate.shape[-1], n, units.shared), report,
        where + " shared expert's down")
    return MoeFfn(router=_kept(w.router), gate=gate, up=up, down=down, shared_router=np.asarray(w.shared_router),
                  shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down)


def _lay_out_layer(layer: Layer, cfg: ModelConfig, lay: _Layout, n: int, units: FfnUnits, report: LayoutReport,
                   where: str) -> Layer:
    mixer, ffn = _unfused(layer.mixer), _unfused(layer.ffn)
    mixer = (_lay_out_gdn(mixer, cfg, lay, report, where) if isinstance(mixer, GatedDeltaNet)
             else _lay_out_attention(mixer, cfg, lay, report, where))  # fmt: skip
    return Layer(attn_norm=np.asarray(layer.attn_norm), post_norm=np.asarray(layer.post_norm), mixer=mixer,
                 ffn=_lay_out_ffn(ffn, n, units, report, where))


def lay_out_weights(weights: Weights, cfg: ModelConfig, n: int, vocab_split: bool | None = None,
                    units: FfnUnits | None = None) -> tuple[Weights, LayoutReport]:
    """The weights laid out device-major for n devices (see the module's docstring), in their stored forms: block
    weights as blocks (a row-parallel one whose device inputs are not whole blocks held whole), fused products split
    (`fuse_on_each_device` fuses them again), the rest numpy arrays; and what that did. vocab_split (default: n > 1
    and the vocabulary divides): the output heads split over the vocabulary (embedding tables, read by row, split as
    they are stored). units: the blocks FFN columns split in (default `FfnUnits.of(weights)`)."""
    lay, units, report = _layout(cfg, n), units or FfnUnits.of(weights), LayoutReport()
    vocab_split = (n > 1 and cfg.n_vocab % n == 0) if vocab_split is None else vocab_split
    vocab = _chunks(cfg.n_vocab, n)
    laid: dict[int, object] = {}  # tables and heads by identity: tied ones stay tied

    def once(x, make):
        if id(x) not in laid:
            laid[id(x)] = make(x)
        return laid[id(x)]

    table = lambda x: once(x, lambda t: t if isinstance(t, BlockRows) else np.asarray(t))
    head = lambda x: once(x, lambda h: _split_outputs(h, vocab, report) if vocab_split else _kept(h))
    mtp = weights.mtp
    if mtp is not None:
        mtp = Mtp(eh_proj=_kept(mtp.eh_proj), enorm=np.asarray(mtp.enorm), hnorm=np.asarray(mtp.hnorm),
                  head_norm=np.asarray(mtp.head_norm), embed=table(mtp.embed), head=head(mtp.head),
                  layer=_lay_out_layer(mtp.layer, cfg, lay, n, units, report, "MTP layer"))
    layers = tuple(_lay_out_layer(l, cfg, lay, n, units, report, f"layer {i}") for i, l in enumerate(weights.layers))
    return Weights(embed=table(weights.embed), output_norm=np.asarray(weights.output_norm),
                   output=head(weights.output), layers=layers, mtp=mtp), report


def _device_chunks(w, n: int) -> list:
    """A laid-out column-parallel weight (device-major along its outputs) as its n devices' own weights."""
    if isinstance(w, BlockRows):
        return [dataclasses.replace(w, blocks=b) for b in np.split(np.asarray(w.blocks), n, axis=-2)]
    if isinstance(w, Q8Rows):
        return [Q8Rows(q, s) for q, s in zip(np.split(np.asarray(w.quants), n), np.split(np.asarray(w.scales), n))]
    if isinstance(w, Transposed):
        return [Transposed(t) for t in np.split(np.asarray(w.t), n)]
    return np.split(np.asarray(w), n, axis=-1)


def _joined_outputs(ws: list):
    """The devices' own weights joined device-major along their outputs (the inverse of `_device_chunks`)."""
    first = ws[0]
    if isinstance(first, BlockRows):
        return dataclasses.replace(first, blocks=np.concatenate([np.asarray(w.blocks) for w in ws], axis=-2))
    if isinstance(first, Q8Rows):
        return Q8Rows(np.concatenate([np.asarray(w.quants) for w in ws]),
                      np.concatenate([np.asarray(w.scales) for w in ws]))
    if isinstance(first, Transposed):
        return Transposed(np.concatenate([np.asarray(w.t) for w in ws]))
    return np.concatenate(ws, axis=-1)


def _fused_on_each_device(obj, n: int):
    """A laid-out weights dataclass with the products that share an input fused on each device, as
    `weights.fuse_fields` fuses them on one: each device's parts side by side ([q_d | k_d | v_d]), joined
    device-major, so that a shard holds its own fused weight and runs one product where it ran several."""
    names = [name for name in _FUSED_FIELDS.get(type(obj), ()) if getattr(obj, name) is not None]
    if len(names) < 2:
        return obj
    chunks = {name: _device_chunks(getattr(obj, name), n) for name in names}
    fused = [fuse_fields(dataclasses.replace(obj, **{name: chunks[name][d] for name in names}), names)
             for d in range(n)]
    joined = {}
    for name in names:
        parts = [getattr(f, name) for f in fused]
        if parts[0] is None:
            joined[name] = None
        elif isinstance(parts[0], Fused):
            joined[name] = Fused(_joined_outputs([p.w for p in parts]), parts[0].sizes)
    return dataclasses.replace(obj, **joined)


def fuse_on_each_device(weights: Weights, n: int) -> Weights:
    """Laid-out weights (`lay_out_weights`) with every layer's products that share an input fused on each of the n
    devices (`_fused_on_each_device`): a GDN mixer's four input projections, an attention's q, k and v, an FFN's
    gate and up, where their forms match."""
    def layer(l: Layer) -> Layer:
        return dataclasses.replace(l, mixer=_fused_on_each_device(l.mixer, n), ffn=_fused_on_each_device(l.ffn, n))

    mtp = weights.mtp and dataclasses.replace(weights.mtp, layer=layer(weights.mtp.layer))
    return dataclasses.replace(weights, layers=tuple(layer(l) for l in weights.layers), mtp=mtp)


# -------------------------------------------------------------------------------------------------- the specs


def _matmul_spec(w, split: str, experts: bool = False):
    """The spec of a matmul weight [.., n_in, n_out] (in any stored form) split over its "out"puts (column
    parallel) or "in"puts (row parallel); experts: its leading axis (routed experts) split over EXPERT_AXIS."""
    if w is None:
        return None
    if isinstance(w, Transposed):
        return Transposed(P(AXIS, None) if split == "out" else P(None, AXIS))
    if isinstance(w, GatheredInputs):
        return dataclasses.replace(w, w=_tree_spec(w.w, REPLICATED))
    if isinstance(w, Fused):
        return Fused(_matmul_spec(w.w, split, experts), w.sizes)
    if isinstance(w, Q8Rows):  # [n_out, n_in] and [n_out, n_in / 32]
        spec = P(AXIS, None) if split == "out" else P(None, AXIS)
        return Q8Rows(spec, spec)
    if isinstance(w, BlockRows):  # [..., n_out, row_bytes]: whole rows or whole blocks of each row
        lead = (EXPERT_AXIS,) + (None,) * (w.blocks.ndim - 3) if experts else (None,) * (w.blocks.ndim - 2)
        return dataclasses.replace(w, blocks=P(*lead, AXIS, None) if split == "out" else P(*lead, None, AXIS))
    lead = (EXPERT_AXIS,) + (None,) * (np.ndim(w) - 3) if experts else (None,) * (np.ndim(w) - 2)
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
    return MoeFfn(router=_tree_spec(w.router, REPLICATED), gate=_matmul_spec(w.gate, "out", experts=True),
                  up=_matmul_spec(w.up, "out", experts=True), down=_matmul_spec(w.down, "in", experts=True),
                  shared_router=REPLICATED,
                  shared_gate=_matmul_spec(w.shared_gate, "out"), shared_up=_matmul_spec(w.shared_up, "out"),
                  shared_down=_matmul_spec(w.shared_down, "in"))


def _layer_specs(layer: Layer) -> Layer:
    return Layer(attn_norm=REPLICATED, post_norm=REPLICATED, mixer=mixer_specs(layer.mixer), ffn=ffn_specs(layer.ffn))


def _head_spec(w, vocab_split: bool):
    return _matmul_spec(w, "out") if vocab_split else _tree_spec(w, REPLICATED)


def _table_spec(table, vocab_split: bool):
    """An embedding table [V, E] (or its blocks [V, row_bytes]) split over its rows, the vocabulary."""
    if not vocab_split:
        return _tree_spec(table, REPLICATED)
    return dataclasses.replace(table, blocks=P(AXIS, None)) if isinstance(table, BlockRows) else P(AXIS, None)


def weight_specs(weights: Weights, vocab_split: bool):
    """The PartitionSpec of every leaf of laid-out weights (`lay_out_weights`), as a tree of their classes."""
    mtp = weights.mtp
    if mtp is not None:
        mtp = Mtp(eh_proj=_tree_spec(mtp.eh_proj, REPLICATED), enorm=REPLICATED, hnorm=REPLICATED,
                  head_norm=REPLICATED, embed=_table_spec(mtp.embed, vocab_split),
                  head=_head_spec(mtp.head, vocab_split), layer=_layer_specs(mtp.layer))
    return Weights(embed=_table_spec(weights.embed, vocab_split), output_norm=REPLICATED,
                   output=_head_spec(weights.output, vocab_split),
                   layers=tuple(_layer_specs(l) for l in weights.layers), mtp=mtp)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def named(mesh: Mesh, specs):
    """A tree of PartitionSpecs as NamedShardings on mesh."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_weights(weights: Weights, cfg: ModelConfig, tp: TensorParallel,
                  transpose: bool) -> tuple[Weights, LayoutReport]:
    """The weights laid out for tp's mesh (`lay_out_weights`) and placed on it, tied arrays placed once; and what
    the layout did. transpose: store large float32 matmul weights transposed for the CPU few-row kernel
    (`precision.transpose_matmul_weights`), as `load_model` does."""
    from .precision import transpose_matmul_weights

    laid, report = lay_out_weights(weights, cfg, tp.size, tp.vocab_split, tp.units)
    if transpose:
        laid = transpose_matmul_weights(laid)
    laid = fuse_on_each_device(laid, tp.size)
    leaves, tree = jax.tree.flatten(laid)
    shardings = jax.tree.leaves(named(tp.mesh, weight_specs(laid, tp.vocab_split)))
    placed: dict[tuple, jax.Array] = {}
    for leaf, where in zip(leaves, shardings, strict=True):
        if (id(leaf), where) not in placed:
            placed[id(leaf), where] = jax.device_put(leaf, where)
    return jax.tree.unflatten(tree, [placed[id(leaf), where] for leaf, where in zip(leaves, shardings)]), report


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
        rows = table.blocks.shape[0] if isinstance(table, BlockRows) else table.shape[0]
        local = tokens - jax.lax.axis_index(AXIS) * rows
        inside = (local >= 0) & (local < rows)
        found = embedding_rows(table, jnp.where(inside, local, 0))
        return _psum(tp, jnp.where(inside[..., None], found, 0.0), AXIS)

    return _per_shard(tp, body, (_table_spec(table, True), REPLICATED), REPLICATED)(table, tokens)


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
