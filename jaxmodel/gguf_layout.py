"""Checking a GGUF file's layout before anything reads it.

`gguf.GGUFReader` trusts the lengths and counts it finds: a string or array length that points past the end of
the file makes it allocate without end, a tensor whose extent runs past the end fails late or not at all.
`check_layout` walks the header (key/value pairs, then the tensor table) with every length, count, offset and
tensor extent checked against the file's size before it is used, and raises `ModelFormatError` naming the file,
the field and the limit. Only then does `open_gguf` hand the file to the reader. The walk reads the header in
place (memory map) and allocates nothing in proportion to what the file claims.

The file's size is not bound enough: the reader builds numpy objects for every array entry (each costing far more
memory and time than its bytes in the file), and the loaders decode every string they use, so a large but well-
formed hostile header (a 10^9-entry vocabulary, a 1 GB chat template) would still exhaust memory or take hours. The
walk therefore also holds every count and length to the limits below, generous for real files (docs/model.md §9),
and names the key, the length it found and the limit when one is passed.
"""

from __future__ import annotations

import mmap
import os
import struct
import weakref

import gguf
from gguf import GGUFValueType as VT

from .config import ModelFormatError

__all__ = ["check_layout", "checked_reader", "metadata_limits", "open_gguf"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4

# ---- limits on what a header may declare (the walk reads these at call time: tests may lower them)

MAX_METADATA_KEYS = 4096
"""Metadata keys in one file. Real files have 30 to 60."""

MAX_TENSORS = 1 << 16
"""Tensor entries in one file. Real files have at most a few thousand (Qwen3.5-397B-A17B: ~1,100 with its experts
stacked; old files with one tensor per expert a few thousand)."""

MAX_NAME_BYTES = 256
"""A metadata key's or a tensor's name, and `general.architecture` (it prefixes the architecture's key names). Real
key names are under 64 bytes; ggml keeps tensor names under 64 (GGML_MAX_NAME)."""

MAX_STRING_BYTES = 64 << 10
"""Any other string value, and each entry of any other string array (names, licenses, URLs, descriptions, tags): a
full license text is about 10 KiB."""

MAX_CHAT_TEMPLATE_BYTES = 1 << 20
"""`tokenizer.chat_template` and the named `tokenizer.chat_template.<name>`: real templates are 1 to ~100 KiB."""

MAX_VOCAB_ENTRIES = 1 << 20
"""`tokenizer.ggml.tokens` and the per-token `tokenizer.ggml.token_type` / `tokenizer.ggml.scores`: the largest real
vocabularies have about 262k tokens (Gemma 3: 262,144; Qwen3.5: 248,320)."""

MAX_TOKEN_BYTES = 1024
"""One entry of `tokenizer.ggml.tokens`. A byte-level token stands for at most ~128 bytes of text in real
vocabularies, at most 2 UTF-8 bytes each in GPT-2's byte alphabet (256); added tokens are short texts. An entry of
`tokenizer.ggml.merges` ("left right") may have 2 * MAX_TOKEN_BYTES + 1."""

MAX_MERGES = 1 << 21
"""`tokenizer.ggml.merges`: real BPE vocabularies have about one merge per token (Qwen3.5: ~247k)."""

MAX_ARRAY_ENTRIES = 1 << 20
"""Any other array (per-layer values, rope sections, tags, a SentencePiece charsmap): real ones have at most a few
hundred thousand entries, most a few hundred."""

MAX_METADATA_ENTRIES = 1 << 22
"""All array entries of the file together, nested arrays' included: what the reader builds an object for. It holds
a file at every per-key limit above; real files have under a million (Qwen3.5: ~745k in tokens, types and merges).
At the limit the reader takes about a minute and a few GiB."""

_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
_CHAT_TEMPLATE = "tokenizer.chat_template"


def metadata_limits(key: str) -> tuple[int, int]:
    """(the most entries an array under `key` may have, the most bytes a string under it, or each string entry of
    an array under it, may have)."""
    if key in _VOCAB_KEYS:
        return MAX_VOCAB_ENTRIES, MAX_TOKEN_BYTES
    if key == "tokenizer.ggml.merges":
        return MAX_MERGES, 2 * MAX_TOKEN_BYTES + 1
    if key == "general.architecture":
        return MAX_ARRAY_ENTRIES, MAX_NAME_BYTES
    if key == _CHAT_TEMPLATE or key.startswith(_CHAT_TEMPLATE + "."):
        return MAX_ARRAY_ENTRIES, MAX_CHAT_TEMPLATE_BYTES
    return MAX_ARRAY_ENTRIES, MAX_STRING_BYTES


def _too_long(what: str, n_bytes: int, limit: int) -> str:
    return f"{what} is {n_bytes} bytes long, more than the {limit} this server reads"

_FIXED = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
          VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}  # fmt: skip


class _Walker:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, path: str, data, order: str):
        self.path, self.data, self.order, self.offset = path, data, order, 0
        self.entries = 0  # array entries so far, against MAX_METADATA_ENTRIES

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: {what}")

    def need(self, n_bytes: int, what: str) -> None:
        left = len(self.data) - self.offset
        if n_bytes > left:
            raise self.fail(f"{what} needs {n_bytes} bytes at offset {self.offset}, the file has {left} left")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(self.order + fmt)
        self.need(size, what)
        values = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return values[0] if len(values) == 1 else values

    def string(self, what: str, limit: int, keep: bool = True) -> bytes | None:
        """A string of at most `limit` bytes: its bytes, or None (skipped, nothing copied) unless keep."""
        n = self.unpack("Q", f"the length of {what}")
        if n > limit:
            raise self.fail(_too_long(what, n, limit))
        self.need(n, what)
        value = bytes(self.data[self.offset:self.offset + n]) if keep else None
        self.offset += n
        return value

    def value(self, kind: int, key: str, what: str, depth: int = 0) -> int | None:
        """Skip one value of `kind` under metadata `key`; returns it when it is an integer (for general.alignment)."""
        if kind in _FIXED:
            return self.unpack(_FIXED[VT(kind)], what)
        max_entries, max_bytes = metadata_limits(key)
        if kind == VT.STRING:
            self.string(what, max_bytes, keep=False)
            return None
        if kind != VT.ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        item_kind, count = self.unpack("IQ", f"the item type and count of {what}")
        if count > max_entries:
            raise self.fail(f"{what} has {count} entries, more than the {max_entries} this server reads")
        self.entries += count
        if self.entries > MAX_METADATA_ENTRIES:
            raise self.fail(f"{what} brings the metadata's array entries to {self.entries}, more than the "
                            f"{MAX_METADATA_ENTRIES} this server reads")
        if item_kind in _FIXED:
            self.need(count * struct.calcsize(self.order + _FIXED[VT(item_kind)]), f"{what} ({count} items)")
            self.offset += count * struct.calcsize(self.order + _FIXED[VT(item_kind)])
            return None
        if item_kind not in (VT.STRING, VT.ARRAY):
            raise self.fail(f"{what} has items of unknown value type {item_kind}")
        # every string or array item takes at least 8 bytes (its length or item type and count)
        self.need(count * 8, f"{what} ({count} items)")
        if item_kind == VT.STRING:
            self._strings(count, max_bytes, what)
        else:
            for i in range(count):
                self.value(item_kind, key, f"{what} entry {i}", depth + 1)
        return None

    def _strings(self, count: int, limit: int, what: str) -> None:
        """Skip `count` strings of at most `limit` bytes each (a vocabulary's worth at a time: no text built per
        entry unless one is refused)."""
        data, end, length = self.data, len(self.data), struct.Struct(self.order + "Q")
        for i in range(count):
            if self.offset + 8 > end:
                self.need(8, f"the length of {what} entry {i}")
            n = length.unpack_from(data, self.offset)[0]
            if n > limit:
                raise self.fail(_too_long(f"{what} entry {i}", n, limit))
            self.offset += 8
            self.need(n, f"{what} entry {i}")
            self.offset += n


def check_layout(path: str | os.PathLike) -> None:
    """Raise ModelFormatError unless every length, count, offset and tensor extent of the GGUF at `path` lies
    within the file and every metadata count and length within its limit (see the module docstring)."""
    path = str(path)
    size = os.path.getsize(path)
    if size < 24:
        raise ModelFormatError(f"{path}: not a readable GGUF file ({size} bytes, shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ModelFormatError(f"{path}: not a readable GGUF file (no GGUF magic)")
        order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
        walker = _Walker(path, data, order)
        walker.offset = 4
        version = walker.unpack("I", "the version")
        if version not in SUPPORTED_VERSIONS:
            raise ModelFormatError(f"{path}: not a readable GGUF file (version {version}; supported: "
                                   f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors, n_fields = walker.unpack("QQ", "the tensor and key counts")
        if n_fields > MAX_METADATA_KEYS:
            raise walker.fail(f"{n_fields} metadata keys, more than the {MAX_METADATA_KEYS} this server reads")
        if n_tensors > MAX_TENSORS:
            raise walker.fail(f"{n_tensors} tensor entries, more than the {MAX_TENSORS} this server reads")
        # a key takes at least 13 bytes (length, one byte, value type); a tensor entry at least 32
        walker.need(n_fields * 13, f"{n_fields} metadata keys")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_fields):
            raw_key = walker.string(f"the name of metadata key {i}", MAX_NAME_BYTES)
            key = raw_key.decode("utf-8", "replace")
            kind = walker.unpack("I", f"the value type of '{key}'")
            value = walker.value(kind, key, f"metadata '{key}'")
            if raw_key == b"general.alignment":
                if kind != VT.UINT32 or not value or value & (value - 1):
                    raise walker.fail(f"metadata 'general.alignment' is {value!r}, not a power of two (uint32)")
                alignment = value
        walker.need(n_tensors * 32, f"{n_tensors} tensor entries")
        tensors = []
        for i in range(n_tensors):
            name = walker.string(f"the name of tensor {i}", MAX_NAME_BYTES).decode("utf-8", "replace")
            n_dims = walker.unpack("I", f"the dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise walker.fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            dims = walker.unpack("Q" * n_dims, f"the shape of tensor '{name}'")
            dims = (dims,) if n_dims == 1 else dims
            raw_type, offset = walker.unpack("IQ", f"the type and offset of tensor '{name}'")
            try:
                block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
            except (ValueError, KeyError):
                raise walker.fail(f"tensor '{name}' has unknown type {raw_type}") from None
            if dims[0] % block_size:
                raise walker.fail(f"tensor '{name}': first dimension {dims[0]} is not a multiple of its type's "
                                  f"block of {block_size}")
            n_elements = 1
            for d in dims:
                n_elements *= d
            if offset % alignment:
                raise walker.fail(f"tensor '{name}' starts at offset {offset}, not a multiple of {alignment}")
            tensors.append((name, offset, n_elements // block_size * type_size))
        data_start = -(-walker.offset // alignment) * alignment
        for name, offset, n_bytes in tensors:
            end = data_start + offset + n_bytes
            if end > size:
                raise ModelFormatError(f"{path}: truncated: tensor '{name}' needs bytes up to {end}, the file has "
                                       f"{size}")


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # readers whose file check_layout accepted


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file whose layout `check_layout` accepts; every way it can be broken is one ModelFormatError
    that names the file."""
    path = str(path)
    if not os.path.isfile(path):
        raise ModelFormatError(f"{path}: no such file")
    check_layout(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # what the layout check cannot see (a field of the wrong type, ...)
        raise ModelFormatError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    _CHECKED.add(reader)
    return reader


def checked_reader(reader: gguf.GGUFReader, path: str | os.PathLike | None = None) -> gguf.GGUFReader:
    """`reader`, once its file passes `check_layout` (at once for one `open_gguf` opened): a reader opened
    elsewhere has its file's header checked, limits included, before any of its fields is used."""
    if reader not in _CHECKED:
        check_layout(str(getattr(reader.data, "filename", None) or path))
        _CHECKED.add(reader)
    return reader
