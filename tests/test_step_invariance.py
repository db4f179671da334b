"""A token's state and hidden are the same bits whether its step feeds 1, 4 or 8 tokens, so greedy speculative
decoding (verify steps of 1 + n tokens) reproduces plain decoding (one token per step) exactly. It matters most
where activations are quantized to Q8_0 (llama.cpp's CPU arithmetic, `linear` on Q8_0 weights): there a last-bit
difference can flip a rounding and change a token many steps later (seen on the 0.8B shape with random weights,
where a T = 1 and a T = 4 step's logits came 0.05 apart). The model below has Qwen3.5-0.8B's head shapes (GDN
Hv = 16, Dk = Dv = 128; attention H = 8, Hkv = 2, D = 256) in two layers."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodel.attention import attend
from jaxmodel.gguf_io import write_gguf
from jaxmodel.kernels import cpu_matmul
from jaxmodel.model import Record, load_model, rebuild
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.state import Row, bucket, pack_batch

N_TOKENS = 24
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not cpu_matmul.available():
        pytest.skip("the Q8_0 product needs the CPU backend and g++")
    cfg = dataclasses.replace(PRESETS["qwen35-0.8b"], n_vocab=512, n_embd=256, n_layer=2, n_mtp=0, n_ff=512,
                              recurrent=(True, False))  # fmt: skip
    path = tmp_path_factory.mktemp("q8") / "heads-0.8b-q8_0.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=3, scale=0.05), dtype="q8_0")
    return load_model(path)


def _fed_in_steps(model, tokens: list[int], T: int):
    """Feed `tokens` T at a time, every token's state written to a plane of its own, as verify steps do: returns
    the hidden [N, E], each token's SSM state [N, Hv, Dk, Dv] and conv state, and the attention layer's K pages."""
    pages = list(range(1, bucket(-(-len(tokens) // PAGE_SIZE)) + 1))
    state = model.new_state(n_pages=len(pages) + 1, n_planes=2 + T, page_size=PAGE_SIZE)
    hidden, ssm, conv, read = [], [], [], 0
    for start in range(0, len(tokens), T):
        part = tokens[start : start + T]
        writes = [2 + i if read != 2 + i else 1 for i in range(len(part))]
        batch = pack_batch([Row(part, start, pages, read, writes, range(len(part)))])
        out, state = model.step(model.weights, batch=batch, state=state)
        hidden.append(np.asarray(out.hidden[0, : len(part)]))
        ssm += [np.asarray(state.ssm[0][w]) for w in writes]
        conv += [np.asarray(state.conv[0][w]) for w in writes]
        read = writes[-1]
    return np.concatenate(hidden), np.stack(ssm), np.stack(conv), np.asarray(state.k_pages[0])


def test_a_tokens_state_and_hidden_do_not_depend_on_its_steps_length(model):
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, model.cfg.n_vocab, N_TOKENS)]
    one = _fed_in_steps(model, tokens, 1)
    for T in (4, 8):
        for name, got, want in zip(("hidden", "ssm", "conv", "k_pages"), _fed_in_steps(model, tokens, T), one):
            np.testing.assert_array_equal(got, want, err_msg=f"{name}, steps of {T} tokens against steps of 1")


def test_logit_rows_past_a_rows_tokens_are_padding_the_head_skips(model):
    """A later iteration feeding fewer drafts than its width asks for logits at tokens past the row's own: the
    output head's product skips those rows (they come back 0), and the real rows' logits are the bits they are
    when nothing is padded."""
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, model.cfg.n_vocab, 6)]
    pages = [1]

    def logits(n_fed: int, rows: list[int]):
        state = model.new_state(n_pages=2, n_planes=2 + 8, page_size=PAGE_SIZE)
        batch = pack_batch([Row(tokens[:n_fed], 0, pages, 0, [2 + i for i in range(n_fed)], rows)], T=8, R=4)
        batch = dataclasses.replace(batch, logit_rows=jnp.asarray([rows + [0] * (4 - len(rows))], jnp.int32))
        out, _ = model.step(model.weights, batch=batch, state=state)
        return np.asarray(out.logits[0])

    real = logits(2, [0, 1])
    padded = logits(2, [0, 1, 2, 3])  # a width of 4 feeding 2 tokens
    np.testing.assert_array_equal(padded[:2], real[:2])
    np.testing.assert_array_equal(padded[2:], 0.0)
    assert np.all(np.abs(logits(4, [0, 1, 2, 3])[2:]) > 0)  # the same rows live when the row has their tokens


@pytest.mark.parametrize("n", [2, 3, 4])
def test_replays_rebuilt_state_is_the_state_decoding_computes(model, n):
    """Replay rollback (docs/design.md "Rollback") rebuilds a row's state from the inputs a verify step recorded:
    for every number of kept tokens (none included) and every replay width (`replay_tokens`: XLA's batched conv
    sums the taps of one row of two tokens in another order than decoding's), its GDN state and conv planes are
    the bits that decoding one token per step writes, or a replayed sequence would go on from another state than
    a plain one."""
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, model.cfg.n_vocab, 8 + n)]
    _, ssm_one, conv_one, _ = _fed_in_steps(model, tokens, 1)
    start = 8
    pages = [1]
    state = model.new_state(n_pages=2, n_planes=4, page_size=PAGE_SIZE, replay_slots=1, replay_tokens=n)
    prefix = pack_batch([Row(tokens[:start], 0, pages, 0, [-1] * (start - 1) + [1], [start - 1])])
    _, state = model.step(model.weights, batch=prefix, state=state)  # plane 1: the state after token start-1
    verify = pack_batch([Row(tokens[start:], start, pages, 1, [-1] * n, range(n))])
    record = Record(slot=jnp.zeros((1,), jnp.int32), first=jnp.zeros((1,), jnp.int32))
    _, state = model.step(model.weights, batch=verify, state=state, record=record)
    for n_keep in range(n + 1):  # 0: the source state itself
        state = rebuild(model.weights, model.cfg, state, source=jnp.asarray([1]), target=jnp.asarray([2]),
                        slot=jnp.asarray([0]), n_keep=jnp.asarray([n_keep]),
                        hidden=jnp.zeros((1, model.cfg.n_embd), jnp.float32))  # fmt: skip
        token = start + n_keep - 1
        np.testing.assert_array_equal(np.asarray(state.ssm[0][2]), ssm_one[token], err_msg=f"ssm, {n_keep} kept")
        np.testing.assert_array_equal(np.asarray(state.conv[0][2]), conv_one[token], err_msg=f"conv, {n_keep} kept")


@pytest.mark.parametrize("impl", ["reference", "blocked", "cpu"])
def test_a_querys_attention_does_not_depend_on_its_steps_length(impl):
    """attend over pages for the last query of a step of 1 and of 8 tokens: the same bits, in the full-table form,
    the blocked loop (a table wider than one block) and the CPU kernel."""
    if impl == "cpu" and not cpu_matmul.available():
        pytest.skip("the CPU kernel needs the CPU backend and g++")
    rng = np.random.default_rng(1)
    B, H, Hkv, D, n_pages = 1, 8, 2, 256, 12
    k_pages = jnp.asarray(rng.standard_normal((n_pages + 1, PAGE_SIZE, Hkv, D), np.float32))
    v_pages = jnp.asarray(rng.standard_normal((n_pages + 1, PAGE_SIZE, Hkv, D), np.float32))
    q = jnp.asarray(rng.standard_normal((B, 8, H, D), np.float32))
    last = 100
    width = 4 if impl == "reference" else n_pages
    table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]
    positions = jnp.arange(last - 7, last + 1, dtype=jnp.int32)[None] % (width * PAGE_SIZE)
    valid = jnp.ones((B, 8), bool)
    eight = attend(q, k_pages, v_pages, table, positions, valid, impl=impl)[0, -1]
    one = attend(q[:, -1:], k_pages, v_pages, table, positions[:, -1:], valid[:, -1:], impl=impl)[0, 0]
    np.testing.assert_array_equal(np.asarray(eight), np.asarray(one), err_msg=f"table of {width} pages")
