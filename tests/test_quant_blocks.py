"""jaxmodel.quant_blocks: jnp dequantization of ggml block formats against gguf-py's numpy reference, bit for bit."""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxmodel.quant_blocks import FORMATS, dequantize, dequantize_rows, random_blocks, row_bytes

ALL = list(FORMATS)


def reference(blocks: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(blocks), qtype)


@functools.partial(jax.jit, static_argnums=1)
def jit_dequantize(blocks: jax.Array, qtype: QT) -> jax.Array:
    return dequantize(blocks, qtype)


def test_formats_match_gguf_sizes():
    for qtype, fmt in FORMATS.items():
        assert fmt.qtype == qtype
        assert (fmt.block, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_dequantize_is_ggml_bit_for_bit(qtype):
    fmt = FORMATS[qtype]
    blocks = random_blocks(np.random.default_rng(int(qtype)), qtype, (3, 2 * fmt.block))
    assert blocks.shape == (3, row_bytes(qtype, 2 * fmt.block)) and blocks.dtype == np.uint8
    want = reference(blocks, qtype)
    assert want.shape == (3, 2 * fmt.block) and np.isfinite(want).all()
    eager = dequantize(blocks, qtype)
    assert eager.dtype == jnp.float32 and eager.shape == want.shape
    np.testing.assert_array_equal(np.asarray(eager), want)
    # Under jit XLA fuses the whole dequantization; a fused product and sum must still round like ggml's.
    np.testing.assert_array_equal(np.asarray(jit_dequantize(jnp.asarray(blocks), qtype)), want)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.IQ4_XS], ids=lambda q: q.name)
def test_leading_dims(qtype):
    blocks = random_blocks(np.random.default_rng(1), qtype, (2, 3, 512))
    assert blocks.shape == (2, 3, row_bytes(qtype, 512))
    got = jit_dequantize(jnp.asarray(blocks), qtype)
    assert got.shape == (2, 3, 512)
    np.testing.assert_array_equal(np.asarray(got), reference(blocks, qtype))


def test_dequantize_rows_picks_rows():
    qtype = QT.Q6_K
    blocks = random_blocks(np.random.default_rng(2), qtype, (5, 256))
    full = reference(blocks, qtype)
    rows = np.array([[4, 0], [2, 4]])
    got = jax.jit(dequantize_rows, static_argnums=1)(jnp.asarray(blocks), qtype, jnp.asarray(rows))
    assert got.shape == (2, 2, 256)
    np.testing.assert_array_equal(np.asarray(got), full[rows])


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q5_1], ids=lambda q: q.name)
def test_quantized_round_trip(qtype):
    """Blocks as a file's writer makes them (gguf's quantize of normal weights), not random bits."""
    weights = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32) * 0.02
    blocks = gguf.quants.quantize(weights, qtype)
    assert blocks.shape == (4, row_bytes(qtype, 128))
    got = np.asarray(jit_dequantize(jnp.asarray(blocks), qtype))
    np.testing.assert_array_equal(got, reference(blocks, qtype))
    bits = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q5_0: 5, QT.Q4_1: 4, QT.Q5_1: 5}[qtype]
    assert np.abs(got - weights).max() <= 2 * np.abs(weights).max() / 2 ** (bits - 1)


def test_row_bytes():
    assert row_bytes(QT.Q8_0, 64) == 68
    assert row_bytes(QT.Q4_K, 512) == 288
    with pytest.raises(ValueError, match="Q4_K"):
        row_bytes(QT.Q4_K, 128)
    with pytest.raises(ValueError, match="Q8_0"):
        row_bytes(QT.Q8_0, 33)
    with pytest.raises(ValueError, match="Q2_K"):
        row_bytes(QT.Q2_K, 256)


def test_bad_blocks():
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize(np.zeros((2, 19), np.uint8), QT.Q4_0)
    with pytest.raises(TypeError):
        dequantize(np.zeros((2, 18), np.int8), QT.Q4_0)
