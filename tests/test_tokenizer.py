"""GGUF vocabularies as tokenizers: the bundled tiny model's, and a trained tokenizer exported and rebuilt."""

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, trainers

from jaxmodel.tokenizer import (
    CONTROL,
    NORMAL,
    UNUSED,
    USER_DEFINED,
    byte_decoder,
    load_tokenizer,
    pre_tokenizer,
    read_vocab,
    vocab_from_tokenizer,
    write_vocab,
)

TINY = "tests/data/tiny-qwen35-mtp.gguf"

TEXTS = [
    "Hello, world!",
    "It's the user's model; they'll see it, we'd've said.",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🎉🚀👩‍💻 and flags 🇫🇷 and e\u0301 combining",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment\n\n\n\tclass A(B):\n\t\tpass\n",
    "whitespace   runs\t\t\tand\r\n\r\nnewlines\n\n\n   \n  trailing   ",
    "numbers 1234567 3.14159 -42 1e-9 0x1F",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "specials inline<|endoftext|>and<|im_end|>glued",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(TINY)


def test_tiny_model_vocabulary(tiny):
    assert tiny.vocab_size == 512
    assert tiny.vocab.bos_id == 509 and tiny.vocab.eos_id == 511 and tiny.vocab.pad_id == 509
    assert tiny.vocab.pre == "qwen35" and not tiny.vocab.add_bos
    endoftext, im_start, im_end = (tiny.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert tiny.eog_ids == {endoftext, im_end}
    assert "<|im_start|>" in tiny.chat_template
    assert tiny.special_ids == {endoftext, im_start, im_end}


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_model_round_trip(tiny, text):
    ids = tiny.encode(text)
    assert tiny.decode(ids) == text
    assert all(0 <= i < tiny.vocab_size for i in ids)


def test_special_tokens_in_text_are_single_ids(tiny):
    ids = tiny.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 510 and ids[-1] == 511
    assert tiny.encode("hi")[0] != 509  # no BOS for Qwen
    assert tiny.encode("hi", add_bos=True)[0] == 509
    assert tiny.decode(ids, skip_special=True) == "user\nhi"


def test_pre_tokenizer_regexes():
    # qwen35 keeps combining marks with their letters; qwen2 splits them off
    def pieces(pre, text):
        split = pre_tokenizer(pre).pre_tokenize_str(text)
        return [bytes(byte_decoder()[char] for char in piece).decode() for piece, _ in split]

    assert pieces("qwen35", "cafe\u0301 ok") == ["cafe\u0301", " ok"]
    assert pieces("qwen2", "cafe\u0301 ok") == ["cafe", "\u0301", " ok"]
    assert pieces("qwen35", "x  \n\n  y's 123") == ["x", "  \n\n", " ", " y", "'s", " ", "1", "2", "3"]
    with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre"):
        unknown = pre_tokenizer("llama-bpe")
    assert unknown.pre_tokenize_str("a  b\n") == pre_tokenizer("qwen35").pre_tokenize_str("a  b\n")


# --- a trained tokenizer, exported to GGUF metadata and rebuilt -----------------------------------------------------

CORPUS = [text for text in TEXTS if "<|" not in text] * 3 + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens and the target verifies them in one step.\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "Gated DeltaNet keeps a recurrent state; attention keeps a KV cache.",
]


@pytest.fixture(scope="module")
def trained():
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer("qwen35")
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=sorted(byte_decoder()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tokenizer


@pytest.fixture(scope="module")
def rebuilt(trained, tmp_path_factory):
    vocab = vocab_from_tokenizer(
        trained, vocab_size=416, bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", chat_template="{{ x }}"
    )
    path = tmp_path_factory.mktemp("vocab") / "trained.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    write_vocab(writer, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab, load_tokenizer(str(path)), path


def test_exported_metadata(trained, rebuilt):
    vocab, tokenizer, path = rebuilt
    assert read_vocab(gguf.GGUFReader(path)) == vocab == tokenizer.vocab
    size = trained.get_vocab_size(with_added_tokens=True)
    assert tokenizer.vocab_size == 416 and len(vocab.token_types) == 416
    assert vocab.token_types[trained.token_to_id("<|im_end|>")] == CONTROL
    assert vocab.token_types[trained.token_to_id("<think>")] == USER_DEFINED
    assert vocab.token_types[trained.token_to_id("Ġ")] == NORMAL
    assert set(vocab.token_types[size:]) == {UNUSED} and vocab.tokens[size] == f"[PAD{size}]"
    assert all(len(merge.split(" ")) == 2 for merge in vocab.merges)
    assert tokenizer.eog_ids == {trained.token_to_id("<|endoftext|>"), trained.token_to_id("<|im_end|>")}
    assert tokenizer.chat_template == "{{ x }}" and tokenizer.vocab.pre == "qwen35"


@pytest.mark.parametrize("text", TEXTS + ["unseen words: xylophone zebra quixotic <think>hmm</think> done"])
def test_rebuilt_encodes_like_the_trained_tokenizer(trained, rebuilt, text):
    _, tokenizer, _ = rebuilt
    expected = trained.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == trained.decode(expected, skip_special_tokens=False) == text


# --- incremental detokenization -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_incremental_pieces_are_whole_characters(tiny, text):
    ids = tiny.encode(text)
    detokenizer = tiny.detokenizer()
    pieces = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == tiny.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    if any(len(ch.encode()) > 1 for ch in text):  # some character really was split over tokens
        assert any(piece == "" for piece in pieces[:-1])


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=40), skip_special=st.booleans())
def test_incremental_equals_decode_on_any_ids(tiny, ids, skip_special):
    detokenizer = tiny.detokenizer(skip_special)
    streamed = detokenizer.add_many(ids) + detokenizer.flush()
    assert streamed == tiny.decode(ids, skip_special)
