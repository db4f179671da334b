"""The exporter round-trips a model trained in memory, and the GGUF's tokenizer is the trained tokenizer.

The training run here is a few plain gradient steps on the project's own losses (no optax: tests do not need it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel import load_model
from jaxmodel.tokenizer import load_tokenizer
from train.configs import MODELS
from train.data import load_corpus, sample_windows, token_stream
from train.export import export_model
from train.objective import mtp_sequence_forward, sequence_forward, shifted_hidden, total_loss
from train.params import init_params, materialize
from train.tokenizer import ENDOFTEXT, encode_batch, train_tokenizer

VARIED_TEXTS = [
    "def f(x):\n    return {'a': [1, 2, 3]}[x]  # comment\n",
    "class A(B, metaclass=M):\n\tpass\n\n\n\n",
    "    \n  \t \r\n\r\n      x = 1\n" + " " * 17 + "y",
    "naïve café — déjà vu, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, עברית, ज़ि",
    "It's we'll I'd they're YOU'VE 'quoted' don't",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<|endoftext|><|endoftext|>",
    "12345678901234567890 3.14159e-10 0xDEADbeef",
    "",
    "\u0301combining\u0308 marks\u200b zero width",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A BPE trained on a few stdlib files, then a few gradient steps of the `test` config on their tokens."""
    files = load_corpus().train[:40]
    cfg = MODELS["test"]
    tokenizer = train_tokenizer((f.text for f in files), cfg.n_vocab)
    stream = token_stream(files, functools.partial(encode_batch, tokenizer), tokenizer.token_to_id(ENDOFTEXT))
    batch = jnp.asarray(sample_windows(stream, np.random.default_rng(0), 2, 32))
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: total_loss(p, cfg, batch, mtp_weight=0.5)[0]))
    params = jax.tree_util.tree_map(jnp.asarray, init_params(cfg, seed=0))
    losses = []
    for _ in range(4):
        loss, grads = loss_and_grad(params)
        losses.append(float(loss))
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
    path = tmp_path_factory.mktemp("export") / "model-f32.gguf"
    export_model(path, cfg, params, tokenizer, "f32", name="test")
    return cfg, params, tokenizer, path, losses, stream


def test_gradient_steps_lower_the_loss(trained):
    *_, losses, _ = trained
    assert losses[-1] < losses[0] - 0.1, losses


def test_export_load_gives_the_trained_logits(trained):
    cfg, params, _, path, _, stream = trained
    tokens = np.asarray(stream[100:132])[None]  # [1, 32]
    weights = materialize(params)
    logits, hidden = sequence_forward(weights, cfg, jnp.asarray(tokens))
    mtp_logits, mtp_hidden = mtp_sequence_forward(weights, cfg, jnp.asarray(tokens), shifted_hidden(hidden))

    model = load_model(path)
    assert model.cfg.norm_eps == pytest.approx(cfg.norm_eps)  # stored as float32
    assert model.cfg.replace(norm_eps=cfg.norm_eps) == cfg
    got_logits, got_hidden = model.score(tokens[0])
    np.testing.assert_allclose(got_logits, logits[0], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(got_hidden, hidden[0], atol=2e-4, rtol=1e-4)
    got_mtp, _ = model.score_mtp(tokens[0], np.asarray(shifted_hidden(hidden))[0])
    np.testing.assert_allclose(got_mtp, mtp_logits[0], atol=2e-4, rtol=1e-4)


def test_quantised_export_stays_close(trained, tmp_path):
    cfg, params, tokenizer, _, _, stream = trained
    path = tmp_path / "model-q8_0.gguf"
    export_model(path, cfg, params, tokenizer, "q8_0", name="test")
    tokens = np.asarray(stream[100:132])
    exact, _ = sequence_forward(materialize(params), cfg, jnp.asarray(tokens)[None])
    got, _ = load_model(path).score(tokens)
    probs, got_probs = jax.nn.softmax(exact[0], -1), jax.nn.softmax(got, -1)
    assert float(jnp.max(jnp.abs(probs - got_probs))) < 0.02


def test_gguf_tokenizer_matches_the_trained_tokenizer(trained):
    _, _, tokenizer, path, _, _ = trained
    rebuilt = load_tokenizer(path)
    texts = VARIED_TEXTS + [f.text[:3000] for f in load_corpus().held_out[:5]]
    for text in texts:
        want = tokenizer.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text) == want, text
        assert rebuilt.decode(want) == tokenizer.decode(want, skip_special_tokens=False)
    assert rebuilt.vocab_size == tokenizer.get_vocab_size() == 512
    special = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert special == [509, 510, 511]
    assert {509, 511} <= rebuilt.eog_ids
