"""ModelConfig: the static shape of a qwen35 / qwen35moe / qwen3next model, read from GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

SUPPORTED_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
MOE_ARCHS = ("qwen35moe", "qwen3next")


class ModelFormatError(ValueError):
    """A GGUF file that cannot be loaded: names the file, the item and what was expected."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int  # E
    n_layer: int  # trunk layers L (MTP blocks excluded)
    n_mtp: int  # MTP ("nextn") blocks after the trunk; 0 or 1
    n_head: int  # H
    n_head_kv: int  # Hkv
    head_dim: int  # D
    rope_dim: int  # R, rotated dims per head
    rope_theta: float
    rope_sections: tuple[int, int, int, int] | None  # imrope sections; None: plain NEOX rope (qwen3next)
    norm_eps: float
    conv_kernel: int  # Kc
    ssm_state: int  # Dk (= Dv)
    ssm_groups: int  # Hk
    ssm_heads: int  # Hv
    recurrent: tuple[bool, ...]  # per trunk layer: GDN (True) or full attention (False)
    context_length: int
    n_ff: int = 0  # dense SwiGLU width (qwen35)
    n_expert: int = 0  # qwen35moe, qwen3next
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shared: int = 0
    # A `jaxmodel.sharding.TensorParallel` where the model is split over devices (`Model.sharded`); its blocks then
    # run per shard under its local config. None: one device.
    tensor_parallel: object = None

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def grouped_value_heads(self) -> bool:
        """qwen3next files keep GDN value heads grouped by key head (head g*r+i uses key head g); qwen35 files
        store them tiled (head h uses key head h % Hk). The loader permutes grouped heads to tiled order."""
        return self.arch == "qwen3next"

    @property
    def conv_channels(self) -> int:  # C = 2 Hk Dk + Hv Dv
        return 2 * self.ssm_groups * self.ssm_state + self.ssm_heads * self.ssm_state

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if r)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if not r)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def rope_position_mask(self) -> np.ndarray:
        """[R/2] float32: 1 for frequency slots rotated by the text position, 0 for slots imrope leaves at 0.

        For text tokens imrope's t/h/w streams all carry the position and the `e` stream carries 0;
        slot i belongs to sector s = i mod sum(sections). Plain NEOX rope rotates every slot.
        """
        if self.rope_sections is None:
            return np.ones(self.rope_dim // 2, np.float32)
        sect = self.rope_sections
        total = sum(sect)
        mask = np.zeros(self.rope_dim // 2, np.float32)
        for i in range(self.rope_dim // 2):
            s = i % total if total else 0
            if (s % 3 == 0 and s < 3 * sect[0]) or (s % 3 == 1 and s < 3 * sect[1]) or (s % 3 == 2 and s < 3 * sect[2]):
                mask[i] = 1.0
        return mask


def _field(reader, key: str, path: str, default=None, required: bool = False):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ModelFormatError(f"{path}: missing metadata key '{key}'")
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFormatError(f"{path}: metadata '{key}' cannot be read ({exc})") from None


def _scalar(value, key: str, path: str) -> int:
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelFormatError(f"{path}: '{key}' varies per layer ({value}); only uniform values are supported")
        return value[0]
    return value


def _count(value, key: str, path: str, minimum: int = 1) -> int:
    """An integer metadata value of at least `minimum` (a head or group count of 0 would divide by zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ModelFormatError(f"{path}: '{key}' is {value!r}, not an integer")
    if value < minimum:
        raise ModelFormatError(f"{path}: '{key}' is {value}; it must be at least {minimum}")
    return int(value)


def _number(value, key: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not np.isfinite(value):
        raise ModelFormatError(f"{path}: '{key}' is {value!r}, not a finite number")
    return float(value)


def from_gguf(reader, path: str = "<gguf>") -> ModelConfig:
    """Build the config from a `gguf.GGUFReader`'s metadata; raises ModelFormatError naming what is wrong."""
    arch = _field(reader, "general.architecture", path, required=True)
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(f"{path}: unsupported architecture '{arch}' (expected one of {', '.join(SUPPORTED_ARCHS)})")

    def get(key, default=None, required=False):
        return _field(reader, f"{arch}.{key}", path, default, required)

    def count(key, default=None, required=False, minimum=1):
        return _count(_scalar(get(key, default, required), f"{arch}.{key}", path), f"{arch}.{key}", path, minimum)

    n_embd = count("embedding_length", required=True)
    block_count = count("block_count", required=True)
    n_mtp = count("nextn_predict_layers", 0, minimum=0)
    n_layer = block_count - n_mtp
    if n_layer < 1:
        raise ModelFormatError(f"{path}: '{arch}.block_count' {block_count} leaves no layer beside {n_mtp} MTP blocks")
    n_head = count("attention.head_count", required=True)
    n_head_kv = count("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelFormatError(f"{path}: '{arch}.attention.head_count' {n_head} is not a multiple of "
                               f"'{arch}.attention.head_count_kv' {n_head_kv}")
    head_dim = count("attention.key_length", n_embd // n_head)
    value_dim = count("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelFormatError(f"{path}: attention key_length {head_dim} != value_length {value_dim}")
    if arch == "qwen3next":
        sections = None  # NEOX rope over the first R dims; a sections key, if any, is not used
    else:
        sections = get("rope.dimension_sections", required=True)
        sections = [sections] * 4 if isinstance(sections, int) else sections
        if not isinstance(sections, list) or len(sections) != 4:
            raise ModelFormatError(f"{path}: rope.dimension_sections must have 4 entries, got {sections!r}")
        sections = [_count(x, f"{arch}.rope.dimension_sections", path, minimum=0) for x in sections]
    rope_dim = count("rope.dimension_count", head_dim)
    if rope_dim > head_dim:
        raise ModelFormatError(f"{path}: '{arch}.rope.dimension_count' {rope_dim} exceeds the head size {head_dim}")
    ssm_heads = count("ssm.time_step_rank", required=True)
    ssm_state = count("ssm.state_size", required=True)
    inner = count("ssm.inner_size", required=True)
    if inner != ssm_heads * ssm_state:
        raise ModelFormatError(f"{path}: ssm.inner_size {inner} != time_step_rank {ssm_heads} x state_size {ssm_state}")
    ssm_groups = count("ssm.group_count", required=True)
    if ssm_heads % ssm_groups:
        raise ModelFormatError(f"{path}: ssm.time_step_rank {ssm_heads} is not a multiple of ssm.group_count {ssm_groups}")

    layer_kinds = get("attention.recurrent_layers")
    if layer_kinds is not None:
        if not isinstance(layer_kinds, list):
            raise ModelFormatError(f"{path}: attention.recurrent_layers is {layer_kinds!r}, not a list")
        recurrent = tuple(bool(x) for x in list(layer_kinds)[:n_layer])
        if len(recurrent) != n_layer:
            raise ModelFormatError(f"{path}: attention.recurrent_layers has {len(layer_kinds)} entries, expected {block_count}")
    else:
        interval = count("full_attention_interval", 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))

    tokens = _field(reader, "tokenizer.ggml.tokens", path)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if tokens is not None else 0
    n_expert = count("expert_count", 0, minimum=0)
    n_expert_used = count("expert_used_count", 0, minimum=0)
    n_ff = count("feed_forward_length", 0, minimum=0)
    if arch in MOE_ARCHS and n_expert == 0:
        raise ModelFormatError(f"{path}: {arch} needs '{arch}.expert_count' > 0")
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ModelFormatError(f"{path}: '{arch}.expert_used_count' is {n_expert_used}, expected 1..{n_expert}")
    cfg = ModelConfig(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_mtp=n_mtp,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rope_dim=rope_dim,
        rope_theta=_number(get("rope.freq_base", 10000.0), f"{arch}.rope.freq_base", path),
        rope_sections=None if sections is None else tuple(sections),
        norm_eps=_number(get("attention.layer_norm_rms_epsilon", required=True),
                         f"{arch}.attention.layer_norm_rms_epsilon", path),
        conv_kernel=count("ssm.conv_kernel", required=True),
        ssm_state=ssm_state,
        ssm_groups=ssm_groups,
        ssm_heads=ssm_heads,
        recurrent=recurrent,
        context_length=count("context_length", required=True),
        n_ff=n_ff,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_expert=count("expert_feed_forward_length", n_ff // max(n_expert_used, 1)) if n_expert else 0,
        n_ff_shared=count("expert_shared_feed_forward_length", n_ff, minimum=0) if n_expert else 0,
    )
    if n_mtp > 1:
        raise ModelFormatError(f"{path}: {n_mtp} MTP blocks; exactly 0 or 1 is supported")
    return cfg
