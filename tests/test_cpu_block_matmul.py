"""The block product (`cpu_matmul.block_rows_matmul`): weights kept as their file's ggml blocks (Q4_0, Q5_0, Q8_0,
Q4_K, Q5_K, Q6_K, IQ4_XS; Q4_0, Q4_K, Q5_K and Q6_K also in row groups) times x quantized as llama.cpp quantizes
it for the type, against the plain reference (the weight dequantized as gguf does, x quantized and back, one float32 product), row by
row alike whatever the batch, with its prologues, and its refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from jaxmodel.kernels import cpu_matmul
from jaxmodel.quant_blocks import random_blocks

needs_kernel = pytest.mark.skipif(not cpu_matmul.block_kernels(), reason="the block products need AVX2 and g++")
TYPES = [QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS]
EPS = 1e-6


def _x(M: int, K: int, seed: int = 1) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32)
    x[0, :256] = 0.0  # a block of zeros quantizes to d = 0
    return jnp.asarray(x)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_product_matches_its_reference_for_every_batch(qtype):
    # 44 outputs: chunks of whole groups of eight and a tail; five rows: a pass of four and one of one.
    w = jnp.asarray(random_blocks(np.random.default_rng(0), qtype, (44, 512)))
    x = _x(5, 512)
    live = jnp.asarray([1, 1, 0, 1, 1], jnp.int32)
    got = np.asarray(jax.jit(cpu_matmul.block_rows_matmul, static_argnums=2)(x, w, int(qtype), live))
    want = np.asarray(cpu_matmul.block_rows_matmul_reference(x, w, int(qtype), live))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.all(got[2] == 0)
    for m in (0, 1, 3, 4):  # a row's sums are the same bits alone as beside other rows
        alone = np.asarray(cpu_matmul.block_rows_matmul(x[m : m + 1], w, int(qtype)))
        np.testing.assert_array_equal(alone[0], got[m])


@needs_kernel
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0, QT.Q8_0], ids=lambda t: t.name)
def test_block_product_of_an_odd_number_of_blocks(qtype):
    # Five blocks a row: the two-block records end in a half-filled one, and the last row's last block ends the
    # weight buffer (nothing may be read past it).
    w = jnp.asarray(random_blocks(np.random.default_rng(4), qtype, (9, 160)))
    x = _x(3, 160)
    got = np.asarray(cpu_matmul.block_rows_matmul(x, w, int(qtype)))
    want = np.asarray(cpu_matmul.block_rows_matmul_reference(x, w, int(qtype)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_row_groups_order_as_documented():
    """interleave_block_rows' example: two rows a, b of one Q4_0 block give da db a[0:4] b[0:4] ... a[12:16]
    b[12:16]; a last group of fewer rows keeps the same order over its own rows; file_order_block_rows undoes it
    for every type that has one (numpy and jax arrays alike)."""
    a, b = np.arange(18, dtype=np.uint8), np.arange(100, 118, dtype=np.uint8)
    grouped = cpu_matmul.interleave_block_rows(np.stack([a, b]), int(QT.Q4_0)).reshape(-1)
    quads = [np.concatenate([a[2 + 4 * q : 6 + 4 * q], b[2 + 4 * q : 6 + 4 * q]]) for q in range(4)]
    np.testing.assert_array_equal(grouped, np.concatenate([a[:2], b[:2], *quads]))
    for qtype, shape in ((QT.Q4_0, (21, 96)), (QT.Q4_K, (37, 512)), (QT.Q5_K, (37, 512)),
                         (QT.Q6_K, (37, 512))):  # a last group of 5
        blocks = random_blocks(np.random.default_rng(5), qtype, shape)
        for xp in (np, jnp):
            there = cpu_matmul.interleave_block_rows(xp.asarray(blocks), int(qtype))
            assert not np.array_equal(np.asarray(there), blocks)
            np.testing.assert_array_equal(np.asarray(cpu_matmul.file_order_block_rows(there, int(qtype))), blocks)
    with pytest.raises(ValueError, match="only Q4_0, Q4_K, Q5_K and Q6_K"):
        cpu_matmul.interleave_block_rows(random_blocks(np.random.default_rng(5), QT.Q8_0, (8, 256)), int(QT.Q8_0))


@needs_kernel
@pytest.mark.parametrize("qtype,N,K", [(QT.Q4_0, 44, 512), (QT.Q4_0, 3, 160), (QT.Q4_0, 16, 32),
                                       (QT.Q4_K, 44, 512), (QT.Q4_K, 5, 256), (QT.Q4_K, 32, 768),
                                       (QT.Q5_K, 44, 512), (QT.Q5_K, 5, 256), (QT.Q5_K, 32, 768),
                                       (QT.Q6_K, 44, 512), (QT.Q6_K, 5, 256), (QT.Q6_K, 32, 768)],
                         ids=lambda v: getattr(v, "name", str(v)))  # fmt: skip
def test_row_groups_match_the_reference_for_every_batch(qtype, N, K):
    """Q4_0 (groups of 8), Q4_K, Q5_K and Q6_K (groups of 16, where the 512-bit forms build) in row groups
    (`interleave_block_rows`): against the reference; a row alone gives the same bits as beside others; the rows of
    a last group of fewer (summed one output at a time) give the same bits as in a whole group."""
    group = cpu_matmul.row_groups().get(int(qtype))
    if group is None:
        pytest.skip(f"no {qtype.name} row groups on this CPU: {cpu_matmul.block_kernel_isa()}")
    blocks = random_blocks(np.random.default_rng(0), qtype, (N, K))
    w = jnp.asarray(cpu_matmul.interleave_block_rows(blocks, int(qtype)))
    x = _x(5, K)
    live = jnp.asarray([1, 1, 0, 1, 1], jnp.int32)
    product = jax.jit(cpu_matmul.block_rows_matmul, static_argnums=(2, 4))
    got = np.asarray(product(x, w, int(qtype), live, group))
    want = np.asarray(cpu_matmul.block_rows_matmul_reference(x, w, int(qtype), live, group))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.all(got[2] == 0)
    for m in (0, 1, 3, 4):
        alone = np.asarray(product(x[m : m + 1], w, int(qtype), None, group))
        np.testing.assert_array_equal(alone[0], got[m])
    tail = N % group
    if tail:  # the last rows again, completed to a whole group by copies of its first row
        padded = np.concatenate([blocks[N - tail :], np.repeat(blocks[N - tail : N - tail + 1], group - tail, axis=0)])
        whole = jnp.asarray(cpu_matmul.interleave_block_rows(padded, int(qtype)))
        again = np.asarray(product(x, whole, int(qtype), live, group))
        np.testing.assert_array_equal(again[:, :tail], got[:, N - tail :])


@needs_kernel
def test_block_product_against_gguf_dequantize_on_quantized_normals():
    # A Q8_0 weight as gguf's quantizer writes it: the product is the dequantized weight's, to float32 rounding.
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((24, 256)).astype(np.float32) / 16
    blocks = quants.quantize(weight, QT.Q8_0)
    x = jnp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
    got = np.asarray(cpu_matmul.block_rows_matmul(x, jnp.asarray(blocks), int(QT.Q8_0)))
    q, d = cpu_matmul.quantize_rows_q8_0(x)
    xq = np.asarray(q, np.float64).reshape(2, 8, 32) * np.asarray(d, np.float64)[..., None]
    want = xq.reshape(2, 256) @ quants.dequantize(blocks, QT.Q8_0).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("qtype,row_group", [(QT.Q4_K, 1), (QT.Q4_0, 8), (QT.Q4_K, 16), (QT.Q5_K, 16), (QT.Q6_K, 16)],
                         ids=["Q4_K", "Q4_0-groups", "Q4_K-groups", "Q5_K-groups", "Q6_K-groups"])
@pytest.mark.parametrize("prologue", ["rms_norm", "swiglu", "gated_rms_norm"])
def test_block_product_prologues(prologue, qtype, row_group):
    if row_group > 1 and cpu_matmul.row_groups().get(int(qtype)) != row_group:
        pytest.skip(f"no {qtype.name} row groups on this CPU")
    K, G = 256, 64
    w = random_blocks(np.random.default_rng(0), qtype, (16, K))
    w = jnp.asarray(w if row_group == 1 else cpu_matmul.interleave_block_rows(w, int(qtype)))
    rng = np.random.default_rng(2)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s) * 2, jnp.float32)  # noqa: E731
    x = f32(3, 2 * K) if prologue == "swiglu" else f32(3, K)
    weight = None if prologue == "swiglu" else f32(G if prologue == "gated_rms_norm" else K)
    gate = f32(3, K) if prologue == "gated_rms_norm" else None
    got = np.asarray(cpu_matmul.block_rows_matmul_prologue(prologue, x, w, int(qtype), None, weight, gate, EPS,
                                                           row_group))
    value = cpu_matmul.prologue_reference(prologue, x, weight, gate, EPS)
    want = np.asarray(cpu_matmul.block_rows_matmul_reference(value, w, int(qtype), None, row_group))
    # The prologue's last bits may differ from jnp's, which can move a quantized value by one step.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_kernel
def test_block_product_refuses_bad_operands():
    w = jnp.asarray(random_blocks(np.random.default_rng(0), QT.Q4_K, (8, 256)))
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(ValueError, match="no product for ggml type"):
        cpu_matmul.block_rows_matmul(x, w, int(QT.Q2_K))
    with pytest.raises(ValueError, match=r"uint8 blocks \[N, 144\]"):
        cpu_matmul.block_rows_matmul(x, w[:, :100], int(QT.Q4_K))
    with pytest.raises(ValueError, match="Q4_K"):
        cpu_matmul.block_rows_matmul(jnp.ones((1, 200), jnp.float32), w, int(QT.Q4_K))
    with pytest.raises(ValueError, match="in row groups of 8"):
        cpu_matmul.block_rows_matmul(x, w, int(QT.Q4_K), None, 8)


def test_q8_K_activations_as_llama_cpp():
    # The element of largest magnitude maps to -127 (its sign kept), halves round to even, a zero block stays zero.
    x = np.zeros((1, 512), np.float32)
    x[0, :4] = [-2.0, 1.0, 0.5 * (-2.0 / -127.0) * 3, 2.0]  # the first of two equal magnitudes is the peak
    got = np.asarray(cpu_matmul.quantize_rows_q8_K(jnp.asarray(x)))
    d = -2.0 / -127.0
    np.testing.assert_allclose(got[0, :4], np.float32([-127, 64, 2, 127]) * np.float32(d), rtol=1e-6)
    assert np.all(got[0, 256:] == 0)


@pytest.mark.skipif(cpu_matmul.block_kernel_isa() != "avx512-vnni", reason="this CPU runs the 256-bit forms itself")
def test_the_256_bit_forms_where_the_cpu_has_avx512(tmp_path):
    # A CPU without AVX-512 runs the 256-bit forms: the tests above again, on the library built with only those
    # (which have no K-quant row groups: those tests alone skip).
    env = {**os.environ, "GDNSPEC_CPU_BLOCKS": "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-o", "addopts=", "-p", "no:cacheprovider", __file__, "-k",
                           "matches_its_reference or odd_number or prologues or reads_past or isa or row_groups"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert " passed" in done.stdout and all("row groups on this CPU" in line for line in skips), done.stdout[-2000:]


@needs_kernel
def test_no_format_reads_past_its_row(tmp_path):
    # Rows of 1-9 blocks ending at an inaccessible page: a read past a row's last byte would fault.
    binary = tmp_path / "row_end"
    flags = [f for f in cpu_matmul.flags() if f not in ("-shared", "-fPIC")]
    source = Path(__file__).parent / "native" / "block_row_end.cc"
    subprocess.run([cpu_matmul.cxx(), *flags, f"-I{cpu_matmul.SOURCES[0].parent}", str(source), "-o", str(binary)],
                   check=True, timeout=300)  # fmt: skip
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.split() == ["ok", "512" if cpu_matmul.block_kernel_isa() == "avx512-vnni" else "256"]


@needs_kernel
def test_isa_is_what_was_asked():
    wanted = os.environ.get("GDNSPEC_CPU_BLOCKS")
    assert cpu_matmul.block_kernel_isa() in ((wanted,) if wanted else ("avx2", "avx512-vnni"))
