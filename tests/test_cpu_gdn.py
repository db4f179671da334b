"""The CPU gated-delta-rule kernel against the reference: the scheduler's write patterns, padding past n_tokens, a
token's independence of its step's length and batch, its errors, and the dispatch that takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import check_against_reference
from jaxmodel import delta_rule
from jaxmodel.delta_rule import choose_implementation
from jaxmodel.kernels import cpu_matmul
from jaxmodel.kernels.cpu_gdn import gdn_recurrent_cpu
from jaxmodel.kernels.problems import random_inputs, random_problem

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
run = jax.jit(gdn_recurrent_cpu)


def _all_tokens(problem):
    return np.full((problem.q.shape[0],), problem.q.shape[1], np.int32)


@needs_kernel
@pytest.mark.parametrize("n_tokens,dk,dv", [(1, 16, 16), (2, 16, 16), (5, 32, 32), (16, 16, 16), (40, 16, 16),
                                            (3, 128, 128), (6, 64, 64), (4, 16, 12)])
def test_kernel_matches_reference(n_tokens, dk, dv):
    problem = random_problem(70 + n_tokens, n_tokens=n_tokens, dk=dk, dv=dv)
    outputs, pool = run(*problem.args, _all_tokens(problem))
    check_against_reference(problem, outputs, pool, final_only=False)


@needs_kernel
@pytest.mark.parametrize("n_tokens", [1, 7])
def test_kernel_matches_reference_final_only(n_tokens):
    """Prefill's pattern: one write per row, at its last token (row 2's into the plane it read)."""
    problem = random_problem(80 + n_tokens, n_tokens=n_tokens, final_only=True)
    outputs, pool = run(*problem.args, _all_tokens(problem))
    check_against_reference(problem, outputs, pool, final_only=True)


@needs_kernel
def test_tokens_past_n_tokens_are_padding():
    """They give 0 and write nothing, even where their write plane is named; the tokens before are unchanged."""
    problem = random_problem(90, n_tokens=6)
    writes = problem.write_planes.copy()
    writes[1, 3:] = [1 + writes.max() + i for i in range(3)]  # row 1 names planes for its (padding) tokens 3..5
    pool = np.concatenate([problem.ssm_pool, np.ones((3,) + problem.ssm_pool.shape[1:], np.float32)])
    n_tokens = np.array([6, 3, 6, 0], np.int32)
    outputs, new_pool = run(problem.q, problem.k, problem.v, problem.g, problem.beta, pool, problem.read_plane,
                            writes, n_tokens)  # fmt: skip
    full, _ = run(*problem.args, _all_tokens(problem))
    outputs, new_pool = np.asarray(outputs), np.asarray(new_pool)
    np.testing.assert_array_equal(outputs[1, 3:], 0.0)
    np.testing.assert_array_equal(outputs[3], 0.0)
    np.testing.assert_array_equal(outputs[1, :3], np.asarray(full)[1, :3])
    np.testing.assert_array_equal(new_pool[-3:], 1.0)


@needs_kernel
@pytest.mark.parametrize("dk", [32, 128])
def test_a_tokens_state_is_the_same_bits_in_a_step_of_any_length(dk):
    """The states after each of 8 tokens fed one per step equal those of one 8-token step, bit for bit, and a row's
    do not depend on the other rows: what lets a verify step and replay's rebuild reproduce decoding."""
    rng = np.random.default_rng(3)
    B, T, Hk, Hv = 3, 8, 2, 4
    q, k, v, g, beta = random_inputs(rng, B, T, Hk, Hv, dk, dk)
    pool = rng.normal(scale=0.5, size=(1 + B * (T + 1), Hv, dk, dk)).astype(np.float32)
    reads = np.arange(1, B + 1, dtype=np.int32)
    writes = (1 + B + np.arange(B * T, dtype=np.int32)).reshape(B, T)
    out_whole, whole = run(q, k, v, g, beta, pool, reads, writes, np.full(B, T, np.int32))
    stepped, read, outs = pool, reads, []
    for t in range(T):
        sl = np.s_[:, t : t + 1]
        out_t, stepped = run(q[sl], k[sl], v[sl], g[sl], beta[sl], stepped, read, writes[sl], np.ones(B, np.int32))
        read, outs = writes[:, t], outs + [np.asarray(out_t)]
    np.testing.assert_array_equal(np.asarray(stepped), np.asarray(whole))
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), np.asarray(out_whole))
    _, alone = run(q[:1], k[:1], v[:1], g[:1], beta[:1], pool, reads[:1], writes[:1], np.full(1, T, np.int32))
    np.testing.assert_array_equal(np.asarray(alone)[writes[0]], np.asarray(whole)[writes[0]])


@needs_kernel
def test_every_row_reads_before_any_row_writes():
    """Row 0 writes the plane row 1 reads: row 1 still starts from that plane's old state (XLA's gather, then
    scatter)."""
    problem = random_problem(95, n_tokens=3)
    writes = problem.write_planes.copy()
    writes[0, 0] = problem.read_plane[1]
    outputs, _ = run(problem.q, problem.k, problem.v, problem.g, problem.beta, problem.ssm_pool, problem.read_plane,
                     writes, _all_tokens(problem))  # fmt: skip
    expected, _ = run(*problem.args, _all_tokens(problem))
    np.testing.assert_array_equal(np.asarray(outputs)[1], np.asarray(expected)[1])


@needs_kernel
def test_planes_outside_the_pool_read_and_write_as_xlas_gather_and_scatter():
    """A read plane past the pool is clamped into it and a write past it is dropped, as `recurrent_scan`'s gather and
    dropping scatter do (the engine's padding rows rely on it)."""
    problem = random_problem(96, n_tokens=2)
    writes, reads = problem.write_planes.copy(), problem.read_plane.copy()
    writes[1, -1] = len(problem.ssm_pool)  # dropped: row 1 writes nothing
    reads[3] = len(problem.ssm_pool) + 5  # clamped to the last plane
    outputs, pool = run(*problem.args[:6], reads, writes, _all_tokens(problem))
    want_out, want_pool = jax.jit(delta_rule.recurrent_scan)(*problem.args[:6], reads, writes)
    np.testing.assert_allclose(np.asarray(outputs), np.asarray(want_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(want_pool), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_gradients_are_recurrent_scans():
    """Training differentiates the model on CPU: the kernel's VJP is `recurrent_scan`'s."""
    problem = random_problem(98, n_tokens=5)
    floats = tuple(map(jnp.asarray, problem.args[:6]))
    ints = (problem.read_plane, problem.write_planes)

    def loss(fn, *f):
        out, pool = fn(*f, *ints)
        return jnp.sum(out * out) + jnp.sum(jnp.sin(pool))

    got = jax.grad(lambda *f: loss(lambda *a: gdn_recurrent_cpu(*a, _all_tokens(problem)), *f), argnums=range(6))(
        *floats)
    want = jax.grad(lambda *f: loss(delta_rule.recurrent_scan, *f), argnums=range(6))(*floats)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "pool"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4, err_msg=name)


@needs_kernel
def test_gated_delta_rule_takes_the_kernel_on_cpu():
    """Every step, prompt chunks included: one summation order for every token."""
    assert choose_implementation("cpu", 1, False, cpu_kernel=True) == "cpu"
    assert choose_implementation("cpu", delta_rule.SCAN_STATES_MAX_TOKENS, True, cpu_kernel=True) == "cpu"
    assert choose_implementation("cpu", 128, False, cpu_kernel=True) == "cpu"
    assert choose_implementation("cpu", delta_rule.CPU_CHUNKED_MIN_TOKENS, True, cpu_kernel=True) == "cpu"
    assert choose_implementation("cpu", delta_rule.CPU_CHUNKED_MIN_TOKENS, True, cpu_kernel=False) == "chunked"
    assert choose_implementation("gpu", 1, False, cpu_kernel=True) == "pallas_recurrent"
    problem = random_problem(97, n_tokens=4)
    text = jax.jit(delta_rule.gated_delta_rule).trace(*map(jnp.asarray, problem.args)).lower().as_text()
    assert cpu_matmul.TARGET_GDN in text
    outputs, pool = delta_rule.gated_delta_rule(*problem.args)
    check_against_reference(problem, outputs, pool, final_only=False)
