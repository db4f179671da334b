"""The Q8_0 product's prologues (`cpu_matmul.q8_rows_matmul_prologue`): an RMS norm, SwiGLU's gate and the GDN
output's gated norm, computed by the kernel on each live row just before it is quantized, against their jnp
specification (`cpu_matmul.prologue_reference`), row by row alike whatever the batch, and taken by `linear` for a
`Prologued` input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.kernels import cpu_matmul
from jaxmodel.layers import Prologued, linear
from jaxmodel.weights import Q8Rows

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
EPS = 1e-6


def _weight(K: int, N: int, seed: int = 0) -> Q8Rows:
    quants, scales = cpu_matmul.quantize_rows_q8_0(jnp.asarray(np.random.default_rng(seed).standard_normal((N, K)),
                                                               jnp.float32) / np.sqrt(K))  # fmt: skip
    return Q8Rows.from_file_order(np.asarray(quants), np.asarray(scales))


def _inputs(prologue: str, M: int, K: int, G: int, seed: int = 1) -> dict:
    """x (and weight, gate) for `prologue` over M rows of a K-input product; groups of G for the gated norm."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s) * 2, jnp.float32)  # noqa: E731
    if prologue == "swiglu":
        x = f32(M, 2 * K).at[0, :8].set(jnp.asarray([-200, -90, -88, -1e-3, 0, 1e-3, 88, 200], jnp.float32))
        return {"x": x}
    inputs = {"x": f32(M, K).at[0].set(0.0), "weight": f32(G if prologue == "gated_rms_norm" else K)}  # a zero row
    if prologue == "gated_rms_norm":
        inputs["gate"] = f32(M, K)
    return inputs


PROLOGUES = [("rms_norm", 192, 192), ("rms_norm", 1024, 1024), ("swiglu", 512, 0), ("swiglu", 96, 0),
             ("gated_rms_norm", 128, 32), ("gated_rms_norm", 160, 20)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("prologue,K,G", PROLOGUES)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_prologue_matches_its_reference(prologue, K, G, M):
    # Groups of 20 leave a tail of four columns after each vector of eight; swiglu's x runs through exp's clamps
    # (silu of -200 and 200); rows of zeros norm to zeros (eps keeps the scale finite).
    w, inputs = _weight(K, 40), _inputs(prologue, M, K, G)
    got = np.asarray(jax.jit(cpu_matmul.q8_rows_matmul_prologue, static_argnums=(0, 7))(
        prologue, inputs["x"], w.quants, w.scales, None, inputs.get("weight"), inputs.get("gate"), EPS))
    value = cpu_matmul.prologue_reference(prologue, inputs["x"], inputs.get("weight"), inputs.get("gate"), EPS)
    want = np.asarray(cpu_matmul.q8_rows_matmul_reference(value, w.quants, w.scales))
    assert np.all(np.isfinite(got))
    # The prologue's last bits may differ from jnp's, which can move a quantized value by one step.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("prologue,K,G", [("rms_norm", 192, 192), ("swiglu", 512, 0), ("gated_rms_norm", 160, 20)])
def test_each_row_is_computed_alike_whatever_the_rows_beside_it(prologue, K, G):
    """16 rows of swiglu at K = 512 are prepared on the pool's threads, one row alone on the caller's: the same
    bits. Rows that are not live come back as 0."""
    w, inputs = _weight(K, 300), _inputs(prologue, 24, K, G, seed=5)
    f = jax.jit(cpu_matmul.q8_rows_matmul_prologue, static_argnums=(0, 7))
    gate = inputs.get("gate")

    def rows(a, b, live=None):
        return np.asarray(f(prologue, inputs["x"][a:b], w.quants, w.scales, live, inputs.get("weight"),
                            None if gate is None else gate[a:b], EPS))  # fmt: skip

    alone = np.concatenate([rows(m, m + 1) for m in range(24)])
    for M in (2, 4, 16, 24):
        np.testing.assert_array_equal(rows(0, M), alone[:M])
    live = jnp.asarray(np.arange(24) % 3 != 1)
    got = rows(0, 24, live)
    np.testing.assert_array_equal(got[np.asarray(live)], alone[np.asarray(live)])
    assert not np.any(got[~np.asarray(live)])


@needs_kernel
@pytest.mark.parametrize("prologue,K,G", [("rms_norm", 192, 192), ("swiglu", 96, 0), ("gated_rms_norm", 128, 32)])
def test_linear_takes_a_prologued_input(prologue, K, G):
    """Over Q8_0 blocks `linear` runs the prologue in the kernel; over any other weight it multiplies the jnp value."""
    inputs = _inputs(prologue, 6, K, G, seed=3)
    lead = lambda a: None if a is None else a.reshape(2, 3, -1)  # noqa: E731
    x = Prologued(prologue, lead(inputs["x"]), inputs.get("weight"), lead(inputs.get("gate")), EPS)
    assert x.shape == (2, 3, K)
    q8 = _weight(K, 24)
    got = np.asarray(jax.jit(lambda: linear(x, q8))())
    want = np.asarray(linear(x.value(), q8))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    dense = jnp.asarray(np.random.default_rng(0).standard_normal((K, 24)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(linear(x, dense)), np.asarray(linear(x.value(), dense)))


@needs_kernel
def test_prologue_refuses_what_it_cannot_compute():
    w = _weight(64, 8)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="unknown prologue"):
        cpu_matmul.q8_rows_matmul_prologue("layer_norm", x, w.quants, w.scales, weight=jnp.ones(64))
    with pytest.raises(ValueError, match="takes a weight"):
        cpu_matmul.q8_rows_matmul_prologue("rms_norm", x, w.quants, w.scales)
    with pytest.raises(ValueError, match="takes float32 x"):
        cpu_matmul.q8_rows_matmul_prologue("swiglu", x, w.quants, w.scales)  # swiglu's x is [M, 2K]
    with pytest.raises(Exception, match="multiple of G"):  # the kernel's own check
        jax.block_until_ready(cpu_matmul.q8_rows_matmul_prologue(
            "gated_rms_norm", x, w.quants, w.scales, weight=jnp.ones(24), gate=x))
