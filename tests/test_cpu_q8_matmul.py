"""The CPU Q8_0 product: the kernel against its reference and its row independence, the loader keeping Q8_0 weights
as blocks, and the bundled Q8_0 model's logits against llama.cpp's on the same file."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from jaxmodel import delta_rule
from jaxmodel.assets import default_model_path
from jaxmodel.gguf_io import _split_outputs, q8_rows_from_blocks, read_gguf, write_gguf
from jaxmodel.kernels import cpu_matmul
from jaxmodel.layers import linear
from jaxmodel.model import load_model
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.weights import Q8Rows, first_columns

DATA = Path(__file__).parent / "data"
needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")


def _operands(M, K, N, seed=0):
    """x [M, K] float32, and a random weight [N, K] quantized to Q8_0 as a GGUF file holds it."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K), np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    w = Q8Rows.from_file_order(*_blocks(rng.standard_normal((N, K), np.float32) / np.sqrt(K)))
    return jnp.asarray(x), w


def _blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (quants [N, K] int8, scales [N, K/32] float32), through gguf's own Q8_0 quantizer."""
    return q8_rows_from_blocks(quants.quantize(w, QT.Q8_0)).file_order()


def _dequantized(w: Q8Rows) -> np.ndarray:
    """[n_in, n_out] float32, as the float32 loader holds it."""
    quants, scales = w.file_order()
    q = np.asarray(quants, np.float32).reshape(w.shape[1], -1, 32)
    return (q * np.asarray(scales)[..., None]).reshape(w.shape[1], w.shape[0]).T


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16, 40])
@pytest.mark.parametrize("K,N", [(32, 1), (96, 7), (192, 300), (1024, 1100)])
def test_kernel_matches_reference(M, K, N):
    # (1024, 1100) at any M, and (192, 300) from M = 16, are split over the thread pool; N not a multiple of 8
    # leaves a last group of fewer rows, summed one output at a time; M = 40 runs ten passes of 4 rows.
    x, w = _operands(M, K, N)
    got = np.asarray(jax.jit(cpu_matmul.q8_rows_matmul)(x, w.quants, w.scales))
    want = np.asarray(cpu_matmul.q8_rows_matmul_reference(x, w.quants, w.scales))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def _block_order(x, w: Q8Rows) -> np.ndarray:
    """[M, N]: the kernel's arithmetic for each output, in numpy: per block one exact integer product of the quants,
    then acc = fma(d_w * d_x, dot, acc) block after block (the scale product of two f16 values is exact in float32,
    and float64 holds the product before it is rounded once to float32, as an FMA rounds it)."""
    xq, xd = (np.asarray(a) for a in cpu_matmul.quantize_rows_q8_0(jnp.asarray(x)))
    wq, wd = (np.asarray(a) for a in w.file_order())
    (M, K), N = xq.shape, wq.shape[0]
    dots = np.einsum("mbi,nbi->mnb", xq.reshape(M, K // 32, 32).astype(np.int64),
                     wq.reshape(N, K // 32, 32).astype(np.int64))  # [M, N, blocks]
    scale = (xd[:, None, :] * wd[None, :, :]).astype(np.float32)  # exact
    acc = np.zeros((M, N), np.float32)
    for b in range(K // 32):
        acc = (acc.astype(np.float64) + scale[:, :, b].astype(np.float64) * dots[:, :, b]).astype(np.float32)
    return acc


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("K,N", [(192, 13), (1024, 40), (96, 300)])
def test_kernel_sums_each_block_as_one_integer_bit_for_bit(M, K, N):
    """Whatever instructions compute it (VNNI's unsigned-by-signed bytes or AVX2's pair sums, eight weight rows per
    vector, the last group of fewer rows one output at a time), each output is the float32 of the blocks' exact
    integer products scaled and summed in order."""
    x, w = _operands(M, K, N, seed=7)
    got = np.asarray(jax.jit(cpu_matmul.q8_rows_matmul)(x, w.quants, w.scales))
    np.testing.assert_array_equal(got, _block_order(x, w))


@needs_kernel
def test_product_is_within_quantization_error_of_the_float32_product():
    x, w = _operands(4, 1024, 64)
    got = np.asarray(cpu_matmul.q8_rows_matmul(x, w.quants, w.scales))
    exact = np.asarray(x) @ _dequantized(w)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < 2e-2  # x's rows are rounded to 8 bits: close, but not the float32 product


@needs_kernel
@pytest.mark.parametrize("K,N", [(192, 300), (1024, 1100)])
def test_each_row_is_summed_alike_whatever_the_rows_beside_it(K, N):
    """A verify step's rows equal one-token steps' bit for bit, and a row's tokens do not depend on the batch."""
    x, w = _operands(24, K, N, seed=1)
    f = jax.jit(cpu_matmul.q8_rows_matmul)
    alone = np.concatenate([np.asarray(f(x[m:m + 1], w.quants, w.scales)) for m in range(24)])
    for M in (2, 3, 4, 7, 16, 24):
        np.testing.assert_array_equal(np.asarray(f(x[:M], w.quants, w.scales)), alone[:M])


@needs_kernel
@pytest.mark.parametrize("K,N", [(192, 300), (1024, 1100)])
def test_rows_not_live_are_skipped(K, N):
    """Padding rows (live false) are neither quantized nor multiplied: they come back as 0, and the live rows as
    they would alone; the reference agrees."""
    x, w = _operands(37, K, N, seed=4)
    live = jnp.asarray(np.random.default_rng(5).random(37) < 0.4)
    f = jax.jit(cpu_matmul.q8_rows_matmul)
    got, full = np.asarray(f(x, w.quants, w.scales, live)), np.asarray(f(x, w.quants, w.scales))
    np.testing.assert_array_equal(got[np.asarray(live)], full[np.asarray(live)])
    assert not got[~np.asarray(live)].any()
    want = np.asarray(cpu_matmul.q8_rows_matmul_reference(x, w.quants, w.scales, live))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert not np.asarray(f(x, w.quants, w.scales, jnp.zeros(37, bool))).any()


@needs_kernel
def test_kernel_refuses_mismatched_operands():
    x, w = _operands(2, 64, 8)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        cpu_matmul.q8_rows_matmul(x[:, :48], w.quants[:, :48], w.scales[:, :1])
    with pytest.raises(ValueError, match=r"scales \[N, K/32\]"):
        cpu_matmul.q8_rows_matmul(x, w.quants, w.scales[:, :1])
    with pytest.raises(ValueError, match="int8 quants"):
        cpu_matmul.q8_rows_matmul(x, w.quants.astype(jnp.int32), w.scales)


def test_quantize_rows_matches_gguf_away_from_ties():
    """The activation quantizer is llama.cpp's: on values with no rounding ties it agrees with gguf's Q8_0."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    q, d = cpu_matmul.quantize_rows_q8_0(jnp.asarray(x))
    want_q, want_d = _blocks(x)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    assert np.mean(np.asarray(q) == want_q) > 0.999  # x/d and x*(127/amax) may round a last bit apart


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 20])
def test_linear_takes_q8_rows(M):
    x, w = _operands(M, 96, 40)
    bias = jnp.arange(40, dtype=jnp.float32)
    got = linear(x.reshape(1, M, 96), w, bias)
    want = cpu_matmul.q8_rows_matmul_reference(x, w.quants, w.scales) + bias
    assert got.shape == (1, M, 40)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-5, atol=1e-5)
    narrow = first_columns(w, 8)
    assert isinstance(narrow, Q8Rows) and narrow.shape == (96, 8)


@pytest.mark.parametrize("N", [1, 3, 8, 9, 20])
def test_rows_interleave_four_bytes_of_eight_rows_at_a_time_and_back(N):
    """Each group of eight rows (the last may hold fewer, g) stores its blocks in turn, each block as eight quads of
    g rows x 4 bytes; the scales block by block; the file's order comes back exactly, for numpy and jax arrays."""
    K = 64
    quants = np.arange(N * K).reshape(N, K).astype(np.int8)
    scales = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    q, s = cpu_matmul.interleave_q8_rows(quants, scales)
    g = min(8, N)  # the first group
    first_group = q.reshape(-1)[: g * K].reshape(2, 8, g, 4)  # [block, quad, row, byte]
    np.testing.assert_array_equal(first_group, quants[:g].reshape(g, 2, 8, 4).transpose(1, 2, 0, 3))
    np.testing.assert_array_equal(s.reshape(-1)[: 2 * g], scales[:g].T.reshape(-1))
    for back, want in zip(cpu_matmul.file_order_q8_rows(q, s), (quants, scales)):
        np.testing.assert_array_equal(back, want)
    for back, want in zip(cpu_matmul.file_order_q8_rows(jnp.asarray(q), jnp.asarray(s)), (quants, scales)):
        np.testing.assert_array_equal(np.asarray(back), want)


def test_split_outputs_of_blocks_matches_the_float32_split():
    _, w = _operands(1, 64, 30)
    parts = _split_outputs(w, [12, 20])
    for part, want in zip(parts, np.split(_dequantized(w), [12, 20], axis=1)):
        np.testing.assert_array_equal(_dequantized(part), want)


@pytest.fixture(scope="module")
def q8_moe_file(tmp_path_factory):
    """A random qwen35moe model written as Q8_0 (its routers too)."""
    cfg = PRESETS["qwen35moe-tiny"]
    path = tmp_path_factory.mktemp("q8") / "moe-q8_0.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=5), dtype="q8_0")
    return path


def test_loader_keeps_q8_0_matmul_weights_as_the_files_blocks(q8_moe_file):
    _, blocks, _ = read_gguf(q8_moe_file, keep_q8_0=True)
    _, floats, _ = read_gguf(q8_moe_file)
    kept = 0
    for got, want in zip(jax.tree.leaves(blocks, is_leaf=lambda a: isinstance(a, Q8Rows)), jax.tree.leaves(floats)):
        if isinstance(got, Q8Rows):
            np.testing.assert_array_equal(_dequantized(got), want)
            kept += 1
        else:
            np.testing.assert_array_equal(got, want)
    assert kept > 0
    layer = blocks.layers[0]
    assert not isinstance(layer.ffn.router, Q8Rows)  # top-k routing stays float32
    assert isinstance(blocks.output, Q8Rows) and isinstance(layer.ffn.shared_down, Q8Rows)
    assert blocks.embed.dtype == np.float32  # looked up by row, dequantized


@needs_kernel
def test_bundled_q8_0_model_scores_as_llama_cpp_does(monkeypatch):
    """llama.cpp (0.3.36's vendored tree, one thread, F32 KV cache, no flash attention) on the bundled target, 32
    tokens in one batch. Our product sums each block's products as one integer and then scales it (the order of
    llama.cpp's repacked GEMMs), where its x86 dot product keeps eight partial sums per block; the sums differ in
    their last bits, and because every product re-quantizes its input to 8 bits, such a difference moves a quant by
    one step now and then. So the first token's logits agree to 1e-5, and all stay within 0.2 (of values up to
    14) with the same argmax at every token, with XLA's token loop for the gated delta rule or the GDN kernel;
    dequantized to float32 they are 0.1 apart."""
    ref = np.load(DATA / "bundled-target-q8_0.npz")
    tokens = [int(t) for t in ref["tokens"]]
    for impl in ("scan", None):
        monkeypatch.setattr(delta_rule, "FORCE_IMPL", impl)
        model = load_model(default_model_path(), load_mtp=False)
        assert isinstance(model.weights.output, Q8Rows)
        logits, _ = model.score(tokens)
        np.testing.assert_allclose(logits[0], ref["A"][0], atol=1e-5, rtol=0)
        assert np.abs(logits - ref["A"]).max() < 0.2
        np.testing.assert_array_equal(logits.argmax(-1), ref["A"].argmax(-1))
    floats = load_model(default_model_path(), load_mtp=False, cpu_kernel=False)
    float_logits, _ = floats.score(tokens)
    assert np.abs(float_logits - ref["A"]).max() > 1e-2
