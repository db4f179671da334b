"""GGUF vocabularies (`tokenizer.ggml.*`) as `tokenizers` byte-level BPE tokenizers, both ways.

`load_tokenizer(path or reader)` rebuilds the tokenizer a qwen35 GGUF describes (llama.cpp's reading of the same
metadata: docs/model.md §8); `vocab_from_tokenizer` + `write_vocab` turn a `tokenizers` tokenizer into that metadata.
`IncrementalDetokenizer` turns a stream of token ids into text without ever splitting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
import os
import warnings
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Iterable, Sequence

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .config import ModelFormatError
from .gguf_layout import checked_reader, open_gguf

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
QWEN35_PATTERN = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_PATTERNS = {"qwen35": QWEN35_PATTERN, "qwen2": QWEN2_PATTERN}

# llama.cpp ends generation on these token texts (besides the eos id), and on the FIM pad / repo / separator
# tokens it detects
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    }
)  # fmt: skip

NORMAL = int(gguf.TokenType.NORMAL)
CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
UNUSED = int(gguf.TokenType.UNUSED)


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` name: the split regex, then the byte-level alphabet.

    Unknown names get qwen35's regex, with a warning (llama.cpp falls back to a default regex too).
    """
    if pre not in PRE_PATTERNS:
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}: using the qwen35 pre-tokenizer", stacklevel=2)
    pattern = PRE_PATTERNS.get(pre, QWEN35_PATTERN)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a byte-level BPE (`gpt2`) vocabulary.

    tokens: byte-level strings, except added tokens (control / user-defined), which are stored as plain text.
    merges: "left right", rank = index. token_types: gguf.TokenType values, one per token.
    """

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    pre: str = "qwen35"
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None


def read_vocab(source: gguf.GGUFReader | str | os.PathLike) -> GGUFVocab:
    """The vocabulary metadata of a GGUF file (a path or an open `gguf.GGUFReader`); a missing key or a value of
    the wrong kind, or one over the limits of `gguf_layout` (checked before any is read), raises ModelFormatError
    naming the file and key."""
    reader = checked_reader(source) if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    path = str(getattr(reader.data, "filename", None) or source)

    def value(key: str, kind: type | tuple[type, ...], default=None, items: type | None = None):
        field = reader.fields.get(key)
        if field is None:
            return default
        try:
            got = field.contents()
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelFormatError(f"{path}: metadata '{key}' cannot be read ({exc})") from None
        if isinstance(got, bool) and kind is int or not isinstance(got, kind):
            raise ModelFormatError(f"{path}: metadata '{key}' is a {type(got).__name__}, expected {kind}")
        if items is not None and not all(isinstance(x, items) and not isinstance(x, bool) for x in got):
            raise ModelFormatError(f"{path}: metadata '{key}' holds items that are not {items.__name__}")
        return got

    model = value("tokenizer.ggml.model", str)
    if model != "gpt2":
        raise ModelFormatError(f"{path}: only byte-level BPE vocabularies (tokenizer.ggml.model = gpt2) are "
                               f"supported, not {model!r}")
    tokens = tuple(value("tokenizer.ggml.tokens", list, [], items=str))
    if not tokens:
        raise ModelFormatError(f"{path}: metadata 'tokenizer.ggml.tokens' is missing or empty")
    token_types = tuple(value("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens), items=int))
    if len(token_types) != len(tokens):
        raise ModelFormatError(f"{path}: 'tokenizer.ggml.token_type' has {len(token_types)} entries for "
                               f"{len(tokens)} tokens")
    ids = {}
    for name, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"), ("pad_id", "padding_token_id")):
        token_id = value(f"tokenizer.ggml.{key}", int)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelFormatError(f"{path}: 'tokenizer.ggml.{key}' {token_id} is outside the {len(tokens)} tokens")
        ids[name] = token_id
    return GGUFVocab(
        tokens=tokens,
        merges=tuple(value("tokenizer.ggml.merges", list, [], items=str)),
        token_types=token_types,
        pre=value("tokenizer.ggml.pre", str, "default"),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", (bool, int), False)),
        chat_template=value("tokenizer.chat_template", str),
        **ids,
    )


def write_vocab(writer: gguf.GGUFWriter, vocab: GGUFVocab) -> None:
    """Add the vocabulary's `tokenizer.ggml.*` (and chat template) key-values to a GGUF being written."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    for token_id, add in ((vocab.bos_id, writer.add_bos_token_id), (vocab.eos_id, writer.add_eos_token_id),
                          (vocab.pad_id, writer.add_pad_token_id)):  # fmt: skip
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)


def vocab_from_tokenizer(
    tokenizer: tokenizers.Tokenizer,
    pre: str = "qwen35",
    vocab_size: int | None = None,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
    chat_template: str | None = None,
) -> GGUFVocab:
    """GGUF vocabulary metadata for a byte-level BPE `tokenizers` tokenizer, as llama.cpp's converter writes it.

    Special added tokens become control tokens, other added tokens user-defined ones; ids without a token (up to
    `vocab_size`, e.g. the embedding's row count) become `[PAD<id>]` unused tokens. bos/eos/pad name tokens.
    """
    size = max(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size or 0)
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for token_id in range(size):
        token = tokenizer.id_to_token(token_id)
        if token is None:
            tokens.append(f"[PAD{token_id}]")
            types.append(UNUSED)
        elif token_id in added:
            tokens.append(added[token_id].content)
            types.append(CONTROL if added[token_id].special else USER_DEFINED)
        else:
            tokens.append(token)
            types.append(NORMAL)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]

    def token_id(text: str | None) -> int | None:
        if text is None:
            return None
        found = tokenizer.token_to_id(text)
        if found is None:
            raise ValueError(f"{text!r} is not a token")
        return found

    return GGUFVocab(
        tokens=tuple(tokens),
        merges=tuple(m if isinstance(m, str) else " ".join(m) for m in merges),
        token_types=tuple(types),
        pre=pre,
        bos_id=token_id(bos),
        eos_id=token_id(eos),
        pad_id=token_id(pad),
        chat_template=chat_template,
    )


def build_tokenizer(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """The `tokenizers` tokenizer a GGUF vocabulary describes: byte-level BPE with control and user-defined tokens.

    No normaliser, as in llama.cpp (Hugging Face's Qwen tokenizers apply NFC first).
    """
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    kinds = {CONTROL: True, USER_DEFINED: False}
    added = [
        AddedToken(token, special=kinds[kind], normalized=False)
        for token, kind in zip(vocab.tokens, vocab.token_types)
        if kind in kinds
    ]
    tokenizer.add_special_tokens([token for token in added if token.special])
    tokenizer.add_tokens([token for token in added if not token.special])
    return tokenizer


@dataclass(frozen=True)
class TextTokenizer:
    """A GGUF model's tokenizer: text <-> ids, the end-of-generation ids and the chat template."""

    backend: tokenizers.Tokenizer
    vocab: GGUFVocab
    eog_ids: frozenset[int]
    special_ids: frozenset[int]  # control tokens: skipped when decoding with skip_special

    @property
    def vocab_size(self) -> int:
        """Number of tokens (the embedding's rows)."""
        return len(self.vocab.tokens)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template from the GGUF, if any."""
        return self.vocab.chat_template

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids. BOS as the GGUF says (Qwen: no)."""
        # encode_batch releases the GIL while it works (encode does not), so a long prompt tokenized in a worker
        # thread leaves the event loop running
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        add_bos = self.vocab.add_bos if add_bos is None else add_bos
        return [self.vocab.bos_id, *ids] if add_bos and self.vocab.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: its byte-level characters decoded, or, for a token with characters outside
        that alphabet (added tokens such as "<|im_end|>" or "a b"), its UTF-8 text, as tokenizers' ByteLevel does."""
        known = self._token_bytes.get(token_id)
        if known is None:
            known = self._token_bytes[token_id] = self._decode_token_bytes(token_id)
        return known

    @cached_property
    def _token_bytes(self) -> dict[int, bytes]:
        """token_bytes of the tokens seen so far: the streams detokenize every committed token."""
        return {}

    def _decode_token_bytes(self, token_id: int) -> bytes:
        token = self.vocab.tokens[token_id]
        decoder = byte_decoder()
        if any(char not in decoder for char in token):
            return token.encode("utf-8")
        return bytes(decoder[char] for char in token)

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one sequence."""
        return IncrementalDetokenizer(self, skip_special)


def load_tokenizer(source: gguf.GGUFReader | str | os.PathLike) -> TextTokenizer:
    """The tokenizer of a GGUF file (a path or an open `gguf.GGUFReader`)."""
    vocab = read_vocab(source)
    types = vocab.token_types
    eog = {token_id for token_id, token in enumerate(vocab.tokens) if token in EOG_TEXTS}
    if vocab.eos_id is not None:
        eog.add(vocab.eos_id)
    try:
        backend = build_tokenizer(vocab)
    except Exception as exc:  # `tokenizers` raises plain Exceptions for inconsistent vocabularies
        name = getattr(getattr(source, "data", None), "filename", None) or source
        raise ModelFormatError(f"{name}: the vocabulary does not make a tokenizer ({exc})") from None
    return TextTokenizer(
        backend=backend,
        vocab=vocab,
        eog_ids=frozenset(eog),
        special_ids=frozenset(i for i, kind in enumerate(types) if kind == CONTROL),
    )


class IncrementalDetokenizer:
    """Token ids in, text out as soon as it is complete: an incomplete UTF-8 character is held back until its
    remaining bytes arrive; `flush` ends the stream (held bytes that never completed become U+FFFD).

    The pieces concatenate to `tokenizer.decode(ids, skip_special)`.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text completed by one more token (possibly empty)."""
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""
        return self.decoder.decode(self.tokenizer.token_bytes(token_id))

    def add_many(self, token_ids: Iterable[int]) -> str:
        """The text completed by several tokens."""
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The end of the stream: whatever is held back, with incomplete characters replaced."""
        return self.decoder.decode(b"", final=True)
