"""Random-weight qwen35 models with real layer shapes, for benchmarks and tests (`gdnspec make-random`)."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .weights import Attention, DenseFfn, GatedDeltaNet, Layer, Mtp, Weights

PRESETS: dict[str, ModelConfig] = {
    # The parity fixtures' shapes.
    "tiny": ModelConfig(
        arch="qwen35", n_vocab=512, n_embd=64, n_layer=4, n_mtp=1, n_head=4, n_head_kv=2, head_dim=32, rope_dim=8,
        rope_theta=1e7, rope_sections=(2, 1, 1, 0), norm_eps=1e-6, conv_kernel=4, ssm_state=16, ssm_groups=2,
        ssm_heads=4, recurrent=(True, True, True, False), context_length=4096, n_ff=128,
    ),
    # Qwen3.5-0.8B's layer shapes (24 layers, every 4th full attention), with a smaller vocabulary.
    "qwen35-0.8b": ModelConfig(
        arch="qwen35", n_vocab=32768, n_embd=1024, n_layer=24, n_mtp=1, n_head=8, n_head_kv=2, head_dim=256,
        rope_dim=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0), norm_eps=1e-6, conv_kernel=4, ssm_state=128,
        ssm_groups=16, ssm_heads=16, recurrent=tuple((i + 1) % 4 != 0 for i in range(24)), context_length=32768,
        n_ff=3584,
    ),
}  # fmt: skip


def _attention(rng, cfg: ModelConfig, scale: float) -> Attention:
    E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)
    return Attention(
        q=normal(E, 2 * H * D), k=normal(E, Hkv * D), v=normal(E, Hkv * D), o=normal(H * D, E),
        q_norm=1 + normal(D), k_norm=1 + normal(D),
    )  # fmt: skip


def _layer(rng, cfg: ModelConfig, recurrent: bool, scale: float) -> Layer:
    E, C, Hv, Dk, F = cfg.n_embd, cfg.conv_channels, cfg.ssm_heads, cfg.ssm_state, cfg.n_ff
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)
    if recurrent:
        mixer = GatedDeltaNet(
            qkv=normal(E, C), gate=normal(E, Hv * Dk), conv=normal(C, cfg.conv_kernel) * 10,
            dt_bias=normal(Hv), a=-np.exp(rng.uniform(0, 2.7, Hv)).astype(np.float32),
            beta=normal(E, Hv), alpha=normal(E, Hv), norm=1 + normal(Dk), out=normal(Hv * Dk, E),
        )  # fmt: skip
    else:
        mixer = _attention(rng, cfg, scale)
    return Layer(
        attn_norm=1 + normal(E),
        post_norm=1 + normal(E),
        mixer=mixer,
        ffn=DenseFfn(gate=normal(E, F), up=normal(E, F), down=normal(F, E)),
    )


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> Weights:
    """Normal(0, scale) matmul weights, norms near 1, ssm_a = -exp(U(0, 2.7)); untied output; one MTP block
    when cfg.n_mtp. Dense qwen35 only."""
    if cfg.is_moe:
        raise ValueError("random_weights builds dense qwen35 models only")
    rng = np.random.default_rng(seed)
    E, V = cfg.n_embd, cfg.n_vocab
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)
    embed = normal(V, E)
    output = normal(E, V)
    output_norm = 1 + normal(E)
    layers = tuple(_layer(rng, cfg, cfg.recurrent[i], scale) for i in range(cfg.n_layer))
    mtp = None
    if cfg.n_mtp:
        mtp = Mtp(
            eh_proj=normal(2 * E, E), enorm=1 + normal(E), hnorm=1 + normal(E), head_norm=output_norm,
            embed=embed, head=output, layer=_layer(rng, cfg, False, scale),
        )  # fmt: skip
    return Weights(embed=embed, output_norm=output_norm, output=output, layers=layers, mtp=mtp)
