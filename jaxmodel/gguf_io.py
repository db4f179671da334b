"""GGUF -> (ModelConfig, Weights) and Weights -> GGUF, in the tensor layout of docs/model.md §3."""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

from .config import ModelConfig, ModelFormatError, from_gguf
from .gguf_layout import checked_reader, open_gguf
from .tokenizer import CONTROL, NORMAL, UNUSED, GGUFVocab, byte_decoder, write_vocab
from .quant_blocks import row_bytes
from .weights import Attention, BlockRows, DenseFfn, GatedDeltaNet, Layer, MoeFfn, Mtp, Q8Rows, Weights

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                   QT.IQ4_NL, QT.IQ4_XS)


class _Tensors:
    """Name -> float32 numpy array (or `Q8Rows`, or `BlockRows`), with type and shape checks that name the file and
    tensor."""

    def __init__(self, reader: gguf.GGUFReader, path: str, keep_f16: bool, keep_q8_0: bool = False,
                 keep_blocks: frozenset = frozenset()):
        self.path = path
        self.keep_f16 = keep_f16
        self.keep_q8_0 = keep_q8_0
        self.keep_blocks = keep_blocks
        self.by_name = {t.name: t for t in reader.tensors}
        self.file_size = os.path.getsize(path)

    def has(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str, *shapes: tuple[int, ...]) -> np.ndarray:
        t = self.by_name.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path}: missing tensor '{name}' (expected shape {shapes[0]})")
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise ModelFormatError(f"{self.path}: tensor '{name}' has unsupported type {t.tensor_type.name} (supported: {names})")
        data = np.asarray(t.data)
        if t.tensor_type == QT.F16 and self.keep_f16:
            array = data.astype(np.float16)
        elif t.tensor_type in (QT.F32, QT.F16):
            array = data.astype(np.float32)
        else:
            array = quants.dequantize(data, t.tensor_type).astype(np.float32)
        for shape in shapes:
            if tuple(array.shape) == tuple(shape):
                return np.ascontiguousarray(array)
        want = " or ".join(str(tuple(s)) for s in shapes)
        raise ModelFormatError(f"{self.path}: tensor '{name}' has shape {tuple(array.shape)}, expected {want}")

    def maybe(self, name: str, *shapes: tuple[int, ...]) -> np.ndarray | None:
        return self.get(name, *shapes) if self.has(name) else None

    def matmul(self, name: str, shape: tuple[int, ...], quantized: bool = True) -> np.ndarray | Q8Rows | BlockRows:
        """A matmul weight stored [..., n_out, n_in], returned in the pytree's [..., n_in, n_out] layout; with
        keep_q8_0, a 2-D Q8_0 one as the file's blocks (`Q8Rows`), and one of a type in keep_blocks as the file's
        bytes (`BlockRows`), unless quantized is False."""
        if quantized and self.keeps_blocks(name, shape):
            return self._q8_rows(name, shape)
        if quantized and self._kept_as_bytes(name):
            return self._block_rows(name, shape)
        return np.ascontiguousarray(np.swapaxes(self.get(name, shape), -1, -2))

    def table(self, name: str, shape: tuple[int, int]) -> np.ndarray | BlockRows:
        """An embedding table [V, E]: float32, or `BlockRows` (V rows of E) for a type in keep_blocks."""
        return self._block_rows(name, shape) if self._kept_as_bytes(name) else self.get(name, shape)

    def _kept_as_bytes(self, name: str) -> bool:
        t = self.by_name.get(name)
        return t is not None and t.tensor_type in self.keep_blocks

    def _block_rows(self, name: str, shape: tuple[int, ...]) -> BlockRows:
        """The tensor's bytes as `BlockRows`, read from the file (not through the reader's mapping, whose pages
        would stay resident beside the copy)."""
        t = self.by_name[name]
        where = f"{self.path}: tensor '{name}' ({t.tensor_type.name})"
        stored = tuple(int(n) for n in reversed(t.shape))
        if stored != tuple(shape):
            raise ModelFormatError(f"{where} has shape {stored}, expected {tuple(shape)}")
        try:
            per_row = row_bytes(t.tensor_type, shape[-1])
        except ValueError:
            raise ModelFormatError(f"{where}: rows of {shape[-1]} weights are not a whole number of "
                                   f"{gguf.GGML_QUANT_SIZES[t.tensor_type][0]}-weight blocks") from None
        n_bytes = per_row * int(np.prod(shape[:-1]))
        if int(t.data_offset) + n_bytes > self.file_size:
            raise ModelFormatError(f"{where}: its {n_bytes} bytes at offset {int(t.data_offset)} run past the end "
                                   f"of the file ({self.file_size} bytes): the file is truncated")
        data = np.fromfile(self.path, dtype=np.uint8, count=n_bytes, offset=int(t.data_offset))
        return BlockRows(data.reshape(*shape[:-1], per_row), int(t.tensor_type))

    def keeps_blocks(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether `matmul` returns the tensor as the file's Q8_0 blocks (`Q8Rows`)."""
        t = self.by_name.get(name)
        return self.keep_q8_0 and len(shape) == 2 and t is not None and t.tensor_type == QT.Q8_0

    def _q8_rows(self, name: str, shape: tuple[int, int]) -> Q8Rows:
        data = np.asarray(self.by_name[name].data)
        if data.ndim != 2:
            raise ModelFormatError(f"{self.path}: tensor '{name}' has {data.ndim} dims, expected {tuple(shape)}")
        rows = q8_rows_from_blocks(data)
        if rows.quants.shape != tuple(shape):
            raise ModelFormatError(f"{self.path}: tensor '{name}' has shape {rows.quants.shape}, expected {tuple(shape)}")
        return rows


def q8_rows_from_blocks(data: np.ndarray) -> Q8Rows:
    """A Q8_0 tensor's raw rows [n_out, n_in / 32 * 34] (uint8: per block an f16 scale, then 32 int8 quants, as
    GGUF stores them and `gguf.quants.quantize` writes them) -> `Q8Rows` (in the CPU product's order)."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[QT.Q8_0]
    n_out, n_in = data.shape[0], data.shape[1] // block_bytes * block_size
    blocks = data.reshape(n_out, n_in // block_size, block_bytes)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n_out, n_in / 32]
    quants = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n_out, n_in)
    return Q8Rows.from_file_order(quants, scales)


def _split_outputs(w: np.ndarray | Q8Rows, sections: list[int]) -> list[np.ndarray | Q8Rows]:
    """w [n_in, n_out] split at the given output indices."""
    if isinstance(w, (Q8Rows, BlockRows)):
        bounds = [0, *sections, w.shape[1]]
        return [w.outputs(slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    return np.split(w, sections, axis=1)


def _attention(ts: _Tensors, p: str, cfg: ModelConfig) -> Attention:
    E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    if ts.has(p + "attn_qkv.weight"):
        fused = ts.matmul(p + "attn_qkv.weight", (2 * H * D + 2 * Hkv * D, E))
        q, k, v = _split_outputs(fused, [2 * H * D, 2 * H * D + Hkv * D])
        bias = ts.maybe(p + "attn_qkv.bias", (2 * H * D + 2 * Hkv * D,))
        q_bias, k_bias, v_bias = np.split(bias, [2 * H * D, 2 * H * D + Hkv * D]) if bias is not None else (None,) * 3
    else:
        q = ts.matmul(p + "attn_q.weight", (2 * H * D, E))
        k = ts.matmul(p + "attn_k.weight", (Hkv * D, E))
        v = ts.matmul(p + "attn_v.weight", (Hkv * D, E))
        q_bias = ts.maybe(p + "attn_q.bias", (2 * H * D,))
        k_bias = ts.maybe(p + "attn_k.bias", (Hkv * D,))
        v_bias = ts.maybe(p + "attn_v.bias", (Hkv * D,))
    return Attention(
        q=q, k=k, v=v,
        o=ts.matmul(p + "attn_output.weight", (E, H * D)),
        q_norm=ts.get(p + "attn_q_norm.weight", (D,)),
        k_norm=ts.get(p + "attn_k_norm.weight", (D,)),
        q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
    )  # fmt: skip


def _gdn(ts: _Tensors, p: str, cfg: ModelConfig) -> GatedDeltaNet:
    E, C, Hv, Dv, Kc = cfg.n_embd, cfg.conv_channels, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    return GatedDeltaNet(
        qkv=ts.matmul(p + "attn_qkv.weight", (C, E)),
        gate=ts.matmul(p + "attn_gate.weight", (Hv * Dv, E)),
        conv=ts.get(p + "ssm_conv1d.weight", (C, Kc)),
        dt_bias=ts.get(p + "ssm_dt.bias", (Hv,)),
        a=ts.get(p + "ssm_a", (Hv,)),
        beta=ts.matmul(p + "ssm_beta.weight", (Hv, E)),
        alpha=ts.matmul(p + "ssm_alpha.weight", (Hv, E)),
        norm=ts.get(p + "ssm_norm.weight", (Dv,)),
        out=ts.matmul(p + "ssm_out.weight", (E, Hv * Dv)),
    )


def tiled_head_order(n_key_heads: int, n_value_heads: int) -> np.ndarray:
    """[Hv] int: tiled value head p is grouped value head (p % Hk) * r + p // Hk, r = Hv / Hk.

    Grouped order (qwen3next files) gives value head g*r+i key head g; tiled order (qwen3.5 files, and our GDN
    mixer and kernels) gives value head p key head p % Hk. Both pair every value head with the same key head,
    so permuting the value-head-indexed weights turns one layout into the other exactly."""
    r = n_value_heads // n_key_heads
    p = np.arange(n_value_heads)
    return (p % n_key_heads) * r + p // n_key_heads


def _output_rows(ts: _Tensors, name: str, shape: tuple[int, ...], index: np.ndarray) -> np.ndarray | BlockRows:
    """`ts.matmul(name, shape)` with its output rows taken in `index` order. A block weight keeps its blocks (a
    row's blocks are its own); an interleaved Q8_0 one is dequantized."""
    w = ts.matmul(name, shape)
    if isinstance(w, BlockRows):
        return w.outputs(index)
    if not isinstance(w, np.ndarray):
        w = ts.matmul(name, shape, quantized=False)
    return np.ascontiguousarray(w[..., index])


def _gdn_grouped(ts: _Tensors, p: str, cfg: ModelConfig) -> GatedDeltaNet:
    """A qwen3next GDN layer: fused attn_qkv + attn_gate (or the legacy per-key-head ssm_in), ssm_ba, value
    heads grouped by key head; returned with value heads in tiled order. The projections' output rows are
    reordered, so block weights stay blocks; a block ssm_out keeps its inputs in the file's order (reordering
    them would split blocks) and names it in `out_heads`, so that the GDN output's heads are reordered instead."""
    E, C, Hk, Hv, Dk, Kc = cfg.n_embd, cfg.conv_channels, cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    r, n_qk = Hv // Hk, 2 * Hk * Dk
    order = tiled_head_order(Hk, Hv)
    if not ts.has(p + "ssm_in.weight"):  # fused attn_qkv and attn_gate
        head_rows = (order[:, None] * Dk + np.arange(Dk)).reshape(-1)  # tiled head p's rows in grouped order
        group, i = order // r, order % r  # ssm_ba holds, per key head, r rows of beta then r of alpha
        conv = ts.get(p + "ssm_conv1d.weight", (C, Kc))
        out, out_heads = ts.matmul(p + "ssm_out.weight", (E, Hv * Dk)), tuple(int(h) for h in np.argsort(order))
        if not isinstance(out, BlockRows):  # a float weight takes its inputs in tiled order
            out = ts.matmul(p + "ssm_out.weight", (E, Hv * Dk), quantized=False)
            out, out_heads = np.ascontiguousarray(out.reshape(Hv, Dk, E)[order].reshape(Hv * Dk, E)), None
        return GatedDeltaNet(
            qkv=_output_rows(ts, p + "attn_qkv.weight", (C, E), np.concatenate([np.arange(n_qk), n_qk + head_rows])),
            gate=_output_rows(ts, p + "attn_gate.weight", (Hv * Dk, E), head_rows),
            conv=np.concatenate([conv[:n_qk], conv[n_qk:][head_rows]]),
            dt_bias=ts.get(p + "ssm_dt.bias", (Hv,))[order],
            a=ts.get(p + "ssm_a", (Hv,))[order],
            beta=_output_rows(ts, p + "ssm_ba.weight", (2 * Hv, E), group * 2 * r + i),
            alpha=_output_rows(ts, p + "ssm_ba.weight", (2 * Hv, E), group * 2 * r + r + i),
            norm=ts.get(p + "ssm_norm.weight", (Dk,)),
            out=out,
            out_heads=out_heads,
        )  # fmt: skip
    # The legacy per-key-head ssm_in: [q Dk | k Dk | v r*Dv | z r*Dv] output rows per key head, dequantized.
    fused = ts.get(p + "ssm_in.weight", (n_qk + 2 * Hv * Dk, E)).reshape(Hk, 2 * Dk + 2 * r * Dk, E)
    q, k, v, z = np.split(fused, [Dk, 2 * Dk, 2 * Dk + r * Dk], axis=1)
    qkv = np.concatenate([q.reshape(-1, E), k.reshape(-1, E), v.reshape(-1, E)])  # [C, E]
    gate = z.reshape(Hv * Dk, E)
    ba = ts.get(p + "ssm_ba.weight", (2 * Hv, E)).reshape(Hk, 2 * r, E)  # per key head [b r | a r]
    rows = lambda a: np.ascontiguousarray(a.reshape(Hv, -1, *a.shape[1:])[order].reshape(a.shape))
    qkv = np.concatenate([qkv[:n_qk], rows(qkv[n_qk:])])
    conv = ts.get(p + "ssm_conv1d.weight", (C, Kc))
    out = ts.get(p + "ssm_out.weight", (E, Hv * Dk)).reshape(E, Hv, Dk)[:, order].reshape(E, Hv * Dk)
    return GatedDeltaNet(
        qkv=np.ascontiguousarray(qkv.T),
        gate=np.ascontiguousarray(rows(gate).T),
        conv=np.concatenate([conv[:n_qk], rows(conv[n_qk:])]),
        dt_bias=rows(ts.get(p + "ssm_dt.bias", (Hv,))),
        a=rows(ts.get(p + "ssm_a", (Hv,))),
        beta=np.ascontiguousarray(ba[:, :r].reshape(Hv, E)[order].T),
        alpha=np.ascontiguousarray(ba[:, r:].reshape(Hv, E)[order].T),
        norm=ts.get(p + "ssm_norm.weight", (Dk,)),
        out=np.ascontiguousarray(out.T),
    )


def _ffn(ts: _Tensors, p: str, cfg: ModelConfig) -> DenseFfn | MoeFfn:
    E = cfg.n_embd
    if not cfg.is_moe:
        F = cfg.n_ff
        return DenseFfn(
            gate=ts.matmul(p + "ffn_gate.weight", (F, E)),
            up=ts.matmul(p + "ffn_up.weight", (F, E)),
            down=ts.matmul(p + "ffn_down.weight", (E, F)),
        )
    X, Fe, Fs = cfg.n_expert, cfg.n_ff_expert, cfg.n_ff_shared
    if ts.has(p + "ffn_gate_up_exps.weight"):
        gate, up = _split_outputs(ts.matmul(p + "ffn_gate_up_exps.weight", (X, 2 * Fe, E)), [Fe])
    else:
        gate = ts.matmul(p + "ffn_gate_exps.weight", (X, Fe, E))
        up = ts.matmul(p + "ffn_up_exps.weight", (X, Fe, E))
    return MoeFfn(
        router=ts.matmul(p + "ffn_gate_inp.weight", (X, E), quantized=False),  # top-k: kept float32
        gate=gate,
        up=up,
        down=ts.matmul(p + "ffn_down_exps.weight", (X, E, Fe)),
        shared_router=ts.get(p + "ffn_gate_inp_shexp.weight", (E,), (1, E)).reshape(E),
        shared_gate=ts.matmul(p + "ffn_gate_shexp.weight", (Fs, E)),
        shared_up=ts.matmul(p + "ffn_up_shexp.weight", (Fs, E)),
        shared_down=ts.matmul(p + "ffn_down_shexp.weight", (E, Fs)),
    )


def _layer(ts: _Tensors, index: int, cfg: ModelConfig, recurrent: bool) -> Layer:
    p = f"blk.{index}."
    E = cfg.n_embd
    return Layer(
        attn_norm=ts.get(p + "attn_norm.weight", (E,)),
        post_norm=ts.get(p + "post_attention_norm.weight", (E,)),
        mixer=(_gdn_grouped if cfg.grouped_value_heads else _gdn)(ts, p, cfg) if recurrent else _attention(ts, p, cfg),
        ffn=_ffn(ts, p, cfg),
    )


def read_gguf(
    path: str | os.PathLike, *, load_mtp: bool = True, keep_f16: bool = False, keep_q8_0: bool = False,
    keep_blocks=(), finish_layer=None, reader: gguf.GGUFReader | None = None,
) -> tuple[ModelConfig, Weights, gguf.GGUFReader]:
    """Read config and numpy weights (float32, or f16 for F16 tensors with keep_f16, or `Q8Rows` for 2-D Q8_0
    matmul weights with keep_q8_0, or `BlockRows` for matmul weights, expert stacks and embedding tables of the
    ggml types in keep_blocks); every defect raises ModelFormatError naming the file and the tensor. finish_layer
    (optional): applied to each `Layer` as soon as it is read (the loader fuses and places it, so that the numpy
    copies of one layer at a time exist beside the final weights). reader: the file already opened (`open_gguf`),
    which is then not parsed again (one opened otherwise has its header checked first: `gguf_layout`)."""
    path = str(path)
    reader = checked_reader(reader, path) if reader is not None else open_gguf(path)
    cfg = from_gguf(reader, path)
    ts = _Tensors(reader, path, keep_f16, keep_q8_0, frozenset(keep_blocks))
    V, E = cfg.n_vocab, cfg.n_embd
    embed = ts.table("token_embd.weight", (V, E))
    output_norm = ts.get("output_norm.weight", (E,))
    if ts.has("output.weight"):
        output = ts.matmul("output.weight", (V, E))
    elif ts.keeps_blocks("token_embd.weight", (V, E)):
        output = ts.matmul("token_embd.weight", (V, E))  # a tied head multiplies the embedding's blocks
    elif isinstance(embed, BlockRows):
        output = embed  # the same bytes: rows of the table, outputs of the head
    else:
        output = np.ascontiguousarray(embed.T)
    finish = finish_layer or (lambda layer: layer)
    layers = tuple(finish(_layer(ts, i, cfg, cfg.recurrent[i])) for i in range(cfg.n_layer))
    mtp = None
    if cfg.n_mtp and load_mtp:
        p = f"blk.{cfg.n_layer}.nextn."
        mtp = Mtp(
            eh_proj=ts.matmul(p + "eh_proj.weight", (E, 2 * E)),
            enorm=ts.get(p + "enorm.weight", (E,)),
            hnorm=ts.get(p + "hnorm.weight", (E,)),
            head_norm=_or(ts.maybe(p + "shared_head_norm.weight", (E,)), output_norm),
            embed=ts.table(p + "embed_tokens.weight", (V, E)) if ts.has(p + "embed_tokens.weight") else embed,
            head=ts.matmul(p + "shared_head_head.weight", (V, E)) if ts.has(p + "shared_head_head.weight") else output,
            layer=finish(_layer(ts, cfg.n_layer, cfg, recurrent=False)),
        )
    elif not load_mtp:
        cfg = cfg.replace(n_mtp=0)
    weights = Weights(embed=embed, output_norm=output_norm, output=output, layers=layers, mtp=mtp)
    return cfg, weights, reader


def _or(value, fallback):
    return fallback if value is None else value


def to_device(weights: Weights) -> Weights:
    """numpy -> jax arrays of the same dtype, shared (tied) arrays staying shared."""
    seen: dict[int, object] = {}

    def put(x):
        if id(x) not in seen:
            seen[id(x)] = jnp.asarray(x)
        return seen[id(x)]

    return jax.tree_util.tree_map(put, weights)


# ---------------------------------------------------------------------------------------------- export

_EXPORT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q4_0": QT.Q4_0, "q8_0": QT.Q8_0}


def byte_level_vocab(n_vocab: int) -> GGUFVocab:
    """A GPT-2 byte-level vocabulary, padded to n_vocab, with Qwen's three special tokens last.

    Its one merge, "0 0" -> "00" (token 256), never applies: the qwen35 pre-tokenizer splits every digit into a
    piece of its own. It is there because llama.cpp refuses a BPE vocabulary without a `tokenizer.ggml.merges`
    key ("cannot find tokenizer merges in model file") and gguf-py writes no key for an empty array."""
    byte_tokens = [char for char, _ in sorted(byte_decoder().items(), key=lambda item: item[1])]
    merged = ["00"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n_fixed = len(byte_tokens) + len(merged) + len(specials)
    if n_vocab < n_fixed:
        raise ValueError(f"n_vocab {n_vocab} is below the {n_fixed} byte, merged and special tokens")
    pads = [f"[PAD{i}]" for i in range(n_vocab - n_fixed)]
    types = [NORMAL] * (len(byte_tokens) + len(merged)) + [UNUSED] * len(pads) + [CONTROL] * len(specials)
    return GGUFVocab(tokens=tuple(byte_tokens + merged + pads + specials), merges=("0 0",),
                     token_types=tuple(types), bos_id=n_vocab - 3, eos_id=n_vocab - 1, pad_id=n_vocab - 3)  # fmt: skip


def write_gguf(
    path: str | os.PathLike,
    cfg: ModelConfig,
    weights: Weights,
    *,
    vocab: GGUFVocab | None = None,
    dtype: str = "f32",
    name: str = "gdnspec",
) -> None:
    """Write `weights` as a GGUF llama.cpp can load (docs/model.md §3, §9). 2-D matmul weights take `dtype`; norms,
    biases, conv and SSM vectors stay F32. vocab (with its chat template): a byte-level one when not given."""
    if dtype not in _EXPORT_TYPES:
        raise ValueError(f"unsupported export dtype '{dtype}' (one of {', '.join(_EXPORT_TYPES)})")
    qtype = _EXPORT_TYPES[dtype]
    vocab = vocab or byte_level_vocab(cfg.n_vocab)
    arch = cfg.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer + cfg.n_mtp)
    if cfg.n_ff:
        w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rope_dim)
    if cfg.rope_sections is not None:
        w.add_rope_dimension_sections(list(cfg.rope_sections))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state)
    w.add_ssm_group_count(cfg.ssm_groups)
    w.add_ssm_time_step_rank(cfg.ssm_heads)
    w.add_ssm_inner_size(cfg.ssm_heads * cfg.ssm_state)
    w.add_array(f"{arch}.attention.recurrent_layers", [bool(r) for r in cfg.recurrent] + [False] * cfg.n_mtp)
    interval = _interval(cfg.recurrent)
    if interval:
        w.add_full_attention_interval(interval)
    if cfg.n_mtp:
        w.add_nextn_predict_layers(cfg.n_mtp)
    if cfg.is_moe:
        w.add_expert_count(cfg.n_expert)
        w.add_expert_used_count(cfg.n_expert_used)
        w.add_expert_feed_forward_length(cfg.n_ff_expert)
        w.add_expert_shared_feed_forward_length(cfg.n_ff_shared)
    w.add_file_type({QT.F32: 0, QT.F16: 1, QT.BF16: 32, QT.Q4_0: 2, QT.Q8_0: 7}[qtype])
    write_vocab(w, vocab)

    def put(name: str, array, matmul: bool = False, lookup: bool = False):
        """matmul: a pytree [.., n_in, n_out] weight, stored transposed; lookup: an embedding table. Both
        take the export dtype."""
        a = np.asarray(array, dtype=np.float32)
        if matmul:
            a = np.ascontiguousarray(np.swapaxes(a, -1, -2))
        if (matmul or lookup) and qtype != QT.F32:
            if qtype == QT.F16:
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", weights.embed, lookup=True)
    put("output_norm.weight", weights.output_norm)
    tied = weights.output.shape == weights.embed.T.shape and np.array_equal(weights.output, weights.embed.T)
    if not tied:
        put("output.weight", weights.output, matmul=True)
    for i, layer in enumerate(weights.layers):
        _put_layer(put, f"blk.{i}.", layer, cfg)
    if weights.mtp is not None:
        m, p = weights.mtp, f"blk.{cfg.n_layer}."
        _put_layer(put, p, m.layer, cfg)
        put(p + "nextn.eh_proj.weight", m.eh_proj, matmul=True)
        put(p + "nextn.enorm.weight", m.enorm)
        put(p + "nextn.hnorm.weight", m.hnorm)
        put(p + "nextn.shared_head_norm.weight", m.head_norm)
        if m.embed is not weights.embed:
            put(p + "nextn.embed_tokens.weight", m.embed, lookup=True)
        if m.head is not weights.output:
            put(p + "nextn.shared_head_head.weight", m.head, matmul=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _interval(recurrent: tuple[bool, ...]) -> int | None:
    for interval in range(1, len(recurrent) + 1):
        if all(r == ((i + 1) % interval != 0) for i, r in enumerate(recurrent)):
            return interval
    return None


def _put_gdn_grouped(put, p: str, mixer: GatedDeltaNet, cfg: ModelConfig) -> None:
    """A GDN layer in qwen3next's layout: value heads back in grouped order, β and α rows fused into ssm_ba."""
    E, Hk, Hv, Dk = cfg.n_embd, cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
    r, n_qk = Hv // Hk, 2 * Hk * Dk
    grouped = np.argsort(tiled_head_order(Hk, Hv))
    rows = lambda a: np.asarray(a).reshape(Hv, -1, *np.shape(a)[1:])[grouped].reshape(np.shape(a))
    qkv = np.asarray(mixer.qkv).T  # [C, E]
    put(p + "attn_qkv.weight", np.concatenate([qkv[:n_qk], rows(qkv[n_qk:])]).T, matmul=True)
    put(p + "attn_gate.weight", rows(np.asarray(mixer.gate).T).T, matmul=True)
    conv = np.asarray(mixer.conv)
    put(p + "ssm_conv1d.weight", np.concatenate([conv[:n_qk], rows(conv[n_qk:])]))
    put(p + "ssm_dt.bias", rows(mixer.dt_bias))
    put(p + "ssm_a", rows(mixer.a))
    beta, alpha = rows(np.asarray(mixer.beta).T), rows(np.asarray(mixer.alpha).T)  # [Hv, E] each
    ba = np.concatenate([beta.reshape(Hk, r, E), alpha.reshape(Hk, r, E)], axis=1).reshape(2 * Hv, E)
    put(p + "ssm_ba.weight", ba.T, matmul=True)
    put(p + "ssm_norm.weight", mixer.norm)
    out = np.asarray(mixer.out).T  # [E, Hv Dk]
    if mixer.out_heads is None:  # inputs in tiled order
        out = out.reshape(E, Hv, Dk)[:, grouped].reshape(E, Hv * Dk)
    put(p + "ssm_out.weight", out.T, matmul=True)


def _put_layer(put, p: str, layer: Layer, cfg: ModelConfig) -> None:
    put(p + "attn_norm.weight", layer.attn_norm)
    put(p + "post_attention_norm.weight", layer.post_norm)
    mixer = layer.mixer
    if isinstance(mixer, GatedDeltaNet) and cfg.grouped_value_heads:
        _put_gdn_grouped(put, p, mixer, cfg)
    elif isinstance(mixer, GatedDeltaNet):
        put(p + "attn_qkv.weight", mixer.qkv, matmul=True)
        put(p + "attn_gate.weight", mixer.gate, matmul=True)
        put(p + "ssm_conv1d.weight", mixer.conv)
        put(p + "ssm_dt.bias", mixer.dt_bias)
        put(p + "ssm_a", mixer.a)
        put(p + "ssm_beta.weight", mixer.beta, matmul=True)
        put(p + "ssm_alpha.weight", mixer.alpha, matmul=True)
        put(p + "ssm_norm.weight", mixer.norm)
        put(p + "ssm_out.weight", mixer.out, matmul=True)
    else:
        put(p + "attn_q.weight", mixer.q, matmul=True)
        put(p + "attn_k.weight", mixer.k, matmul=True)
        put(p + "attn_v.weight", mixer.v, matmul=True)
        put(p + "attn_output.weight", mixer.o, matmul=True)
        put(p + "attn_q_norm.weight", mixer.q_norm)
        put(p + "attn_k_norm.weight", mixer.k_norm)
        for name, bias in (("attn_q.bias", mixer.q_bias), ("attn_k.bias", mixer.k_bias), ("attn_v.bias", mixer.v_bias)):
            if bias is not None:
                put(p + name, bias)
    ffn = layer.ffn
    if isinstance(ffn, DenseFfn):
        put(p + "ffn_gate.weight", ffn.gate, matmul=True)
        put(p + "ffn_up.weight", ffn.up, matmul=True)
        put(p + "ffn_down.weight", ffn.down, matmul=True)
    else:
        put(p + "ffn_gate_inp.weight", ffn.router, matmul=True)
        put(p + "ffn_gate_exps.weight", ffn.gate, matmul=True)
        put(p + "ffn_up_exps.weight", ffn.up, matmul=True)
        put(p + "ffn_down_exps.weight", ffn.down, matmul=True)
        put(p + "ffn_gate_inp_shexp.weight", ffn.shared_router)
        put(p + "ffn_gate_shexp.weight", ffn.shared_gate, matmul=True)
        put(p + "ffn_up_shexp.weight", ffn.shared_up, matmul=True)
        put(p + "ffn_down_shexp.weight", ffn.shared_down, matmul=True)
