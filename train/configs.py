"""The shapes of the bundled models and the training recipes that produce them."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmodel.config import ModelConfig

VOCAB_SIZE = 4096


def qwen35_config(
    *, n_embd: int, recurrent: tuple[bool, ...], n_mtp: int, n_head: int, n_head_kv: int, head_dim: int,
    ssm_state: int, ssm_groups: int, ssm_heads: int, n_ff: int, n_vocab: int = VOCAB_SIZE,
) -> ModelConfig:
    """A dense qwen35 config with Qwen3.5's conventions: a quarter of each head rotated, imrope sections in
    Qwen3.5's 11:11:10 proportions, theta 1e7, conv width 4."""
    rope_dim = head_dim // 4
    half = rope_dim // 2
    t, h = -(-half * 11 // 32), round(half * 11 / 32)
    sections = (t, h, half - t - h, 0)
    return ModelConfig(
        arch="qwen35", n_vocab=n_vocab, n_embd=n_embd, n_layer=len(recurrent), n_mtp=n_mtp, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, rope_dim=rope_dim, rope_theta=1e7, rope_sections=sections,
        norm_eps=1e-6, conv_kernel=4, ssm_state=ssm_state, ssm_groups=ssm_groups, ssm_heads=ssm_heads,
        recurrent=recurrent, context_length=4096, n_ff=n_ff,
    )  # fmt: skip


MODELS: dict[str, ModelConfig] = {
    # 6 layers, every third full attention; Hk=2 < Hv=4 key heads exercise the tiled broadcast; one MTP block.
    "target": qwen35_config(
        n_embd=192, recurrent=(True, True, False, True, True, False), n_mtp=1, n_head=4, n_head_kv=2,
        head_dim=32, ssm_state=32, ssm_groups=2, ssm_heads=4, n_ff=512,
    ),
    # The draft model: 3 layers, no MTP.
    "draft": qwen35_config(
        n_embd=192, recurrent=(True, True, False), n_mtp=0, n_head=4, n_head_kv=2, head_dim=32,
        ssm_state=32, ssm_groups=2, ssm_heads=4, n_ff=512,
    ),
    # For tests: seconds to train a few steps.
    "test": qwen35_config(
        n_embd=64, recurrent=(True, False), n_mtp=1, n_head=2, n_head_kv=1, head_dim=32,
        ssm_state=32, ssm_groups=1, ssm_heads=2, n_ff=128, n_vocab=512,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """How one model is trained: AdamW with linear warmup then cosine decay to lr * final_lr_fraction."""

    steps: int
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    mtp_weight: float = 0.5
    mtp_chain: int = 1
    eval_every: int = 100
    eval_windows: int = 32  # held-out windows evaluated during training
    final_eval_windows: int = 128  # and at the end
    seed: int = 0


RECIPES: dict[str, Recipe] = {
    "target": Recipe(steps=1000, warmup=50),
    "draft": Recipe(steps=1200, warmup=50),
    "test": Recipe(steps=4, batch=2, seq_len=32, warmup=1, eval_every=2, eval_windows=2, final_eval_windows=4),
}
