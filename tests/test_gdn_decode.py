"""The fused GDN decode kernel (`kernels.gdn_decode`) against its jnp reference (compiled on a GPU, interpreted
elsewhere), its lowering to Triton at real shapes, and a model step that takes it against one that does not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRET
from jaxmodel import gdn
from jaxmodel.kernels.gdn_decode import gdn_decode, gdn_decode_reference
from jaxmodel.kernels.problems import random_problem
from jaxmodel.model import forward
from jaxmodel.state import Row, pack_batch

EPS = 1e-6


def layer_problem(seed: int, n_tokens: int, n_key_heads: int, n_value_heads: int, d: int, n_taps: int = 4):
    """The arguments of `gdn_decode` for random_problem's four rows (fresh, checkpoint, padded tail with a write
    into the plane it reads, all padding) and random pools, float32."""
    rng = np.random.default_rng(seed)
    planes = random_problem(seed, n_tokens=n_tokens, n_key_heads=n_key_heads, n_value_heads=n_value_heads, dk=d,
                            dv=d)
    n_rows, channels = 4, (2 * n_key_heads + n_value_heads) * d
    real = np.array([n_tokens, n_tokens, n_tokens - 2 if n_tokens > 2 else n_tokens, 0], np.int32)
    conv_pool = rng.normal(size=(planes.ssm_pool.shape[0], channels, n_taps - 1)).astype(np.float32)
    conv_pool[0] = 0.0
    normal = lambda *shape, scale=1.0: (rng.normal(size=shape) * scale).astype(np.float32)
    return dict(
        qkv=normal(n_rows, n_tokens, channels), z=normal(n_rows, n_tokens, n_value_heads * d),
        beta=normal(n_rows, n_tokens, n_value_heads), alpha=normal(n_rows, n_tokens, n_value_heads),
        w_conv=normal(channels, n_taps, scale=0.5), dt_bias=normal(n_value_heads),
        a=-np.exp(normal(n_value_heads, scale=0.5)), norm=1.0 + normal(d, scale=0.1),
        conv_pool=conv_pool, ssm_pool=planes.ssm_pool, read_plane=planes.read_plane,
        write_planes=planes.write_planes, n_tokens=real)


@pytest.mark.parametrize("n_tokens,n_key_heads,n_value_heads,d", [(1, 2, 4, 16), (4, 2, 4, 16), (5, 2, 2, 32),
                                                                  (3, 1, 4, 16)])
def test_fused_kernel_matches_reference(n_tokens, n_key_heads, n_value_heads, d):
    args = layer_problem(70 + n_tokens, n_tokens, n_key_heads, n_value_heads, d)
    o, conv_pool, ssm_pool = gdn_decode(**{k: jnp.asarray(v) for k, v in args.items()}, n_key_heads=n_key_heads,
                                        eps=EPS, interpret=INTERPRET)
    want_o, want_conv, want_ssm = gdn_decode_reference(**{k: jnp.asarray(v) for k, v in args.items()},
                                                       n_key_heads=n_key_heads, eps=EPS)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ssm_pool), np.asarray(want_ssm), rtol=2e-4, atol=2e-5)
    # The conv planes are copies of raw inputs: every plane, written or not, bit for bit.
    np.testing.assert_array_equal(np.asarray(conv_pool), np.asarray(want_conv))
    written = set(args["write_planes"][args["write_planes"] >= 0].tolist())
    assert written, "the problem writes planes"
    for plane in set(range(args["ssm_pool"].shape[0])) - written:
        np.testing.assert_array_equal(np.asarray(ssm_pool[plane]), args["ssm_pool"][plane])


@pytest.mark.parametrize("n_tokens,n_key_heads,n_value_heads", [(1, 16, 16), (4, 16, 16), (1, 16, 32)])
def test_fused_kernel_lowers_to_triton_at_model_shapes(n_tokens, n_key_heads, n_value_heads):
    """Qwen3.5 0.8B's GDN shape (16 key and value heads of 128) and Qwen3-Next's (32 value heads): lowering for CUDA
    runs the Pallas Triton lowering without a GPU, so every op must have a Triton rule."""
    d, n_rows, n_planes, channels = 128, 2, 9, (2 * n_key_heads + n_value_heads) * 128
    spec = jax.ShapeDtypeStruct
    f32 = jnp.float32
    shapes = (spec((n_rows, n_tokens, channels), f32), spec((n_rows, n_tokens, n_value_heads * d), f32),
              spec((n_rows, n_tokens, n_value_heads), f32), spec((n_rows, n_tokens, n_value_heads), f32),
              spec((channels, 4), f32), spec((n_value_heads,), f32), spec((n_value_heads,), f32), spec((d,), f32),
              spec((n_planes, channels, 3), f32), spec((n_planes, n_value_heads, d, d), f32),
              spec((n_rows,), jnp.int32), spec((n_rows, n_tokens), jnp.int32), spec((n_rows,), jnp.int32))
    text = gdn_decode.trace(*shapes, n_key_heads=n_key_heads, eps=EPS).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1  # one kernel for the layer
    assert "output_operand_alias" in text  # both pools are updated in place


def test_model_step_with_the_fused_kernel_matches_xla_form(tiny_model):
    """Two steps of the tiny model, a 4-token verify row (snapshots) beside a padded one-token row, then a decode step
    from the planes they wrote, every GDN layer through the fused kernel (interpreted here) against XLA's form: the
    same logits, and the same conv and state planes."""
    model = tiny_model
    steps = [[Row([3, 4, 5, 6], 0, [1], 0, [-1, 1, -1, 2], range(4)), Row([7], 0, [2], 0, [3], range(1))],
             [Row([8], 4, [1], 2, [2], range(1)), Row([9], 1, [2], 3, [4], range(1))]]
    results = {}
    for fused in (False, True):
        gdn.FORCE_FUSED = fused
        try:
            step = jax.jit(functools.partial(forward, cfg=model.cfg))
            state, logits = model.new_state(n_pages=3, n_planes=5), []
            for rows in steps:
                out, state = step(model.weights, batch=pack_batch(rows), state=state)
                logits.append(np.asarray(out.logits))
            results[fused] = logits, state
        finally:
            gdn.FORCE_FUSED = None
    (logits_x, state_x), (logits_f, state_f) = results[False], results[True]
    for got, want in zip(logits_f, logits_x, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(jax.tree.leaves(state_f), jax.tree.leaves(state_x), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
