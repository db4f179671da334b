"""The bundled models: they load, share one tokenizer that round-trips text, and generate deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmodel import load_model
from jaxmodel.assets import default_draft_path, default_model_path
from jaxmodel.state import Row, pack_batch
from jaxmodel.tokenizer import load_tokenizer

ROUND_TRIP_TEXTS = [
    "import os\n\n\ndef main(argv=None):\n    for i, x in enumerate(argv or []):\n        print(f'{i}: {x!r}')\n",
    "\t\t  mixed\t whitespace   runs  \n\n\n",
    "naïve café, 日本語, emoji 🙂, Ελληνικά, combining e\u0301",
    "<|im_start|>system\nYou write Python.<|im_end|>\n",
    "",
]
GEN_WINDOW = 16  # one compiled shape for the generation test


@pytest.fixture(scope="module")
def target():
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def draft():
    return load_model(default_draft_path())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_shipped_files_are_small_qwen35_models(target, draft):
    for path in (default_model_path(), default_draft_path()):
        assert 1e6 < path.stat().st_size < 16e6
    assert target.cfg.arch == draft.cfg.arch == "qwen35"
    assert target.has_mtp and not draft.has_mtp
    assert 6 <= target.cfg.n_layer <= 8 and 2 <= draft.cfg.n_layer <= 3
    assert target.cfg.ssm_groups < target.cfg.ssm_heads  # tiled key heads
    assert target.cfg.n_vocab == draft.cfg.n_vocab


def test_target_and_draft_share_the_vocabulary(tokenizer):
    assert load_tokenizer(default_draft_path()).vocab == tokenizer.vocab
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_special_tokens_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert ids[-2:] == [tokenizer.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]


def _greedy(model, prompt: list[int], n_new: int) -> list[int]:
    """Greedy decoding by re-scoring the whole (fixed-width) window each step: one compiled shape."""
    tokens = list(prompt)
    for _ in range(n_new):
        n = len(tokens)
        row = Row(tokens, 0, [1], 0, [-1] * n, [n - 1])
        state = model.new_state(n_pages=2, n_planes=1, page_size=GEN_WINDOW)
        out, _ = model.step(model.weights, batch=pack_batch([row], T=GEN_WINDOW, P=1, R=1), state=state)
        tokens.append(int(np.argmax(np.asarray(out.logits[0, 0]))))
    return tokens[len(prompt) :]


def test_greedy_generation_is_deterministic_and_plausible(target, tokenizer):
    # Not "def ": names carry their leading space in this BPE ("Ġname"), so a prompt ending in a bare space
    # token is a boundary the model never saw before a name.
    prompt = tokenizer.encode("def main")
    first = _greedy(target, prompt, GEN_WINDOW - len(prompt))
    assert _greedy(target, prompt, GEN_WINDOW - len(prompt)) == first
    assert len(set(first)) >= 4, tokenizer.decode(first)  # not one token repeated
    text = tokenizer.decode(first)
    assert text.startswith("("), text  # Python syntax: the parameter list follows the name


def test_mtp_head_predicts_two_ahead_on_code(target, tokenizer):
    code = (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
    )
    ids = np.asarray(tokenizer.encode(code))
    logits, hidden = target.score(ids)
    mtp_logits, _ = target.score_mtp(ids, np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]]))
    mtp_hits = np.mean(np.argmax(mtp_logits[1:-1], -1) == ids[2:])
    lm_hits = np.mean(np.argmax(logits[:-1], -1) == ids[1:])
    assert lm_hits > 0.3 and mtp_hits > 0.3, (lm_hits, mtp_hits)  # random weights: ~1/4096
