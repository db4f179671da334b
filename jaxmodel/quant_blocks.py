"""GGUF/ggml block-quantized weights kept as the file's raw bytes, dequantized with jax.numpy.

A quantized tensor stays in its file's block format (uint8 [rows, row_bytes], the bytes `gguf.GGUFReader` gives
for the tensor's data, one tensor row per last-axis row) and is dequantized inside the jitted step, where only the
part needed is expanded: the embedding rows a step looks up (`dequantize_rows`), the weights of the products on the
non-CPU backends (which have no block kernels), and the reference the CPU block kernels are checked against.

`dequantize` is pure jnp (it traces under jit, runs on CPU and GPU) and reproduces ggml's arithmetic: f16 scales
read by bitcasting byte pairs and widened to float32 exactly, then the products and sums in float32 in the order of
ggml's `dequantize_row_*` (as gguf-py's `gguf.quants` has them), so that its values are the same bits as
`gguf.quants.dequantize`'s. XLA's CPU compiler keeps a product and a sum apart; a backend that fuses them into one
fused multiply-add (the GPU's may, for the `d * q + m` of Q4_1/Q5_1 and the `d * q - dm` of the K formats) can
differ from ggml in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QT
from jax import lax

__all__ = ["FORMATS", "BlockFormat", "dequantize", "dequantize_rows", "random_blocks", "row_bytes"]


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block format: `block` weights stored in `block_bytes` bytes."""

    qtype: QT
    block: int
    block_bytes: int


FORMATS: dict[QT, BlockFormat] = {
    qt: BlockFormat(qt, *gguf.GGML_QUANT_SIZES[qt])
    for qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS)
}

# ggml's kvalues_iq4nl: the 16 non-uniform levels of IQ4_NL and IQ4_XS.
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# The f16 fields of each block as (byte offset, kind), for random_blocks: "d" a scale (either sign), "dmin" the
# K formats' positive min scale, "m" Q4_1/Q5_1's block minimum.
_F16_FIELDS: dict[QT, tuple[tuple[int, str], ...]] = {
    QT.Q4_0: ((0, "d"),),
    QT.Q4_1: ((0, "d"), (2, "m")),
    QT.Q5_0: ((0, "d"),),
    QT.Q5_1: ((0, "d"), (2, "m")),
    QT.Q8_0: ((0, "d"),),
    QT.Q4_K: ((0, "d"), (2, "dmin")),
    QT.Q5_K: ((0, "d"), (2, "dmin")),
    QT.Q6_K: ((208, "d"),),
    QT.IQ4_NL: ((0, "d"),),
    QT.IQ4_XS: ((0, "d"),),
}


def _format(qtype: QT | int) -> BlockFormat:
    qtype = QT(qtype)
    if qtype not in FORMATS:
        supported = ", ".join(q.name for q in FORMATS)
        raise ValueError(f"{qtype.name} is not a supported block format (supported: {supported})")
    return FORMATS[qtype]


def row_bytes(qtype: QT | int, n: int) -> int:
    """Bytes of one row of n weights in qtype's blocks; ValueError when n is not a whole number of blocks."""
    fmt = _format(qtype)
    if n % fmt.block:
        raise ValueError(f"{fmt.qtype.name}: a row of {n} weights is not a whole number of {fmt.block}-weight blocks")
    return n // fmt.block * fmt.block_bytes


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] (a little-endian f16) -> float32 [..., 1] (exact widening, as ggml's GGML_FP16_TO_FP32)."""
    return lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(q: jax.Array, group: int) -> jax.Array:
    """int32 [..., k] bytes -> [..., 2k]: each run of `group` bytes gives its low nibbles, then its high ones."""
    q = q.reshape(*q.shape[:-1], q.shape[-1] // group, 1, group)
    return jnp.concatenate([q & 0xF, q >> 4], axis=-2).reshape(*q.shape[:-3], -1)


def _bits(q: jax.Array, width: int) -> jax.Array:
    """int32 [..., k] bytes -> [..., 8 // width, k]: field j of each byte (bits j*width ...) along axis -2."""
    shifts = jnp.arange(0, 8, width, dtype=jnp.int32)[:, None]
    return (q[..., None, :] >> shifts) & ((1 << width) - 1)


def _k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K's 12 packed scale bytes, int32 [..., 12] -> 6-bit scales and mins, float32 [..., 8, 1] each
    (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32)[..., None], mn.astype(jnp.float32)[..., None]


def _levels(idx: jax.Array) -> jax.Array:
    """IQ4 level indices (int32 0..15) -> their float32 values."""
    return jnp.asarray(_IQ4_LEVELS, dtype=jnp.float32)[idx]


def _dequantize_blocks(x: jax.Array, qtype: QT) -> jax.Array:
    """uint8 [..., block_bytes] -> float32 [..., block], each in ggml's (gguf-py's) float32 order."""
    q = x.astype(jnp.int32)
    if qtype == QT.Q4_0:
        return _f16(x[..., 0:2]) * (_nibbles(q[..., 2:18], 16) - 8).astype(jnp.float32)
    if qtype == QT.Q4_1:
        return _f16(x[..., 0:2]) * _nibbles(q[..., 4:20], 16).astype(jnp.float32) + _f16(x[..., 2:4])
    if qtype == QT.Q5_0:
        qh = _bits(q[..., 2:6], 1)  # [..., 8, 4]: bit j of byte i is weight 8i + j (a little-endian uint32)
        qh = jnp.swapaxes(qh, -1, -2).reshape(*q.shape[:-1], 32)
        return _f16(x[..., 0:2]) * ((_nibbles(q[..., 6:22], 16) | (qh << 4)) - 16).astype(jnp.float32)
    if qtype == QT.Q5_1:
        qh = jnp.swapaxes(_bits(q[..., 4:8], 1), -1, -2).reshape(*q.shape[:-1], 32)
        return _f16(x[..., 0:2]) * (_nibbles(q[..., 8:24], 16) | (qh << 4)).astype(jnp.float32) + _f16(x[..., 2:4])
    if qtype == QT.Q8_0:
        return lax.bitcast_convert_type(x[..., 2:34], jnp.int8).astype(jnp.float32) * _f16(x[..., 0:2])
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, mn = _k_scales(q[..., 4:16])
        d = _f16(x[..., 0:2])[..., None] * sc  # [..., 8, 1]: one scale and one min per 32 weights
        dm = _f16(x[..., 2:4])[..., None] * mn
        if qtype == QT.Q4_K:
            w = _nibbles(q[..., 16:144], 32).reshape(*q.shape[:-1], 8, 32)
        else:
            w = _nibbles(q[..., 48:176], 32).reshape(*q.shape[:-1], 8, 32) | (_bits(q[..., 16:48], 1) << 4)
        return (d * w.astype(jnp.float32) - dm).reshape(*q.shape[:-1], 256)
    if qtype == QT.Q6_K:
        scales = lax.bitcast_convert_type(x[..., 192:208], jnp.int8).astype(jnp.float32)
        d = (_f16(x[..., 208:210]) * scales)[..., None]  # [..., 16, 1]: one scale per 16 weights
        lo = _nibbles(q[..., 0:128], 64).reshape(*q.shape[:-1], 8, 32)
        hi = _bits(q[..., 128:192].reshape(*q.shape[:-1], 2, 32), 2).reshape(*q.shape[:-1], 8, 32)
        w = ((lo | (hi << 4)) - 32).astype(jnp.float32).reshape(*q.shape[:-1], 16, 16)
        return (d * w).reshape(*q.shape[:-1], 256)
    if qtype == QT.IQ4_NL:
        return _f16(x[..., 0:2]) * _levels(_nibbles(q[..., 2:18], 16))
    if qtype == QT.IQ4_XS:
        # Sub-block j's 6-bit scale: nibble j % 2 of scales_l byte j // 2, and bits 2j, 2j+1 of the uint16 scales_h.
        lo = jnp.swapaxes(_bits(q[..., 4:8], 4), -1, -2).reshape(*q.shape[:-1], 8)
        hi = (q[..., 2:3] | (q[..., 3:4] << 8)) >> jnp.arange(0, 16, 2, dtype=jnp.int32)
        ls = ((lo | ((hi & 3) << 4)) - 32).astype(jnp.float32)
        dl = (_f16(x[..., 0:2]) * ls)[..., None]  # [..., 8, 1]
        w = _levels(_nibbles(q[..., 8:136], 16)).reshape(*q.shape[:-1], 8, 32)
        return (dl * w).reshape(*q.shape[:-1], 256)
    raise AssertionError(qtype)


def dequantize(blocks: jax.Array | np.ndarray, qtype: QT | int) -> jax.Array:
    """uint8 [..., row_bytes] rows of qtype blocks -> float32 [..., n], n = row_bytes // block_bytes * block.

    The same values as `gguf.quants.dequantize(blocks, qtype)`. qtype is static (a Python value under jit)."""
    fmt = _format(qtype)
    blocks = jnp.asarray(blocks)
    if blocks.dtype != jnp.uint8:
        raise TypeError(f"{fmt.qtype.name} blocks must be uint8, got {blocks.dtype}")
    *lead, nbytes = blocks.shape
    if nbytes % fmt.block_bytes:
        raise ValueError(f"{fmt.qtype.name}: a row of {nbytes} bytes is not a whole number of "
                         f"{fmt.block_bytes}-byte blocks")
    x = blocks.reshape(*lead, nbytes // fmt.block_bytes, fmt.block_bytes)
    return _dequantize_blocks(x, fmt.qtype).reshape(*lead, nbytes // fmt.block_bytes * fmt.block)


def dequantize_rows(blocks: jax.Array | np.ndarray, qtype: QT | int, rows: jax.Array | np.ndarray) -> jax.Array:
    """Rows `rows` (int [...]) of a [N, row_bytes] qtype tensor, dequantized: float32 [..., n]. For embedding
    lookups, which need only the rows of the step's tokens."""
    return dequantize(jnp.take(jnp.asarray(blocks), jnp.asarray(rows), axis=0), qtype)


def random_blocks(rng: np.random.Generator, qtype: QT | int, shape: tuple[int, ...]) -> np.ndarray:
    """Valid random qtype blocks of a float tensor of `shape` [..., n] (n a whole number of blocks): uint8
    [..., row_bytes]. Every quant bit is random (all codes and packed scales occur), the f16 fields finite and of
    real files' magnitude: |d| in [1e-3, 1e-2] of either sign, the K formats' dmin in [1e-3, 1e-2], Q4_1/Q5_1's
    minimum in [-0.1, 0.1]; so every dequantized value is finite."""
    fmt = _format(qtype)
    *lead, n = shape
    nb = row_bytes(fmt.qtype, n) // fmt.block_bytes
    out = rng.integers(0, 256, size=(*lead, nb, fmt.block_bytes), dtype=np.uint8)
    for offset, kind in _F16_FIELDS[fmt.qtype]:
        size = (*lead, nb)
        if kind == "m":
            v = rng.uniform(-0.1, 0.1, size)
        else:
            v = rng.uniform(1e-3, 1e-2, size)
            if kind == "d":
                v *= rng.choice([-1.0, 1.0], size)
        out[..., offset : offset + 2] = v.astype("<f2")[..., None].view(np.uint8)
    return out.reshape(*lead, nb * fmt.block_bytes)
