"""The routed MoE forms (gathered experts, grouped matmul over expert-sorted tokens) against the dense reference
that evaluates every expert. The whole model runs the routed forms in the MoE fixtures' parity tests
(test_model_parity.py): prefill takes the grouped form, one-token decoding the gathered one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.moe import moe_ffn, moe_ffn_dense, route, routed_gathered, routed_grouped, shared_expert
from jaxmodel.random_model import PRESETS
from jaxmodel.weights import MoeFfn

E, FE = 32, 16


def random_moe(n_expert: int, seed: int, skew: float = 0.0) -> MoeFfn:
    """skew > 0 biases the router towards the first experts, so a few experts get most tokens."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.2)
    router = normal(E, n_expert) + skew * jnp.linspace(1.0, 0.0, n_expert)[None, :] * jnp.ones((E, 1))
    return MoeFfn(router=router, gate=normal(n_expert, E, FE), up=normal(n_expert, E, FE),
                  down=normal(n_expert, FE, E), shared_router=normal(E), shared_gate=normal(E, FE),
                  shared_up=normal(E, FE), shared_down=normal(FE, E))  # fmt: skip


def moe_cfg(n_expert: int, n_used: int):
    return PRESETS["tiny"].replace(n_embd=E, n_expert=n_expert, n_expert_used=n_used, n_ff_expert=FE, n_ff_shared=FE)


@pytest.mark.parametrize(
    "n_expert,n_used,n_tokens,skew",
    [(8, 2, 1, 0.0), (16, 4, 3, 4.0), (16, 4, 40, 0.0), (8, 2, 40, 4.0), (6, 6, 5, 0.0)],
)
def test_gathered_and_grouped_experts_equal_the_dense_reference(n_expert, n_used, n_tokens, skew):
    w = random_moe(n_expert, seed=n_tokens, skew=skew)
    cfg = moe_cfg(n_expert, n_used)
    x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, E))
    top_i, top_w = route(w, cfg, x)
    expected = moe_ffn_dense(w, cfg, x) - shared_expert(w, x)
    np.testing.assert_allclose(routed_gathered(w, x, top_i, top_w), expected, atol=2e-5, rtol=1e-5)
    for tile in (None, 3):
        got = jax.jit(functools.partial(routed_grouped, tile=tile))(w, x, top_i, top_w)
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5, err_msg=f"tile {tile}")


@pytest.mark.parametrize("shape", [(2, 1), (3, 16)])
def test_moe_ffn_picks_a_form_and_equals_the_reference_over_batch_shapes(shape):
    """Decode-sized steps take the gathered form, longer ones the grouped form; both equal the reference."""
    w = random_moe(16, seed=sum(shape))
    cfg = moe_cfg(16, 4)
    x = jax.random.normal(jax.random.key(1), (*shape, E))
    got = jax.jit(functools.partial(moe_ffn, cfg=cfg))(w, x=x)
    np.testing.assert_allclose(got, moe_ffn_dense(w, cfg, x), atol=2e-5, rtol=1e-5)


def test_f16_expert_weights_round_activations_like_the_reference():
    w32 = random_moe(8, seed=3)
    w = MoeFfn(**{**vars(w32), "gate": w32.gate.astype(jnp.float16), "up": w32.up.astype(jnp.float16),
                  "down": w32.down.astype(jnp.float16)})  # fmt: skip
    cfg = moe_cfg(8, 2)
    for n_tokens in (2, 24):
        x = jax.random.normal(jax.random.key(n_tokens), (n_tokens, E))
        np.testing.assert_allclose(moe_ffn(w, cfg, x), moe_ffn_dense(w, cfg, x), atol=1e-4, rtol=1e-4)

