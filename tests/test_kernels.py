"""The Pallas kernels against the reference (compiled on a GPU, interpreted elsewhere), and their lowering to Triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET, check_against_reference
from jaxmodel.delta_rule import gated_delta_rule
from jaxmodel.kernels.gdn_chunked import gdn_chunked, unit_lower_inverse
from jaxmodel.kernels.gdn_recurrent import gdn_recurrent
from jaxmodel.kernels.problems import random_problem


@pytest.mark.parametrize("n_tokens,dk,block_v", [(1, 16, None), (2, 16, 16), (5, 16, None), (64, 16, 16),
                                                 (200, 16, 16), (5, 32, None), (5, 128, 64)])
def test_recurrent_kernel_matches_reference(n_tokens, dk, block_v):
    problem = random_problem(40 + n_tokens, n_tokens=n_tokens, dk=dk, dv=dk)
    outputs, pool = gdn_recurrent(*problem.args, block_v=block_v, interpret=INTERPRET)
    check_against_reference(problem, outputs, pool, final_only=False)


@pytest.mark.parametrize("n_tokens,dk,chunk", [(1, 16, 16), (5, 32, 16), (64, 16, 16), (200, 16, 32),
                                               (64, 128, 16)])
def test_chunked_kernel_matches_reference(n_tokens, dk, chunk):
    problem = random_problem(50 + n_tokens, n_tokens=n_tokens, dk=dk, dv=dk, final_only=True)
    outputs, pool = gdn_chunked(*problem.args, chunk=chunk, interpret=INTERPRET)
    check_against_reference(problem, outputs, pool, final_only=True)


def test_gated_delta_rule_runs_kernels_interpreted_off_gpu():
    problem = random_problem(60, n_tokens=5, final_only=True)
    for impl in ("pallas_recurrent", "pallas_chunked"):
        outputs, pool = gated_delta_rule(*map(jnp.asarray, problem.args), final_only=True, impl=impl)
        check_against_reference(problem, outputs, pool, final_only=True)


def test_unit_lower_inverse():
    rng = np.random.default_rng(4)
    a = np.tril(rng.normal(scale=0.5, size=(16, 16)), -1).astype(np.float32)
    inverse = np.asarray(jax.jit(unit_lower_inverse)(a))
    np.testing.assert_allclose(inverse @ (np.eye(16) + a), np.eye(16), atol=1e-5)


def _shapes(n_rows, n_tokens, n_key_heads, n_value_heads, d, n_planes):
    spec = jax.ShapeDtypeStruct
    return (spec((n_rows, n_tokens, n_key_heads, d), jnp.bfloat16), spec((n_rows, n_tokens, n_key_heads, d), jnp.bfloat16),
            spec((n_rows, n_tokens, n_value_heads, d), jnp.bfloat16), spec((n_rows, n_tokens, n_value_heads), jnp.float32),
            spec((n_rows, n_tokens, n_value_heads), jnp.float32), spec((n_planes, n_value_heads, d, d), jnp.float32),
            spec((n_rows,), jnp.int32), spec((n_rows, n_tokens), jnp.int32))


@pytest.mark.parametrize("kernel,n_tokens", [(gdn_recurrent, 4), (gdn_chunked, 100)])
def test_kernels_lower_to_triton_for_qwen3_next_shapes(kernel, n_tokens):
    """Lowering for CUDA runs the Pallas Triton lowering (no GPU needed): every op must have a Triton rule."""
    lowered = kernel.trace(*_shapes(2, n_tokens, 16, 32, 128, 9)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "triton" in text
    assert "output_operand_alias" in text  # the pool is updated in place
