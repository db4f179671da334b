"""Metadata limits (jaxmodel/gguf_layout.py): every string and array a GGUF header declares is held to a limit
before the reader or the loaders use it, and a file over one is refused with ModelFormatError naming the file, the
key, the length found and the limit."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from conftest import DATA, allocation_peak
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from jaxmodel import ModelFormatError, gguf_layout, load_model
from jaxmodel.gguf_io import read_gguf
from jaxmodel.tokenizer import load_tokenizer

TINY = DATA / "tiny-qwen35-mtp.gguf"


def copy_gguf(dst, *, arch: str | None = None, values: dict | None = None):
    """TINY with its architecture name or some metadata values replaced (same types); its tensors unchanged."""
    reader = GGUFReader(TINY)
    writer = GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, (values or {}).get(key, field.contents()), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def refused(path, message: str) -> None:
    """Both public loaders, and the tokenizer given a reader opened elsewhere, refuse the file with `message`."""
    pattern = re.escape(str(path)) + ": " + message
    with pytest.raises(ModelFormatError, match=pattern):
        load_model(path)
    with pytest.raises(ModelFormatError, match=pattern):
        load_tokenizer(path)


def test_the_real_test_file_loads_within_the_limits():
    model, tokenizer = load_model(TINY), load_tokenizer(TINY)
    assert model.cfg.n_vocab == len(tokenizer.vocab.tokens) == 512
    assert "<|im_start|>" in tokenizer.chat_template


def test_an_over_long_chat_template_is_refused(tmp_path):
    limit = gguf_layout.MAX_CHAT_TEMPLATE_BYTES
    assert limit == 1 << 20
    at_limit = copy_gguf(tmp_path / "at-limit.gguf", values={"tokenizer.chat_template": "x" * limit})
    assert len(load_tokenizer(at_limit).chat_template) == limit
    over = copy_gguf(tmp_path / "template.gguf", values={"tokenizer.chat_template": "x" * (limit + 1)})
    refused(over, rf"metadata 'tokenizer\.chat_template' is {limit + 1} bytes long, more than the {limit} this "
                  r"server reads")


def test_an_over_long_architecture_string_is_refused(tmp_path):
    path = copy_gguf(tmp_path / "arch.gguf", arch="q" * 257)
    refused(path, r"metadata 'general\.architecture' is 257 bytes long, more than the 256 this server reads")


def test_a_vocabulary_over_the_limit_is_refused(monkeypatch):
    """TINY's 512 tokens against a limit lowered to 511 (and its 253 merges against 252): the limit is a
    parameter, so a small file stands for a 2-million-token one."""
    monkeypatch.setattr(gguf_layout, "MAX_VOCAB_ENTRIES", 511)
    refused(TINY, r"metadata 'tokenizer\.ggml\.tokens' has 512 entries, more than the 511 this server reads")
    monkeypatch.setattr(gguf_layout, "MAX_VOCAB_ENTRIES", 512)
    monkeypatch.setattr(gguf_layout, "MAX_MERGES", 252)
    refused(TINY, r"metadata 'tokenizer\.ggml\.merges' has 253 entries, more than the 252 this server reads")
    monkeypatch.setattr(gguf_layout, "MAX_MERGES", 253)
    assert len(load_tokenizer(TINY).vocab.merges) == 253


def test_all_array_entries_together_are_bounded(monkeypatch):
    """rope sections (4) + tokens (512) + token types (512) pass 1000 at the token types."""
    monkeypatch.setattr(gguf_layout, "MAX_METADATA_ENTRIES", 1000)
    refused(TINY, r"metadata 'tokenizer\.ggml\.token_type' brings the metadata's array entries to 1028, more than "
                  r"the 1000 this server reads")


def test_an_over_long_token_is_refused(tmp_path):
    tokens = GGUFReader(TINY).fields["tokenizer.ggml.tokens"].contents()
    tokens[300] = "a" * 1025
    path = copy_gguf(tmp_path / "token.gguf", values={"tokenizer.ggml.tokens": tokens})
    refused(path, r"metadata 'tokenizer\.ggml\.tokens' entry 300 is 1025 bytes long, more than the 1024 this "
                  r"server reads")


def test_too_many_keys_are_refused(monkeypatch):
    n_keys = len(GGUFReader(TINY).fields) - 3  # the reader adds GGUF.version, GGUF.tensor_count, GGUF.kv_count
    monkeypatch.setattr(gguf_layout, "MAX_METADATA_KEYS", n_keys - 1)
    refused(TINY, rf"{n_keys} metadata keys, more than the {n_keys - 1} this server reads")


def header(*fields: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + b"".join(fields)


def kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + payload


def string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


ARCH = kv(b"general.architecture", GGUFValueType.STRING, string(b"qwen35"))


@pytest.mark.parametrize("name, data, message", [
    ("declared-vocabulary", header(ARCH, kv(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 10**9))),
     r"metadata 'tokenizer\.ggml\.tokens' has 1000000000 entries, more than the 1048576 this server reads"),
    ("declared-architecture", header(kv(b"general.architecture", 8, struct.pack("<Q", 100 << 20))),
     r"metadata 'general\.architecture' is 104857600 bytes long, more than the 256 this server reads"),
    ("declared-template", header(ARCH, kv(b"tokenizer.chat_template", 8, struct.pack("<Q", 1 << 30))),
     r"metadata 'tokenizer\.chat_template' is 1073741824 bytes long, more than the 1048576 this server reads"),
    ("long-string", header(ARCH, kv(b"general.name", 8, string(b"n" * 65537))),
     r"metadata 'general\.name' is 65537 bytes long, more than the 65536 this server reads"),
    ("long-key", header(kv(b"k" * 257, 4, b"\0" * 4)),
     r"the name of metadata key 0 is 257 bytes long, more than the 256 this server reads"),
    ("long-array", header(ARCH, kv(b"general.tags", 9, struct.pack("<IQ", 0, (1 << 20) + 1) + b"\0" * ((1 << 20) + 1))),
     r"metadata 'general\.tags' has 1048577 entries, more than the 1048576 this server reads"),
    ("many-tensors", b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0),
     r"1152921504606846976 tensor entries, more than the 65536 this server reads"),
])  # fmt: skip
def test_declared_lengths_over_the_limits_are_refused_before_any_allocation(tmp_path, name, data, message):
    """Lengths and counts over a limit name it, whether or not the file is long enough to hold them."""
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with allocation_peak() as allocated, pytest.raises(ModelFormatError, match=re.escape(str(path)) + ": " + message):
        read_gguf(path)
    assert allocated.peak < 1 << 20, allocated.peak
    with pytest.raises(ModelFormatError, match=message):
        load_tokenizer(path)


def test_a_well_formed_two_million_token_vocabulary_is_refused_before_the_reader_parses_it(tmp_path):
    """2M one-byte tokens (an 18 MB file): within the file, so only the limit stops `gguf.GGUFReader` from
    building objects for each of them (about 30 s and 3 GB)."""
    n = 2_000_000
    entries = np.zeros(n, dtype=np.dtype([("length", "<u8"), ("text", "S1")]))
    entries["length"], entries["text"] = 1, b"x"
    path = tmp_path / "vocabulary.gguf"
    path.write_bytes(header(ARCH, kv(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, n) + entries.tobytes())))
    with allocation_peak() as allocated, pytest.raises(
            ModelFormatError, match=r"metadata 'tokenizer\.ggml\.tokens' has 2000000 entries, more than the 1048576 "
                                    r"this server reads"):  # fmt: skip
        load_tokenizer(path)
    assert allocated.peak < 1 << 20, allocated.peak


def test_a_reader_opened_elsewhere_is_checked_before_its_fields_are_used(tmp_path):
    path = copy_gguf(tmp_path / "template.gguf", values={"tokenizer.chat_template": "x" * ((1 << 20) + 1)})
    reader = GGUFReader(path)  # the library itself reads it; the loaders must not use it unchecked
    message = r"metadata 'tokenizer\.chat_template' is 1048577 bytes long"
    with pytest.raises(ModelFormatError, match=message):
        load_tokenizer(reader)
    with pytest.raises(ModelFormatError, match=message):
        read_gguf(path, reader=reader)
    assert load_tokenizer(GGUFReader(TINY)).vocab.tokens[0] == load_tokenizer(TINY).vocab.tokens[0]
