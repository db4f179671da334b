"""`gdnspec bench peer`: llama.cpp (the optional `[peer]` extra) agrees with our model on the bundled target,
and without llama_cpp the command fails with the install hint.

The agreement test needs llama-cpp-python with a loadable libllama (skipped otherwise, as in CI)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from bench.prompts import CODE


def _llama_cpp_or_skip():
    try:
        import llama_cpp.llama_cpp  # noqa: F401  (loads libllama)
    except ImportError:
        pytest.skip("llama_cpp (the [peer] extra) is not installed")
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"llama_cpp is installed but libllama did not load: {exc}")


def test_peer_greedy_tokens_equal_ours_on_the_bundled_model():
    _llama_cpp_or_skip()
    from bench.peer import LlamaCpp
    from jaxmodel import load_model
    from jaxmodel.assets import default_model_path
    from jaxmodel.tokenizer import load_tokenizer

    path, prompt, n_new = default_model_path(), CODE[0], 16
    with LlamaCpp(path, threads=2, n_ctx=256) as peer:
        prompt_ids = peer.tokenize(prompt)
        theirs = peer.greedy(prompt_ids, n_new, stop_at_eog=False)["tokens"]
    assert len(theirs) == n_new
    assert load_tokenizer(path).encode(prompt) == prompt_ids
    # One rescoring of llama.cpp's sequence: where our argmax agrees at every position, our greedy decoding
    # reproduces the same tokens (by induction over positions).
    logits, _ = load_model(path).score(prompt_ids + theirs[:-1])
    ours = np.argmax(logits[len(prompt_ids) - 1 :], axis=-1).tolist()
    assert ours == theirs


def test_bench_peer_without_llama_cpp_fails_with_the_install_hint(monkeypatch):
    """Runs whether or not llama_cpp is installed: an import of it is made to fail."""
    from api.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", None)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "peer", "--max-tokens", "4"])
    message = str(exc.value)
    assert "pip install -e '.[peer]'" in message
    assert "LLAMA_CPP_LIB_PATH" in message


@pytest.mark.parametrize("preset", ["qwen3next-tiny", "qwen35moe-tiny"])
def test_llama_cpp_loads_our_moe_presets_and_computes_our_logits(tmp_path, preset):
    """`make-random` qwen3next / qwen35moe files (value heads regrouped and ssm_ba fused for qwen3next) are read
    by llama.cpp as we read them: its logits (F16 KV cache by default) equal ours on every position."""
    _llama_cpp_or_skip()
    from bench.peer import LlamaCpp
    from jaxmodel import load_model
    from jaxmodel.gguf_io import write_gguf
    from jaxmodel.random_model import PRESETS, random_weights

    cfg = PRESETS[preset]
    path = tmp_path / f"{preset}.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=1), name=preset)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, cfg.n_vocab - 3, 20)]
    ours, _ = load_model(path).score(tokens)
    with LlamaCpp(path, threads=2, n_ctx=64) as peer:
        peer.decode(tokens, 0, all_logits=True)
        theirs = np.stack([peer.logits(i).copy() for i in range(len(tokens))])
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_bench_peer_times_our_engine_against_llama_cpp_in_alternating_rounds(tmp_path):
    """`--ours-rounds`: llama.cpp's greedy decode and our engine's, round by round, on the same prompt ids; our
    plain and n-gram tokens equal llama.cpp's on a prompt where our argmax agrees with it at every position."""
    _llama_cpp_or_skip()
    from bench.peer import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(CODE[0])
    out = tmp_path / "peer.json"
    results = main(["--prompts", str(prompts), "--max-tokens", "16", "--threads", "1", "--verify-t", "1",
                    "--steps", "1", "--ours-rounds", "2", "--ours-drafters", "plain;ngram", "--out", str(out)])
    interleaved = results["interleaved"]
    assert len(interleaved["llama_cpp_tokens_per_s"]) == 2
    for policy in ("plain", "ngram"):
        ours = interleaved["ours"][policy]
        assert len(ours["tokens_per_s"]) == 2 and ours["ratio_to_llama_cpp_paired"] > 0
        assert ours["prompts_equal_to_llama_cpp"] == [1, 1]
    assert out.exists()
