"""The CPU argmax kernel against jnp.argmax: random rows, ties (the first maximum wins, also across the kernel's
lanes), NaN (the first NaN wins), infinities, signed zeros, short rows and tails, leading dimensions, vmap, and the
dispatch that takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_argmax import argmax_rows, greedy_tokens

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
run = jax.jit(argmax_rows)


def _check(x):
    x = np.asarray(x, np.float32)
    np.testing.assert_array_equal(np.asarray(run(x)), np.asarray(jnp.argmax(x, axis=-1)))


@needs_kernel
@pytest.mark.parametrize("V", [1, 3, 7, 8, 9, 16, 17, 4096, 4101])
def test_random_rows(V):
    rng = np.random.default_rng(V)
    _check(rng.standard_normal((5, V)))
    _check(rng.integers(-3, 3, (6, V)))  # many ties


@needs_kernel
def test_ties_take_the_first_maximum():
    for positions in ([3, 11], [11, 3], [0, 8], [9, 10], [17, 40, 41], [2, 1000]):
        x = np.zeros((1, 1024), np.float32)
        x[0, positions] = 5.0
        assert int(run(x)[0]) == min(positions)
    x = np.full((2, 33), -np.inf, np.float32)
    x[1, [30, 5]] = -np.inf  # all -inf: the first
    _check(x)


@needs_kernel
def test_nan_infinities_and_signed_zeros():
    rng = np.random.default_rng(1)
    for index in (0, 5, 8, 9, 100, 1027):
        x = rng.standard_normal((2, 1030)).astype(np.float32)
        x[0, index] = np.nan
        x[0, 1028] = np.nan
        x[1, index] = np.inf
        _check(x)
    _check(np.array([[-0.0, 0.0] * 9, [0.0, -0.0] * 9], np.float32))
    _check(np.array([[-np.inf, np.inf, np.inf, 1.0] * 5], np.float32))


@needs_kernel
def test_leading_dimensions_and_vmap():
    x = np.random.default_rng(2).standard_normal((2, 3, 4, 257)).astype(np.float32)
    _check(x)
    assert run(x).shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(argmax_rows))(x)), np.asarray(jnp.argmax(x, -1)))
    _check(x[0, 0, 0])  # one row: [V] -> []


@needs_kernel
def test_greedy_tokens_takes_the_kernel_on_cpu():
    x = jnp.ones((2, 64), jnp.float32)
    assert "gdnspec_argmax_rows" in jax.jit(greedy_tokens).lower(x).as_text()
    assert "gdnspec_argmax_rows" not in jax.jit(greedy_tokens).lower(x.astype(jnp.bfloat16)).as_text()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="float32 x"):
        argmax_rows(jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="V >= 1"):
        argmax_rows(jnp.ones((2, 0), jnp.float32))
