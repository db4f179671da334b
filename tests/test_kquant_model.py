"""A K-quant file as users make them: the bundled target requantized by llama.cpp's `llama-quantize ... Q4_K_M`
(tests/data/bundled-target-q4_k_m.gguf; its rows of 192 and 128 inputs fall back to Q5_0 and Q8_0, the FFN's down
projections of 512 stay Q4_K / Q6_K). Its weights stay the file's blocks, its logits follow llama.cpp's on the same
file, and every drafter and rollback mode reproduces plain greedy decoding on it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import DATA, generate_all, plain_greedy
from gguf import GGMLQuantizationType as QT

from jaxmodel import load_model
from jaxmodel.assets import default_draft_path
from jaxmodel.kernels import cpu_matmul
from jaxmodel.requests import SpeculativeConfig
from jaxmodel.weights import BlockRows, Fused, Q8Rows
from scheduler import Engine, GenerationRequest

needs_kernel = pytest.mark.skipif(not cpu_matmul.block_kernels(), reason="the block products need AVX2 and g++")
FILE = DATA / "bundled-target-q4_k_m.gguf"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def target():
    return load_model(FILE)


def _kinds(weights) -> set:
    leaves = jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, (BlockRows, Q8Rows, Fused)))
    kinds = set()
    for leaf in leaves:
        w = leaf.w if isinstance(leaf, Fused) else leaf
        kinds.add(QT(w.qtype).name if isinstance(w, BlockRows) else type(w).__name__)
    return kinds


@needs_kernel
def test_weights_stay_the_files_blocks(target):
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8Rows"} <= _kinds(target.weights)
    block_bytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(target.weights) if x.dtype == np.uint8)
    assert block_bytes > 0.6 * FILE.stat().st_size  # the blocks themselves, not a float copy


@needs_kernel
def test_logits_follow_llama_cpp_on_the_same_file(target):
    """llama.cpp's batch logits on the same file (tests/data/bundled-target-q4_k_m.npz, one thread, F32 KV cache):
    the first token's agree to 1e-5, every token's within 0.15 of values up to 14, the same argmax throughout.
    (llama.cpp repacks the K-quant weights into eight-row groups and sums their blocks in another order.)"""
    ref = np.load(DATA / "bundled-target-q4_k_m.npz")
    logits, _ = target.score([int(t) for t in ref["tokens"]])
    np.testing.assert_allclose(logits[0], ref["A"][0], atol=1e-5, rtol=0)
    assert np.abs(logits - ref["A"]).max() < 0.15
    np.testing.assert_array_equal(logits.argmax(-1), ref["A"].argmax(-1))


@needs_kernel
def test_every_drafter_and_rollback_mode_is_lossless(target):
    """Twelve sequences at once, each drafter (n-gram, MTP, the draft model, a mix) in each forced rollback mode:
    every sequence's tokens equal its plain greedy decode alone."""
    draft = load_model(default_draft_path(), load_mtp=False)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(3, 4000, n)) for n in (5, 19, 33)] + [tuple([17, 18, 19] * 6)]
    references = {p: plain_greedy(target, p, MAX_TOKENS) for p in prompts}
    drafter_sets = [None, ("ngram",), ("mtp",), ("draft_model",), ("ngram", "mtp")]
    modes = ["snapshot", "checkpoint", "replay"]
    jobs = []
    for i in range(12):
        drafters = drafter_sets[i % len(drafter_sets)]
        spec = SpeculativeConfig(drafters, n_max=3, rollback=modes[i % 3]) if drafters else None
        jobs.append((prompts[i % len(prompts)], GenerationRequest(prompts[i % len(prompts)], MAX_TOKENS,
                                                                  speculative=spec)))
    # One batch size compiled (steps of fewer rows pad to it): the point is the drafters, not the shapes.
    engine = Engine(target, draft_model=draft, adaptive=False, budget_bytes=16 << 20, max_running=6,
                    row_buckets=(8,), max_model_len=64, chunk_size=16, token_budget=48, n_max=3)
    results = generate_all(engine, [request for _, request in jobs])
    for (prompt, request), tokens in zip(jobs, results):
        assert tokens == references[prompt], request.speculative
