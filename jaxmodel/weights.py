"""The weights pytree. Matmul weights are [n_in, n_out], y = x @ W: the transpose of GGUF's numpy order (docs/model.md §0),
which the loader and writer swap, because XLA's CPU matrix-vector product streams this layout about twice as fast.
On CPU `load_model` keeps Q8_0 ones as the file's blocks (`Q8Rows`), the other block-quantized ones (K-quants, Q4_0,
Q5_0, IQ4_XS) as the file's bytes (`BlockRows`, also embedding tables and MoE expert stacks) and stores large
float32 ones back in GGUF's order (`Transposed`), for the CPU kernels (`jaxmodel.kernels.cpu_matmul`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import quant_blocks
from .kernels.cpu_matmul import (ROW_GROUPS, Q8_ROW_GROUP, file_order_block_rows, file_order_q8_rows,
                                 interleave_block_rows, interleave_q8_rows)


def pytree(cls):
    """A frozen dataclass whose fields are all pytree children."""
    return jax.tree_util.register_dataclass(dataclass(frozen=True)(cls))


@pytree
class Transposed:
    """A matmul weight [n_in, n_out] stored as its transpose [n_out, n_in] (GGUF's order), for the CPU few-row
    product (`jaxmodel.kernels.cpu_matmul`); `load_model` stores them so on CPU, and `layers.linear` takes either.
    shape and dtype are the weight's, as the [n_in, n_out] array would have them."""

    t: jax.Array  # [n_out, n_in]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.t.shape[1], self.t.shape[0])

    @property
    def dtype(self):
        return self.t.dtype


@pytree
class Q8Rows:
    """A matmul weight [n_in, n_out] kept as the file's Q8_0 blocks, one row per output (GGUF's order): int8 quants
    and one float32 scale (the file's f16) per 32 inputs, for the CPU Q8_0 product
    (`jaxmodel.kernels.cpu_matmul.q8_rows_matmul`); `load_model` keeps Q8_0 matmul weights so on CPU, and
    `layers.linear` takes it. Both arrays hold the product's order: groups of eight rows, four bytes of each in
    turn (`cpu_matmul.interleave_q8_rows`; `from_file_order`, `file_order`). shape and dtype are those of the
    dequantized [n_in, n_out] float32 weight."""

    quants: jax.Array  # [n_out, n_in] int8, interleaved by groups of eight rows
    scales: jax.Array  # [n_out, n_in / 32] float32, likewise

    @staticmethod
    def from_file_order(quants, scales) -> "Q8Rows":
        """From quants [n_out, n_in] and scales [n_out, n_in / 32] in the file's order."""
        return Q8Rows(*interleave_q8_rows(quants, scales))

    def file_order(self) -> tuple[jax.Array, jax.Array]:
        """(quants, scales) in the file's order."""
        return file_order_q8_rows(self.quants, self.scales)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.quants.shape[1], self.quants.shape[0])

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def outputs(self, index) -> "Q8Rows":
        """The weight restricted to the outputs `index` selects (a slice or an index array). A prefix of whole groups
        of rows is a prefix of the arrays; anything else goes through the file's order."""
        n_out = self.quants.shape[0]
        if isinstance(index, slice) and index.step in (None, 1) and index.start in (None, 0):
            stop = n_out if index.stop is None else min(index.stop, n_out)
            if stop == n_out or stop % Q8_ROW_GROUP == 0:
                return Q8Rows(self.quants[:stop], self.scales[:stop])
        quants, scales = self.file_order()
        return Q8Rows.from_file_order(quants[index], scales[index])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks"],
                   meta_fields=["qtype", "compute_dtype", "row_group"])
@dataclass(frozen=True)
class BlockRows:
    """A matmul weight [..., n_in, n_out] (or an embedding table [V, E]: n_out = V rows of n_in = E) kept as its
    file's ggml blocks, one row of bytes per output (GGUF's order), for the CPU block product
    (`cpu_matmul.block_rows_matmul`) or, elsewhere (accelerators; types the CPU kernels lack), dequantized inside
    the step (`quant_blocks.dequantize`) and rounded to compute_dtype, the dtype the backend multiplies its float
    weights in (`precision.cast_matmul_weights`): the values a float copy made at load would hold. Leading
    dimensions are MoE experts. shape and dtype are those of the dequantized [..., n_in, n_out] weight.

    row_group > 1 (2-D Q4_0 and Q4_K weights on CPU, `precision.group_block_rows`): the rows' bytes in groups of
    that many, in the order of the CPU product over row groups (`cpu_matmul.interleave_block_rows`; `file_order`
    undoes it)."""

    blocks: jax.Array  # [..., n_out, row_bytes] uint8
    qtype: int  # ggml type (gguf.GGMLQuantizationType)
    compute_dtype: str = "float32"  # "float32" | "bfloat16"
    row_group: int = 1  # 1: the file's order

    @property
    def n_in(self) -> int:
        """Inputs per row: the row's blocks times their weights (a shard's own, under tensor parallelism)."""
        fmt = quant_blocks.FORMATS[self.qtype]
        return self.blocks.shape[-1] // fmt.block_bytes * fmt.block

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.blocks.shape[:-2], self.n_in, self.blocks.shape[-2])

    @property
    def dtype(self):
        return np.dtype(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def __getitem__(self, expert) -> "BlockRows":
        """One expert's weight (a leading index)."""
        return dataclasses.replace(self, blocks=self.blocks[expert])

    def file_order(self) -> "BlockRows":
        """The weight with its rows in the file's order."""
        if self.row_group == 1:
            return self
        return dataclasses.replace(self, blocks=file_order_block_rows(self.blocks, self.qtype), row_group=1)

    def grouped(self) -> "BlockRows":
        """The weight with its rows in groups for the CPU product over row groups (a 2-D Q4_0 or Q4_K weight)."""
        if self.row_group != 1:
            return self
        return dataclasses.replace(self, blocks=interleave_block_rows(self.blocks, self.qtype),
                                   row_group=ROW_GROUPS[self.qtype])

    def outputs(self, index) -> "BlockRows":
        """The weight restricted to the outputs `index` selects (a slice or an index array). In row groups, a
        prefix of whole groups is a prefix of the rows; anything else goes through the file's order."""
        if self.row_group != 1:
            n_out = self.blocks.shape[0]
            if isinstance(index, slice) and index.step in (None, 1) and index.start in (None, 0):
                stop = n_out if index.stop is None else min(index.stop, n_out)
                if stop == n_out or stop % self.row_group == 0:
                    return dataclasses.replace(self, blocks=self.blocks[:stop])
            return self.file_order().outputs(index).grouped()
        return dataclasses.replace(self, blocks=self.blocks[..., index, :])

    def rows(self, index: jax.Array) -> jax.Array:
        """Rows `index` [...] dequantized, [..., n_in] float32 (holding compute_dtype's values): an embedding
        table's lookup."""
        rows = quant_blocks.dequantize_rows(self.file_order().blocks, self.qtype, index)
        return rows if self.compute_dtype == "float32" else rows.astype(self.compute_dtype).astype(jnp.float32)

    def dequantized(self) -> jax.Array:
        """The weight [..., n_in, n_out] in compute_dtype."""
        blocks = self.file_order().blocks
        return jnp.swapaxes(quant_blocks.dequantize(blocks, self.qtype), -1, -2).astype(self.compute_dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["order", "axis"])
@dataclass(frozen=True)
class GatheredInputs:
    """A row-parallel product's block weight (`jaxmodel.sharding`) whose inputs do not split into whole blocks per
    device, held whole on every device of the mesh axis `axis`: the devices' inputs are all-gathered and put into
    the weight's input order (input i is gathered position order[i]), and the first device multiplies them while
    the others add 0 to the block's sum, so the product, the activation's quantization included, is one device's
    (`layers.linear`). shape and dtype are the whole weight's."""

    w: "MatmulWeight"
    order: tuple[int, ...]
    axis: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype


MatmulWeight = Union[jax.Array, Transposed, Q8Rows, BlockRows, GatheredInputs]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["sizes"])
@dataclass(frozen=True)
class Fused:
    """Matmul weights that multiply the same input, stored as one [n_in, sum(sizes)] weight of their common form, so
    that a step runs one product where it ran len(sizes) (`layers.project`). At a small model's sizes a product
    costs mostly its launch, so two products instead of six (the GDN input projections, the FFN's gate and up) save
    a good part of that time (docs/performance.md, "What an iteration costs"). Through the CPU kernels (Q8_0
    blocks, transposed float32) each output column is summed as it was alone, so results are bit for bit unchanged;
    plain arrays go through XLA's dot, which may sum a wider product in another order."""

    w: MatmulWeight  # [n_in, sum(sizes)]
    sizes: tuple[int, ...]  # n_out of each part, in order

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype


def _form(w) -> tuple | None:
    """What weights must share to be stored as one: their kind, dtype and inputs (None: never fused)."""
    if isinstance(w, Q8Rows):
        return ("q8_0", w.quants.shape[1])
    if isinstance(w, BlockRows):
        return ("blocks", w.qtype, w.n_in, w.compute_dtype, w.row_group) if w.blocks.ndim == 2 else None
    if isinstance(w, Transposed):
        return ("transposed", w.t.dtype, w.t.shape[1])
    if isinstance(w, (np.ndarray, jax.Array)) and w.ndim == 2:
        return ("array", w.dtype, w.shape[0])
    return None


def fuse(ws: Sequence[MatmulWeight]) -> Fused:
    """Weights of one form (`_form`) over the same input as one `Fused` weight."""
    first = ws[0]
    if isinstance(first, Q8Rows):
        parts = [x.file_order() for x in ws]
        w = Q8Rows.from_file_order(np.concatenate([np.asarray(q) for q, _ in parts]),
                                   np.concatenate([np.asarray(s) for _, s in parts]))
    elif isinstance(first, BlockRows):
        w = dataclasses.replace(first.file_order(),
                                blocks=np.concatenate([np.asarray(x.file_order().blocks) for x in ws]))
        w = w if first.row_group == 1 else w.grouped()
    elif isinstance(first, Transposed):
        w = Transposed(np.concatenate([np.asarray(x.t) for x in ws]))
    else:
        w = np.concatenate([np.asarray(x) for x in ws], axis=1)
    return Fused(w, tuple(x.shape[1] for x in ws))


def fuse_fields(obj, names: Sequence[str]):
    """obj (a weights dataclass) with each run of consecutive fields among `names` (in that order) that share a form
    stored as one `Fused` weight in the run's first field and None in the others; `layers.project` undoes it."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    run: list[str] = []
    for name in [*names, None]:
        form = _form(values[name]) if name is not None else None
        if run and (form is None or form != _form(values[run[0]])):
            if len(run) > 1:
                values[run[0]] = fuse([values[n] for n in run])
                values.update({n: None for n in run[1:]})
            run = []
        if form is not None:
            run.append(name)
    return type(obj)(**values)


def first_columns(w: MatmulWeight, n: int | None) -> MatmulWeight:
    """w [n_in, n_out] restricted to its first n outputs ([n_in, n]); all of them when n is None."""
    if n is None:
        return w
    if isinstance(w, (Q8Rows, BlockRows)):
        return w.outputs(slice(None, n))
    return Transposed(w.t[:n]) if isinstance(w, Transposed) else w[:, :n]


def embedding_rows(table: jax.Array | BlockRows, tokens: jax.Array) -> jax.Array:
    """table [V, E] (an array or `BlockRows`) looked up at tokens [...] -> [..., E] float32."""
    if isinstance(table, BlockRows):
        return table.rows(tokens)
    return table[tokens].astype(jnp.float32)


@pytree
class DenseFfn:
    gate: jax.Array  # [E, F]
    up: jax.Array  # [E, F]
    down: jax.Array  # [F, E]


@pytree
class MoeFfn:
    router: jax.Array  # [E, X]
    gate: jax.Array  # [X, E, Fe]
    up: jax.Array  # [X, E, Fe]
    down: jax.Array  # [X, Fe, E]
    shared_router: jax.Array  # [E]  sigmoid gate of the shared expert
    shared_gate: jax.Array  # [E, Fs]
    shared_up: jax.Array  # [E, Fs]
    shared_down: jax.Array  # [Fs, E]


@pytree
class Attention:
    q: jax.Array  # [E, 2 H D]  per head [q (D) | gate (D)]
    k: jax.Array  # [E, Hkv D]
    v: jax.Array  # [E, Hkv D]
    o: jax.Array  # [H D, E]
    q_norm: jax.Array  # [D]
    k_norm: jax.Array  # [D]
    q_bias: jax.Array | None = None  # [2 H D]
    k_bias: jax.Array | None = None  # [Hkv D]
    v_bias: jax.Array | None = None  # [Hkv D]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["qkv", "gate", "conv", "dt_bias", "a", "beta", "alpha", "norm", "out"],
                   meta_fields=["out_heads"])  # fmt: skip
@dataclass(frozen=True)
class GatedDeltaNet:
    """Value heads in tiled order (value head h uses key head h % Hk); qwen3next's grouped heads are permuted
    into it at load, except the inputs of a block `out` (moving them would split blocks): that keeps the file's
    order, `out_heads` naming the value head each group of Dv inputs takes."""

    qkv: jax.Array  # [E, C]  output [q: Hk Dk | k: Hk Dk | v: Hv Dv]
    gate: jax.Array  # [E, Hv Dv]  z
    conv: jax.Array  # [C, Kc]
    dt_bias: jax.Array  # [Hv]
    a: jax.Array  # [Hv]  = -exp(A_log)
    beta: jax.Array  # [E, Hv]
    alpha: jax.Array  # [E, Hv]
    norm: jax.Array  # [Dv]
    out: jax.Array  # [Hv Dv, E]
    out_heads: tuple[int, ...] | None = None  # [Hv]; None: tiled order


@pytree
class Layer:
    attn_norm: jax.Array  # [E]
    post_norm: jax.Array  # [E]
    mixer: Attention | GatedDeltaNet
    ffn: DenseFfn | MoeFfn


@pytree
class Mtp:
    eh_proj: jax.Array  # [2E, E]  input [enorm(embedding) | hnorm(hidden)]
    enorm: jax.Array  # [E]
    hnorm: jax.Array  # [E]
    head_norm: jax.Array  # [E]
    embed: jax.Array  # [V, E]
    head: jax.Array  # [E, V]
    layer: Layer  # attention mixer


@pytree
class Weights:
    embed: jax.Array  # [V, E]
    output_norm: jax.Array  # [E]
    output: jax.Array  # [E, V]  (the embedding's transpose when tied)
    layers: tuple[Layer, ...]
    mtp: Mtp | None = None


def fuse_layer(l: Layer) -> Layer:
    """One layer's products that share an input stored as one where their forms allow (`fuse_projections`)."""
    if isinstance(l.mixer, GatedDeltaNet):
        mixer = fuse_fields(l.mixer, ("qkv", "gate", "beta", "alpha"))
    else:
        mixer = fuse_fields(l.mixer, ("q", "k", "v"))
    ffn = fuse_fields(l.ffn, ("gate", "up") if isinstance(l.ffn, DenseFfn) else ("shared_gate", "shared_up"))
    return dataclasses.replace(l, mixer=mixer, ffn=ffn)


def fuse_projections(weights: Weights) -> Weights:
    """`weights` with the products that share an input stored as one where their forms allow (`fuse_fields`): a GDN
    mixer's q/k/v, z, beta and alpha projections, an attention's q, k and v, an FFN's gate and up (also the MoE
    shared expert's), in every layer and the MTP block's. For inference only (`layers.project` reads them; the
    GGUF writer and training take unfused weights). The old and new arrays coexist until the caller drops the old
    tree (load time only); layers fused already stay as they are."""
    mtp = weights.mtp and dataclasses.replace(weights.mtp, layer=fuse_layer(weights.mtp.layer))
    return dataclasses.replace(weights, layers=tuple(fuse_layer(l) for l in weights.layers), mtp=mtp)
