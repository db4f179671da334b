"""The CPU few-row matmul kernel against its reference, its row independence, its build's failure path, and the
weights `load_model` stores transposed for it."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.kernels import cpu_matmul
from jaxmodel.layers import linear
from jaxmodel.model import Model
from jaxmodel.precision import TRANSPOSE_MIN_INPUTS, takes_rows_kernel, transpose_matmul_weights
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.weights import Transposed, first_columns

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")


@pytest.mark.skipif(jax.default_backend() != "cpu" or os.environ.get("GDNSPEC_CPU_KERNEL", "1") == "0",
                    reason="the CPU kernels build for the CPU backend")  # fmt: skip
def test_the_kernels_build_where_a_compiler_is():
    """Where a C++ compiler is found, the kernel library builds: a source that does not compile would otherwise only
    skip the kernel tests (`needs_kernel`) and leave the model on XLA's paths. Fails with the compiler's message."""
    try:
        cpu_matmul.cxx()
    except cpu_matmul.KernelUnavailable:
        pytest.skip("no C++ compiler here")
    assert cpu_matmul.build().exists()
    assert cpu_matmul.available()


def _operands(M, K, N, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((M, K), np.float32)),
            jnp.asarray(rng.standard_normal((N, K), np.float32) / np.sqrt(K)))


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16, 43])
@pytest.mark.parametrize("K,N", [(8, 1), (19, 7), (192, 300), (1030, 333), (1024, 1100)])
def test_kernel_matches_reference(M, K, N):
    # (1024, 1100) is 4.5 MB: split over the thread pool; K = 19 and 1030 have a tail past the last 8 lanes; odd N
    # leaves weight rows after the blocks of 3, 4 or 8; M = 43 ends in a pass of 3 rows.
    x, w = _operands(M, K, N)
    got = jax.jit(cpu_matmul.rows_matmul)(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(cpu_matmul.rows_matmul_reference(x, w)),
                               rtol=2e-5, atol=2e-5 * np.sqrt(K))


@needs_kernel
@pytest.mark.parametrize("K,N", [(192, 300), (1024, 1100)])
def test_each_row_is_summed_alike_whatever_the_rows_beside_it(K, N):
    """The property that makes a verify step's logits equal a one-token step's: row m of a product of M rows is
    bit for bit the product of row m alone, for any M (summation order fixed per element)."""
    x, w = _operands(40, K, N, seed=1)
    f = jax.jit(cpu_matmul.rows_matmul)
    alone = np.concatenate([np.asarray(f(x[m:m + 1], w)) for m in range(40)])
    for M in (2, 3, 4, 7, 16, 40):
        np.testing.assert_array_equal(np.asarray(f(x[:M], w)), alone[:M])


@needs_kernel
@pytest.mark.parametrize("K,N", [(192, 300), (1024, 1100)])
def test_rows_not_live_are_skipped(K, N):
    """Padding rows (live false) come back as 0 and the live rows as they would alone; every row padding too."""
    x, w = _operands(37, K, N, seed=4)
    live = jnp.asarray(np.random.default_rng(5).random(37) < 0.4)
    f = jax.jit(cpu_matmul.rows_matmul)
    got, full = np.asarray(f(x, w, live)), np.asarray(f(x, w))
    np.testing.assert_array_equal(got[np.asarray(live)], full[np.asarray(live)])
    assert not got[~np.asarray(live)].any()
    np.testing.assert_allclose(got, np.asarray(cpu_matmul.rows_matmul_reference(x, w, live)), rtol=2e-5,
                               atol=2e-5 * np.sqrt(K))
    assert not np.asarray(f(x, w, jnp.zeros(37, bool))).any()
    with pytest.raises(ValueError, match="live must be"):
        cpu_matmul.rows_matmul(x, w, live[:5])


@needs_kernel
def test_kernel_refuses_mismatched_operands():
    x, w = _operands(2, 64, 8)
    with pytest.raises(ValueError, match="float32 x \\[M, K\\] and w \\[N, K\\]"):
        cpu_matmul.rows_matmul(x, w[:, :32])
    with pytest.raises(ValueError, match="float32"):
        cpu_matmul.rows_matmul(x.astype(jnp.bfloat16), w)


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 40])
def test_linear_takes_transposed_weights(M):
    """`linear` on a `Transposed` weight runs the kernel for every M and equals the product on the [n_in, n_out]
    array; with `live`, padding rows get only the bias."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((512, 96), np.float32) / 20
    x = jnp.asarray(rng.standard_normal((1, M, 512), np.float32))  # leading dims [1, M]: M rows
    bias = jnp.asarray(rng.standard_normal(96, np.float32))
    expected = np.asarray(linear(x, jnp.asarray(w), bias))
    got = np.asarray(jax.jit(linear)(x, Transposed(jnp.asarray(w.T.copy())), bias))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    live = jnp.arange(M)[None, :] < (M + 1) // 2  # [1, M]: the first half real, as in a padded step
    padded = np.asarray(jax.jit(linear)(x, Transposed(jnp.asarray(w.T.copy())), bias, live))
    np.testing.assert_array_equal(padded[0, : (M + 1) // 2], got[0, : (M + 1) // 2])
    np.testing.assert_array_equal(padded[0, (M + 1) // 2 :], np.broadcast_to(np.asarray(bias), (M // 2, 96)))
    assert Transposed(jnp.asarray(w.T)).shape == (512, 96)
    np.testing.assert_array_equal(np.asarray(first_columns(Transposed(jnp.asarray(w.T)), 10).t), w.T[:10])


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("GDNSPEC_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_matmul.KernelUnavailable, match="cannot run the C\\+\\+ compiler .*no-such-compiler"):
        cpu_matmul.build()
    assert not list(tmp_path.glob("*.so"))  # nothing partial left to load


def test_which_weights_are_transposed():
    big = np.zeros((TRANSPOSE_MIN_INPUTS, 512), np.float32)  # 1 MiB
    assert takes_rows_kernel("qkv", big)
    assert not takes_rows_kernel("embed", big)  # a lookup table
    assert not takes_rows_kernel("router", big)  # a discrete choice
    assert not takes_rows_kernel("qkv", big[:, :256])  # too small to leave the cache
    assert not takes_rows_kernel("head", np.zeros((192, 8192), np.float32))  # rows too short
    assert not takes_rows_kernel("qkv", big.astype(np.float16))
    assert not takes_rows_kernel("gate", np.zeros((4, 512, 128), np.float32))  # MoE experts


def test_transposed_tree_keeps_ties_and_values():
    cfg = PRESETS["tiny"].replace(n_embd=512, n_ff=640, n_layer=2, recurrent=(True, False), n_mtp=1)
    weights = jax.tree.map(np.asarray, random_weights(cfg, seed=0))
    weights = type(weights)(**{**weights.__dict__, "output": np.ascontiguousarray(weights.embed.T)})
    packed = transpose_matmul_weights(weights)
    assert isinstance(packed.output, Transposed) and packed.output.t is weights.embed  # the embedding itself
    assert isinstance(packed.layers[0].ffn.gate, Transposed)  # [512, 640]: 1.25 MiB
    assert not isinstance(packed.layers[0].mixer.beta, Transposed)  # [512, 4]
    np.testing.assert_array_equal(packed.layers[0].ffn.gate.t, weights.layers[0].ffn.gate.T)


@needs_kernel
def test_model_with_transposed_weights_scores_as_without():
    """A model whose FFN products take the kernel (E = 512, F = 640) gives the logits of the same weights in XLA's
    layout."""
    cfg = PRESETS["tiny"].replace(n_embd=512, n_ff=640, n_layer=2, recurrent=(True, False), n_mtp=0)
    weights = jax.tree.map(np.asarray, random_weights(cfg, seed=4))
    packed = transpose_matmul_weights(weights)
    assert isinstance(packed.layers[0].ffn.gate, Transposed) and isinstance(packed.layers[1].ffn.down, Transposed)
    tokens = list(np.random.default_rng(5).integers(0, cfg.n_vocab, 40))
    for chunk in (32, 4):  # 32 rows: XLA's dot on [n_out, n_in]; 4 rows: the kernel
        expected, _ = Model(cfg, weights).score(tokens, chunk=chunk)
        got, _ = Model(cfg, packed).score(tokens, chunk=chunk)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
