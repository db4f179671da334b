"""Random-weight qwen35 / qwen35moe / qwen3next models with real layer shapes, for benchmarks and tests
(`gdnspec make-random`)."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .weights import Attention, DenseFfn, GatedDeltaNet, Layer, MoeFfn, Mtp, Weights


def _every_fourth_attention(n_layer: int) -> tuple[bool, ...]:
    return tuple((i + 1) % 4 != 0 for i in range(n_layer))


def _moe_mini(arch: str, n_expert: int, n_used: int) -> ModelConfig:
    """Qwen3.5-35B-A3B's / Qwen3-Next-80B-A3B's attention and GDN head layout (H=16, Hkv=2, D=256, R=64,
    Hk=16, Hv=32, Dk=Dv=128) and expert routing, at a quarter of their width (E=512, experts and shared expert
    128 wide instead of 512), 4 trunk layers and the MTP layer, all MoE, V=32768: about 0.4 GB of float32
    weights per layer at 512 experts."""
    return ModelConfig(
        arch=arch, n_vocab=32768, n_embd=512, n_layer=4, n_mtp=1, n_head=16, n_head_kv=2, head_dim=256,
        rope_dim=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0) if arch == "qwen35moe" else None,
        norm_eps=1e-6, conv_kernel=4, ssm_state=128, ssm_groups=16, ssm_heads=32,
        recurrent=_every_fourth_attention(4), context_length=32768, n_expert=n_expert, n_expert_used=n_used,
        n_ff_expert=128, n_ff_shared=128,
    )  # fmt: skip


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
        ssm_groups=16, ssm_heads=16, recurrent=_every_fourth_attention(24), context_length=32768,
        n_ff=3584,
    ),
    # Qwen3.5-4B's layer shapes (32 layers, every 4th full attention; Hv = 2 Hk), with a smaller vocabulary.
    "qwen35-4b": ModelConfig(
        arch="qwen35", n_vocab=32768, n_embd=2560, n_layer=32, n_mtp=1, n_head=16, n_head_kv=4, head_dim=256,
        rope_dim=64, rope_theta=1e7, rope_sections=(11, 11, 10, 0), norm_eps=1e-6, conv_kernel=4, ssm_state=128,
        ssm_groups=16, ssm_heads=32, recurrent=_every_fourth_attention(32), context_length=32768,
        n_ff=9216,
    ),
    # The qwen3next parity fixture's shapes: value heads grouped by key head in the file, NEOX rope, MoE
    # (4 experts, 2 used, and a shared expert) in every layer, the MTP layer included.
    "qwen3next-tiny": ModelConfig(
        arch="qwen3next", n_vocab=512, n_embd=64, n_layer=4, n_mtp=1, n_head=4, n_head_kv=2, head_dim=32,
        rope_dim=8, rope_theta=1e7, rope_sections=None, norm_eps=1e-6, conv_kernel=4, ssm_state=16, ssm_groups=2,
        ssm_heads=4, recurrent=(True, True, True, False), context_length=4096, n_ff=128, n_expert=4,
        n_expert_used=2, n_ff_expert=32, n_ff_shared=64,
    ),
    # The qwen35moe parity fixture's head layout (Hv = 3 Hk, tiled) with 4 trunk layers.
    "qwen35moe-tiny": ModelConfig(
        arch="qwen35moe", n_vocab=640, n_embd=64, n_layer=4, n_mtp=1, n_head=6, n_head_kv=2, head_dim=64,
        rope_dim=16, rope_theta=1e7, rope_sections=(3, 3, 2, 0), norm_eps=1e-6, conv_kernel=4, ssm_state=16,
        ssm_groups=2, ssm_heads=6, recurrent=(True, True, True, False), context_length=4096, n_expert=8,
        n_expert_used=3, n_ff_expert=32, n_ff_shared=64,
    ),
    "qwen35moe-mini-64x4": _moe_mini("qwen35moe", 64, 4),
    "qwen35moe-mini-256x8": _moe_mini("qwen35moe", 256, 8),  # Qwen3.5-35B-A3B's routing
    "qwen3next-mini-512x10": _moe_mini("qwen3next", 512, 10),  # Qwen3-Next-80B-A3B's routing
}  # fmt: skip


def _normals(rng, scale: float, store) -> tuple:
    """normal(*shape): float32 Normal(0, scale); matrix(*shape): the same stored as `store` (the matmul weights
    and tables, which a file holds in its export type)."""
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)  # noqa: E731
    return normal, lambda *shape: normal(*shape).astype(store, copy=False)


def _attention(rng, cfg: ModelConfig, scale: float, store=np.float32) -> Attention:
    E, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    normal, matrix = _normals(rng, scale, store)
    return Attention(
        q=matrix(E, 2 * H * D), k=matrix(E, Hkv * D), v=matrix(E, Hkv * D), o=matrix(H * D, E),
        q_norm=1 + normal(D), k_norm=1 + normal(D),
    )  # fmt: skip


def _moe(rng, cfg: ModelConfig, scale: float, store=np.float32) -> MoeFfn:
    E, X, Fe, Fs = cfg.n_embd, cfg.n_expert, cfg.n_ff_expert, cfg.n_ff_shared
    normal, matrix = _normals(rng, scale, store)
    return MoeFfn(
        router=normal(E, X) * 50, gate=matrix(X, E, Fe), up=matrix(X, E, Fe), down=matrix(X, Fe, E),
        shared_router=normal(E), shared_gate=matrix(E, Fs), shared_up=matrix(E, Fs), shared_down=matrix(Fs, E),
    )  # fmt: skip


def _layer(rng, cfg: ModelConfig, recurrent: bool, scale: float, store=np.float32) -> Layer:
    E, C, Hv, Dk, F = cfg.n_embd, cfg.conv_channels, cfg.ssm_heads, cfg.ssm_state, cfg.n_ff
    normal, matrix = _normals(rng, scale, store)
    if recurrent:
        mixer = GatedDeltaNet(
            qkv=matrix(E, C), gate=matrix(E, Hv * Dk), conv=normal(C, cfg.conv_kernel) * 10,
            dt_bias=normal(Hv), a=-np.exp(rng.uniform(0, 2.7, Hv)).astype(np.float32),
            beta=matrix(E, Hv), alpha=matrix(E, Hv), norm=1 + normal(Dk), out=matrix(Hv * Dk, E),
        )  # fmt: skip
    else:
        mixer = _attention(rng, cfg, scale, store)
    return Layer(
        attn_norm=1 + normal(E),
        post_norm=1 + normal(E),
        mixer=mixer,
        ffn=(_moe(rng, cfg, scale, store) if cfg.is_moe
             else DenseFfn(gate=matrix(E, F), up=matrix(E, F), down=matrix(F, E))),
    )  # fmt: skip


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.02, store=np.float32) -> Weights:
    """Normal(0, scale) matmul weights (the router 50 times wider, so routing is far from uniform), norms near
    1, ssm_a = -exp(U(0, 2.7)); untied output; one MTP block when cfg.n_mtp; MoE in every layer when
    cfg.n_expert. store: the dtype of the matmul weights and tables (float16 halves what a float16 file of a
    large preset needs in memory while it is written; the file's bytes are the same)."""
    rng = np.random.default_rng(seed)
    E, V = cfg.n_embd, cfg.n_vocab
    normal, matrix = _normals(rng, scale, store)
    embed = matrix(V, E)
    output = matrix(E, V)
    output_norm = 1 + normal(E)
    layers = tuple(_layer(rng, cfg, cfg.recurrent[i], scale, store) for i in range(cfg.n_layer))
    mtp = None
    if cfg.n_mtp:
        mtp = Mtp(
            eh_proj=matrix(2 * E, E), enorm=1 + normal(E), hnorm=1 + normal(E), head_norm=output_norm,
            embed=embed, head=output, layer=_layer(rng, cfg, False, scale, store),
        )  # fmt: skip
    return Weights(embed=embed, output_norm=output_norm, output=output, layers=layers, mtp=mtp)
