"""The plain delta-rule forms (reference, `recurrent_scan`, jnp chunked) and the dispatch in `gated_delta_rule`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import check_against_reference, tolerance
from jaxmodel import delta_rule
from jaxmodel.delta_rule import (advance_states, chunked_scan, choose_implementation, gated_delta_rule,
                                 invert_unit_lower, recurrent_scan)
from jaxmodel.kernels.problems import random_inputs, random_problem
from jaxmodel.kernels.reference import delta_rule_reference


def test_reference_single_token_from_zero_state_is_a_scaled_outer_product():
    rng = np.random.default_rng(1)
    q, k, v, g, beta = (x.astype(np.float64) for x in random_inputs(rng, 1, 1, 2, 4, 8, 6))
    result = delta_rule_reference(q, k, v, g, beta, np.zeros((1, 4, 8, 6)), keep_states=True)
    for h in range(4):
        key_head = h % 2
        state = beta[0, 0, h] * np.outer(k[0, 0, key_head], v[0, 0, h])
        np.testing.assert_allclose(result.final_state[0, h], state, rtol=1e-12)
        np.testing.assert_allclose(result.outputs[0, 0, h], state.T @ q[0, 0, key_head] / np.sqrt(8), rtol=1e-12)
    np.testing.assert_array_equal(result.states[:, -1], result.final_state)


def test_reference_decays_then_corrects_towards_v():
    """With k a unit vector and beta = 1, S^T k equals v right after the update, whatever S held."""
    rng = np.random.default_rng(2)
    q, k, v, g, beta = random_inputs(rng, 1, 3, 1, 1, 4, 3)
    beta[:] = 1.0
    initial = rng.normal(size=(1, 1, 4, 3))
    result = delta_rule_reference(q, k, v, g, beta, initial, keep_states=True)
    for t in range(3):
        np.testing.assert_allclose(result.states[0, t, 0].T @ k[0, t, 0], v[0, t, 0], rtol=1e-6, atol=1e-6)
    # Orthogonal to k only the decay acts.
    other = np.linalg.svd(k[0, 0, 0][None, :].astype(np.float64))[2][1]
    np.testing.assert_allclose(result.states[0, 0, 0].T @ other,
                               np.exp(g[0, 0, 0]) * initial[0, 0].T @ other, rtol=1e-6, atol=1e-9)


def test_reference_padding_tokens_leave_the_state_alone():
    rng = np.random.default_rng(3)
    q, k, v, g, beta = random_inputs(rng, 1, 4, 2, 4, 8, 8)
    g[:, 2:] = 0.0
    beta[:, 2:] = 0.0
    result = delta_rule_reference(q, k, v, g, beta, rng.normal(size=(1, 4, 8, 8)), keep_states=True)
    np.testing.assert_array_equal(result.states[:, 1], result.states[:, 3])


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _chunked(q, k, v, g, beta, ssm_pool, read_plane, write_planes, chunk_size):
    return chunked_scan(q, k, v, g, beta, ssm_pool, read_plane, write_planes, chunk_size=chunk_size)


@pytest.mark.parametrize("n_tokens,dk", [(1, 16), (2, 16), (5, 16), (64, 16), (200, 16), (5, 32), (200, 128)])
def test_recurrent_scan_matches_reference(n_tokens, dk):
    problem = random_problem(10 + n_tokens, n_tokens=n_tokens, dk=dk, dv=dk)
    outputs, pool = jax.jit(recurrent_scan)(*problem.args)
    check_against_reference(problem, outputs, pool, final_only=False)


@pytest.mark.parametrize("n_tokens", [1, 5, 64])
def test_recurrent_scan_final_only_matches_reference(n_tokens):
    """The final-only scan (the replay rebuild's) carries the state alone and writes it once per row."""
    problem = random_problem(30 + n_tokens, n_tokens=n_tokens, final_only=True)
    outputs, pool = jax.jit(recurrent_scan, static_argnames="final_only")(*problem.args, final_only=True)
    check_against_reference(problem, outputs, pool, final_only=True)


@pytest.mark.parametrize("n_tokens,dk,chunk_size", [(1, 16, 16), (5, 32, 16), (64, 16, 16), (200, 16, 32),
                                                    (200, 128, 64)])
def test_chunked_scan_matches_reference(n_tokens, dk, chunk_size):
    problem = random_problem(20 + n_tokens, n_tokens=n_tokens, dk=dk, dv=dk, final_only=True)
    outputs, pool = _chunked(*problem.args, chunk_size=chunk_size)
    check_against_reference(problem, outputs, pool, final_only=True)


@pytest.mark.parametrize("n_tokens", [1, 3, 4, 5])
def test_advance_states_matches_reference(n_tokens):
    """Replay's rebuild: each row's state advanced by its kept tokens; the padding past them (g = beta = 0)
    leaves it alone."""
    rng = np.random.default_rng(50 + n_tokens)
    _, k, v, g, beta = random_inputs(rng, 4, n_tokens, 2, 4, 16, 16)
    n_keep = np.array([n_tokens, n_tokens // 2, 0, n_tokens])  # the kept tokens of each row
    padding = np.arange(n_tokens)[None, :] >= n_keep[:, None]
    g[padding], beta[padding] = 0.0, 0.0
    state = rng.normal(size=(4, 4, 16, 16)).astype(np.float32)
    advanced = np.asarray(jax.jit(advance_states)(k, v, g, beta, state, np.int32(n_keep.max())))
    ref = delta_rule_reference(k, k, v, g, beta, state)
    tol = tolerance(n_tokens)
    np.testing.assert_allclose(advanced, ref.final_state, atol=tol, rtol=tol)
    np.testing.assert_allclose(advanced[2], state[2], atol=tol, rtol=0)  # nothing kept


def test_invert_unit_lower_inverts_batched_unit_lower_triangular_matrices():
    rng = np.random.default_rng(5)
    a = np.tril(rng.normal(scale=0.5, size=(3, 2, 16, 16)), -1).astype(np.float32)
    inverse = np.asarray(jax.jit(invert_unit_lower)(a))
    np.testing.assert_allclose(inverse @ (np.eye(16) + a), np.broadcast_to(np.eye(16), a.shape), atol=1e-5)
    np.testing.assert_array_equal(np.triu(inverse, 1), 0.0)
    with pytest.raises(ValueError, match="power of two"):
        invert_unit_lower(np.zeros((12, 12), np.float32))


def test_choose_implementation():
    assert choose_implementation("cpu", 1, False) == "scan"
    assert choose_implementation("cpu", 4096, False) == "scan"
    assert choose_implementation("cpu", delta_rule.CPU_CHUNKED_MIN_TOKENS - 1, True) == "scan"
    assert choose_implementation("cpu", delta_rule.CPU_CHUNKED_MIN_TOKENS, True) == "chunked"
    assert choose_implementation("gpu", 8, False) == "pallas_recurrent"
    assert choose_implementation("gpu", 4096, False) == "pallas_recurrent"
    assert choose_implementation("gpu", delta_rule.GPU_CHUNKED_MIN_TOKENS, True) == "chunked"
    assert choose_implementation("gpu", 1, True) == "pallas_recurrent"


def test_gated_delta_rule_default_path_matches_reference():
    problem = random_problem(30, n_tokens=5)
    outputs, pool = gated_delta_rule(*map(jnp.asarray, problem.args))
    check_against_reference(problem, outputs, pool, final_only=False)


def test_gated_delta_rule_rejects_chunked_without_final_only_and_unknown_names():
    problem = random_problem(31, n_tokens=2)
    with pytest.raises(ValueError, match="final_only"):
        gated_delta_rule(*problem.args, impl="chunked")
    with pytest.raises(ValueError, match="unknown"):
        gated_delta_rule(*problem.args, impl="fast")
