"""Block-quantized weights kept as the file's bytes where no block kernel multiplies them: the accelerators' form
(`load_model(..., quantized=True)`, the default on GPU), run here on CPU without the kernels. Every product
dequantizes its weight inside the step and rounds it to the weight dtype, so it multiplies the values a copy made
at load would hold: the logits are those of the same file dequantized at load (up to XLA summing a product whose
weight it computes in another order), while the weights hold the file's bytes rather than a float copy."""

from __future__ import annotations

import jax
import numpy as np
from conftest import DATA
from gguf import GGMLQuantizationType as QT

from jaxmodel import load_model
from jaxmodel.gguf_io import write_gguf
from jaxmodel.model import BLOCK_KEPT, kept_block_types
from jaxmodel.quant_blocks import FORMATS
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.weights import BlockRows, Fused

FILE = DATA / "bundled-target-q4_k_m.gguf"  # Q4_K, Q6_K, Q5_0 and Q8_0 tensors


def _same_logits(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def _block_weights(weights) -> list[BlockRows]:
    leaves = jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, (BlockRows, Fused)))
    return [w for w in (leaf.w if isinstance(leaf, Fused) else leaf for leaf in leaves) if isinstance(w, BlockRows)]


def test_the_backend_picks_which_types_stay_blocks():
    assert kept_block_types("gpu", True, "bfloat16", None) == frozenset(FORMATS)
    assert kept_block_types("gpu", True, "bfloat16", False) == frozenset()
    assert kept_block_types("cpu", False, "float32", None) == frozenset()
    assert kept_block_types("cpu", False, "float32", True) == frozenset(FORMATS)
    assert kept_block_types("cpu", True, "bfloat16", None) == frozenset()  # the block kernels multiply float32
    assert BLOCK_KEPT <= frozenset(FORMATS)


def test_a_k_quant_file_keeps_its_bytes_and_its_logits():
    """Every quantized tensor of the Q4_K_M file stays blocks (Q8_0 ones too), the weights take at most 1.1x the
    file's bytes (a bf16 copy takes three times them), and prompt and decode logits equal those of the weights
    dequantized at load in the same dtype. (bf16, the accelerators' dtype: on CPU the block kernels take float32
    blocks.)"""
    weight_dtype = "bfloat16"
    kept = load_model(FILE, cpu_kernel=False, quantized=True, weight_dtype=weight_dtype)
    copied = load_model(FILE, cpu_kernel=False, quantized=False, weight_dtype=weight_dtype)
    blocks = _block_weights(kept.weights)
    assert {QT(w.qtype).name for w in blocks} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert {w.compute_dtype for w in blocks} == {weight_dtype}
    assert not _block_weights(copied.weights)
    assert kept.weights_bytes <= 1.1 * FILE.stat().st_size < copied.weights_bytes
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 4000, 21)]
    for prompt in (tokens, tokens[:1]):  # a prompt's step, then a one-token one
        got, _ = kept.score(prompt)
        want, _ = copied.score(prompt)
        _same_logits(got, want)


def test_quantized_experts_are_read_by_index(tmp_path):
    """A qwen35moe file's expert stacks stay blocks, each routed expert's dequantized alone (the gathered form of
    one-token steps and the grouped form of prompts), with the logits of the file dequantized at load."""
    cfg = PRESETS["qwen35moe-tiny"]
    path = tmp_path / "moe-q8_0.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=5), dtype="q8_0")
    kept = load_model(path, cpu_kernel=False, quantized=True, weight_dtype="bfloat16")
    copied = load_model(path, cpu_kernel=False, quantized=False, weight_dtype="bfloat16")
    experts = kept.weights.layers[0].ffn
    assert isinstance(experts.gate, BlockRows) and experts.gate.blocks.shape[0] == cfg.n_expert
    assert kept.weights_bytes < 0.6 * copied.weights_bytes
    for prompt in ([5, 99, 300, 7, 41, 12, 8, 600, 2], [77]):
        got, _ = kept.score(prompt)
        want, _ = copied.score(prompt)
        _same_logits(got, want)
