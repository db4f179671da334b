"""The model-based drafters against direct computations with the same models."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DATA, plain_greedy

from drafters.base import DraftRequest
from drafters.draft_model import DraftModelDrafter, check_same_vocab
from drafters.mtp import MtpDrafter
from jaxmodel import load_model
from jaxmodel.state import Row
from scheduler.runner import Runner, VerifyRow


@pytest.fixture(scope="module")
def target():
    return load_model(DATA / "tiny-qwen35-mtp.gguf")


def test_mtp_drafts_follow_the_mtp_chain(target):
    """Catch-up with the target's hidden states, then chaining on the MTP's own hidden state (SPEC §6.2)."""
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 509, 20)]
    runner = Runner(target, n_pages=4, n_planes=3)
    pages = [1, 2]
    drafter = MtpDrafter(runner, lambda seq_id: pages)
    # The target computes tokens[:-1]; tokens[-1] is `last`, not yet computed.
    out = runner.step([VerifyRow(Row(tokens[:-1], 0, pages, 0, [-1] * 18 + [1], range(19)))])[0]
    drafter.record("s", 0, out.hidden)
    draft = drafter.propose([DraftRequest("s", tokens, n_max=3)])[0].tokens

    _, hidden = target.score(tokens[:-1])
    pairs_hidden = np.concatenate([np.zeros_like(hidden[:1]), hidden])  # h_{t-1} for t = 0..n
    expected, chain_tokens, chain_hidden = [], list(tokens), pairs_hidden
    for _ in range(3):
        logits, mtp_hidden = target.score_mtp(chain_tokens, chain_hidden)
        expected.append(int(logits[-1].argmax()))
        chain_tokens = chain_tokens + [expected[-1]]
        chain_hidden = np.concatenate([chain_hidden, mtp_hidden[-1:]])
    assert draft == expected


def test_draft_model_drafts_its_greedy_continuation_across_rollbacks(target):
    draft_model = load_model(DATA / "tiny-qwen35-f16.gguf", load_mtp=False)
    drafter = DraftModelDrafter(draft_model, max_seqs=2, max_context=64, n_max=4)
    rng = np.random.default_rng(5)
    context = [int(t) for t in rng.integers(0, 509, 9)]
    for accepted in (4, 0, 2, 1):
        draft = drafter.propose([DraftRequest("s", context, n_max=4)])[0].tokens
        assert draft == plain_greedy(draft_model, context, 4)
        bonus = int(rng.integers(0, 509))
        committed = draft[:accepted] + [bonus]
        drafter.observe("s", accepted, committed)
        context = context + committed
    drafter.release("s")
    assert len(drafter.free_slots) == 2


def test_draft_model_vocabulary_is_checked(tmp_path):
    check_same_vocab(str(DATA / "tiny-qwen35-mtp.gguf"), str(DATA / "tiny-qwen35-f16.gguf"))
    with pytest.raises(ValueError, match=r"different vocabulary .* \(640 vs 512 tokens"):
        check_same_vocab(str(DATA / "tiny-qwen35-mtp.gguf"), str(DATA / "tiny-qwen35moe.gguf"))
