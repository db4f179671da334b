"""Trainable parameters: the `Weights` pytree with its tied arrays left out, initialisation, and materialising.

The target ties its output head to the embedding, and the MTP block shares the target's embedding and head
(docs/model.md §3.4 fallbacks), so the trainable tree holds each shared array once: `Weights.output`, `Mtp.embed` and
`Mtp.head` are None in it, and `materialize` fills them in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodel.config import ModelConfig
from jaxmodel.weights import Attention, DenseFfn, GatedDeltaNet, Layer, Mtp, Weights

INIT_STD = 0.02


def _normal(rng: np.random.Generator, *shape: int, std: float = INIT_STD) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32) * std).astype(np.float32)


def _gdn(rng: np.random.Generator, cfg: ModelConfig, out_std: float) -> GatedDeltaNet:
    E, C, Hv, Dk, Kc = cfg.n_embd, cfg.conv_channels, cfg.ssm_heads, cfg.ssm_state, cfg.conv_kernel
    # Mamba-2's init: step sizes log-uniform in [1e-3, 1e-1] (dt_bias is their inverse softplus) and decay
    # rates A in [1, 16], so the heads start with memories from a few tokens to a few thousand.
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), Hv))
    return GatedDeltaNet(
        qkv=_normal(rng, E, C), gate=_normal(rng, E, Hv * Dk),
        conv=rng.uniform(-1, 1, (C, Kc)).astype(np.float32) / np.sqrt(Kc),
        dt_bias=(dt + np.log(-np.expm1(-dt))).astype(np.float32),
        a=-rng.uniform(1, 16, Hv).astype(np.float32),
        beta=_normal(rng, E, Hv), alpha=_normal(rng, E, Hv),
        norm=np.ones(Dk, np.float32), out=_normal(rng, Hv * Dk, E, std=out_std),
    )  # fmt: skip


def _attention(rng: np.random.Generator, cfg: ModelConfig, out_std: float) -> Attention:
    E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    return Attention(
        q=_normal(rng, E, 2 * H * D), k=_normal(rng, E, Hkv * D), v=_normal(rng, E, Hkv * D),
        o=_normal(rng, H * D, E, std=out_std), q_norm=np.ones(D, np.float32), k_norm=np.ones(D, np.float32),
    )  # fmt: skip


def _layer(rng: np.random.Generator, cfg: ModelConfig, recurrent: bool, out_std: float) -> Layer:
    E, F = cfg.n_embd, cfg.n_ff
    return Layer(
        attn_norm=np.ones(E, np.float32),
        post_norm=np.ones(E, np.float32),
        mixer=_gdn(rng, cfg, out_std) if recurrent else _attention(rng, cfg, out_std),
        ffn=DenseFfn(gate=_normal(rng, E, F), up=_normal(rng, E, F), down=_normal(rng, F, E, std=out_std)),
    )


def init_params(cfg: ModelConfig, seed: int) -> Weights:
    """Fresh trainable parameters (numpy float32): N(0, 0.02) matmuls, residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2), unit norms; tied output; an MTP block when cfg.n_mtp."""
    if cfg.is_moe:
        raise ValueError("training builds dense qwen35 models only")
    rng = np.random.default_rng(seed)
    E = cfg.n_embd
    out_std = INIT_STD / np.sqrt(2 * (cfg.n_layer + cfg.n_mtp))
    embed = _normal(rng, cfg.n_vocab, E)
    layers = tuple(_layer(rng, cfg, cfg.recurrent[i], out_std) for i in range(cfg.n_layer))
    mtp = None
    if cfg.n_mtp:
        mtp = Mtp(
            eh_proj=_normal(rng, 2 * E, E), enorm=np.ones(E, np.float32), hnorm=np.ones(E, np.float32),
            head_norm=np.ones(E, np.float32), embed=None, head=None, layer=_layer(rng, cfg, False, out_std),
        )  # fmt: skip
    return Weights(embed=embed, output_norm=np.ones(E, np.float32), output=None, layers=layers, mtp=mtp)


def materialize(params: Weights) -> Weights:
    """The full `Weights` the forward takes: output = embed^T, and the MTP block shares embed and head."""
    output = params.embed.T
    mtp = params.mtp
    if mtp is not None:
        mtp = dataclasses.replace(mtp, embed=params.embed, head=output)
    return dataclasses.replace(params, output=output, mtp=mtp)


def to_numpy(params: Weights) -> Weights:
    """Device arrays -> float32 numpy arrays, keeping the tie structure of `materialize` (shared objects), which
    is how `write_gguf` recognises tied tensors."""
    host = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    return materialize(host)


def count(params: Weights) -> int:
    """Number of trainable scalars."""
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def decay_mask(params: Weights) -> Weights:
    """True for the matrices weight decay applies to (matmuls and the embedding), False for norms, biases, the
    conv taps and the per-head decay parameters."""
    return jax.tree_util.tree_map(lambda x: jnp.ndim(x) >= 2 and x.shape[-1] > 16 and x.shape[0] > 16, params)
