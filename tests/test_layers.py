"""`linear`: every product it may pick for a shape equals the float64 product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.layers import EIGEN_ROWS_MAX, WIDE_N_OUT, linear, paired_row_dot, small_row_form

ON_CPU = jax.default_backend() == "cpu"

# (lead shape of x, n_in, n_out, weight dtype, the form picked on CPU). n_in != n_out and M != n_in throughout, so a
# transposed operand or output fails on shapes or on values.
CASES = [
    ((1,), 512, 1024, jnp.float32, "dot"),  # one row: XLA's matrix-vector product
    ((1, 1), 1024, 512, jnp.float32, "dot"),
    ((2,), 512, 1024, jnp.float32, "rows"),
    ((2, 1), 1024, 512, jnp.float32, "rows"),  # [B, T] leading dims, M = 2
    ((3,), 512, 1024, jnp.float32, "eigen"),
    ((4,), 32, WIDE_N_OUT, jnp.float32, "rows"),  # the LM head's width: one-row products up to 4 rows
    ((5,), 32, WIDE_N_OUT, jnp.float32, "eigen"),
    ((1, 4), 1024, 512, jnp.float32, "eigen"),
    ((2, 4), 512, 1024, jnp.float32, "eigen"),
    ((EIGEN_ROWS_MAX,), 512, 1024, jnp.float32, "eigen"),
    ((EIGEN_ROWS_MAX + 1,), 512, 1024, jnp.float32, "dot"),  # prefill chunks: YNNPACK's matrix product
    ((4,), 192, 512, jnp.float32, "eigen"),  # cache-resident weights (the bundled model's FFN) take the rule too
    ((2,), 192, 4, jnp.float32, "rows"),  # a GDN layer's beta projection
    ((4,), 512, 1024, jnp.float16, "dot"),  # f16 weights round x to f16 (ggml's CPU kernels do)
]


@pytest.mark.parametrize("lead,n_in,n_out,dtype,form", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_form_equals_the_float64_product(lead, n_in, n_out, dtype, form, with_bias):
    m = int(np.prod(lead))
    w_f32 = jnp.asarray(np.random.default_rng(n_in + n_out + m).standard_normal((n_in, n_out)), dtype)
    assert small_row_form(m, w_f32) == (form if ON_CPU else "dot")
    rng = np.random.default_rng(m)
    x = rng.standard_normal((*lead, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32) if with_bias else None
    y = jax.jit(linear)(jnp.asarray(x), w_f32, None if bias is None else jnp.asarray(bias))
    assert y.shape == (*lead, n_out) and y.dtype == jnp.float32
    x64 = x.astype(np.float16) if dtype == jnp.float16 else x
    ref = x64.astype(np.float64) @ np.asarray(w_f32, np.float64) + (0.0 if bias is None else bias)
    # f32 summation over n_in terms: relative to the product's scale, a few ulps times sqrt(n_in)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=0, atol=2e-6 * scale)


def test_paired_row_dot_is_the_one_row_product():
    """The GPU's pair-of-rows form of a one-row product (`layers.paired_row_dot`) returns the one row's product:
    float32 weights, and bf16 weights accumulating in float32."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 96)).astype(np.float32)
    w = rng.normal(size=(96, 40)).astype(np.float32)
    got = paired_row_dot(jnp.asarray(x), jnp.asarray(w), jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-5)
    x16, w16 = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    want = jnp.dot(x16, w16, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(paired_row_dot(x16, w16, jax.lax.Precision.DEFAULT)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
