"""The few-row product kernel (`jaxmodel/kernels/row_product.py`) against its reference: interpreted off GPU,
compiled on one (`make gpu-quick` runs this file there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.kernels.row_product import MAX_ROWS, plan, row_product, row_product_reference

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_row_product_matches_its_reference(m, dtype):
    """K = 448 (7 x 64: runs of 64 rows), N = 96 (column blocks of 32): several programs along both axes."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 448)), jnp.float32).astype(dtype).astype(jnp.float32)
    w = jnp.asarray(rng.standard_normal((448, 96)) * 0.05, dtype)
    got = row_product(x, w, target_programs=8, interpret=INTERPRET)
    assert got.shape == (m, 96) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(row_product_reference(x, w)), rtol=1e-5, atol=1e-5)


def test_plan_splits_k_until_enough_programs_run():
    """The 0.8B shape's GDN out ([2048, 1024]): 8 column blocks of 128, K split into 64 runs of 32 for 512
    programs; the FFN down ([3584, 1024], 7 x 512): runs of 32, 896 programs (448 would be too few); a width with
    no power-of-two block of 16 is left to XLA."""
    assert plan(2048, 1024) == plan(2048, 1024, 512)
    gdn_out = plan(2048, 1024)
    assert (gdn_out.block_n, gdn_out.splits, gdn_out.run(2048)) == (128, 64, 32)
    down = plan(3584, 1024)
    assert (down.block_n, down.run(3584), down.splits) == (128, 32, 112)
    assert plan(1024, 24) is None and plan(24, 1024) is None


def test_row_product_refuses_shapes_it_does_not_take():
    with pytest.raises(ValueError, match="not a shape it takes"):
        row_product(jnp.zeros((MAX_ROWS + 1, 64)), jnp.zeros((64, 64)), interpret=INTERPRET)


def test_linear_runs_it_where_the_form_says_so(monkeypatch):
    """`layers.linear` with the "kernel" form (on a GPU with GDNSPEC_GPU_ROW_KERNEL=1): the kernel's product for
    the rows, with x rounded to the weight's dtype as every form does."""
    from jaxmodel import layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 1, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) * 0.05, jnp.bfloat16)
    want = layers.linear(x, w)
    monkeypatch.setattr(layers, "small_row_form", lambda m, w: "kernel")
    got = layers.linear(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
