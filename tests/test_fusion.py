"""Products that share an input stored as one (`weights.fuse_projections`): which fields fuse, and that a fused
model computes what the unfused one does, bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from jaxmodel.assets import default_model_path
from jaxmodel.gguf_io import q8_rows_from_blocks
from jaxmodel.kernels import cpu_matmul
from jaxmodel.layers import linear, project
from jaxmodel.model import load_model
from jaxmodel.weights import DenseFfn, Fused, GatedDeltaNet, Q8Rows, Transposed, fuse_fields

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel needs the CPU backend and g++")
rng = np.random.default_rng(0)


def _q8(n_in, n_out) -> Q8Rows:
    return q8_rows_from_blocks(quants.quantize(rng.standard_normal((n_out, n_in), np.float32), QT.Q8_0))


def _gdn(qkv, gate, beta, alpha) -> GatedDeltaNet:
    small = np.ones((4,), np.float32)
    return GatedDeltaNet(qkv=qkv, gate=gate, conv=np.ones((8, 4), np.float32), dt_bias=small, a=small, beta=beta,
                         alpha=alpha, norm=small, out=np.ones((8, 64), np.float32))  # fmt: skip


def test_runs_of_one_form_fuse_and_others_stay():
    f32 = lambda n: rng.standard_normal((64, n), np.float32)
    mixer = fuse_fields(_gdn(_q8(64, 24), _q8(64, 8), f32(4), f32(4)), ("qkv", "gate", "beta", "alpha"))
    assert isinstance(mixer.qkv, Fused) and mixer.qkv.sizes == (24, 8) and isinstance(mixer.qkv.w, Q8Rows)
    assert mixer.gate is None
    assert isinstance(mixer.beta, Fused) and mixer.beta.sizes == (4, 4) and mixer.alpha is None
    assert mixer.conv.shape == (8, 4)  # fields outside the names are untouched
    # A run broken by another form: Transposed, array, Transposed fuse nothing.
    t = Transposed(f32(16).T.copy())
    mixer = fuse_fields(_gdn(t, f32(8), t, f32(4)), ("qkv", "gate", "beta", "alpha"))
    assert mixer.qkv is t and not any(isinstance(getattr(mixer, n), Fused) for n in ("gate", "beta", "alpha"))
    # Different numbers of inputs never fuse.
    ffn = fuse_fields(DenseFfn(gate=f32(8), up=rng.standard_normal((32, 8), np.float32), down=f32(8)), ("gate", "up"))
    assert not isinstance(ffn.gate, Fused)


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 17])
def test_project_equals_separate_products_bit_for_bit(M):
    x = jnp.asarray(rng.standard_normal((2, M, 64), np.float32))
    weights = (_q8(64, 24), _q8(64, 8), _q8(64, 4), rng.standard_normal((64, 4), np.float32))
    mixer = fuse_fields(_gdn(*weights), ("qkv", "gate", "beta", "alpha"))
    fused = project(x, (mixer.qkv, mixer.gate, mixer.beta, mixer.alpha))
    assert [y.shape for y in fused] == [(2, M, 24), (2, M, 8), (2, M, 4), (2, M, 4)]
    for got, w in zip(fused, weights):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(linear(x, w)))
    with pytest.raises(ValueError, match="2 projections expected"):
        project(x, (mixer.qkv, mixer.gate))  # a Fused weight standing for more fields than are named


def test_bundled_model_fuses_and_scores_as_unfused():
    fused = load_model(default_model_path())
    layer = fused.weights.layers[0]
    assert isinstance(layer.mixer.qkv, Fused) and layer.mixer.gate is None and isinstance(layer.ffn.gate, Fused)
    assert isinstance(fused.weights.mtp.layer.mixer.q, Fused)
    plain = load_model(default_model_path(), fuse=False)
    assert not isinstance(plain.weights.layers[0].mixer.qkv, Fused)
    tokens = [int(t) for t in rng.integers(0, 4096, 24)]
    for a, b in zip(fused.score(tokens), plain.score(tokens)):
        np.testing.assert_array_equal(a, b)
