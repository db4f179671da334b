"""Training the byte-level BPE tokenizer (GPT-2 byte mapping, Qwen3.5's pre-tokenizer regex, docs/model.md §8)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN35_PRETOKENIZE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT, IM_START, IM_END = SPECIAL_TOKENS
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def empty_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with Qwen3.5's pre-tokenizer and decoder (no normalizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a BPE of exactly `vocab_size` ids: the merged vocabulary first, the three special tokens last
    (ids vocab_size-3 .. vocab_size-1, as in Qwen's vocabularies). Deterministic for the same texts."""
    tok = empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"trained vocabulary has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def encode_batch(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (special-token text inside `texts` is matched as special tokens)."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
