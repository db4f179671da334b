"""Checking a GGUF file's layout before anything reads it.

`gguf.GGUFReader` trusts the lengths and counts it finds: a string or array length that points past the end of
the file makes it allocate without end, a tensor whose extent runs past the end fails late or not at all.
`check_layout` walks the header (key/value pairs, then the tensor table) with every length, count, offset and
tensor extent checked against the file's size before it is used, and raises `ModelFormatError` naming the file,
the field and the limit. Only then does `open_gguf` hand the file to the reader. The walk reads the header in
place (memory map) and allocates nothing in proportion to what the file claims.
"""

from __future__ import annotations

import mmap
import os
import struct

import gguf
from gguf import GGUFValueType as VT

from .config import ModelFormatError

__all__ = ["check_layout", "open_gguf"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4
_FIXED = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
          VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}  # fmt: skip


class _Walker:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, path: str, data, order: str):
        self.path, self.data, self.order, self.offset = path, data, order, 0

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

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", f"the length of {what}")
        self.need(n, what)
        value = bytes(self.data[self.offset:self.offset + n])
        self.offset += n
        return value

    def value(self, kind: int, what: str, depth: int = 0) -> int | None:
        """Skip one value of `kind`; returns it when it is an integer (for general.alignment)."""
        if kind in _FIXED:
            return self.unpack(_FIXED[VT(kind)], what)
        if kind == VT.STRING:
            self.string(what)
            return None
        if kind != VT.ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        item_kind, count = self.unpack("IQ", f"the item type and count of {what}")
        if item_kind in _FIXED:
            self.need(count * struct.calcsize(self.order + _FIXED[VT(item_kind)]), f"{what} ({count} items)")
            self.offset += count * struct.calcsize(self.order + _FIXED[VT(item_kind)])
            return None
        if item_kind not in (VT.STRING, VT.ARRAY):
            raise self.fail(f"{what} has items of unknown value type {item_kind}")
        # every string or array item takes at least 8 bytes (its length or item type and count)
        self.need(count * 8, f"{what} ({count} items)")
        for i in range(count):
            self.value(item_kind, f"{what}[{i}]", depth + 1)
        return None


def check_layout(path: str | os.PathLike) -> None:
    """Raise ModelFormatError unless every length, count, offset and tensor extent of the GGUF at `path` lies
    within the file (see the module docstring)."""
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
        # a key takes at least 13 bytes (length, one byte, value type); a tensor entry at least 32
        walker.need(n_fields * 13, f"{n_fields} metadata keys")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_fields):
            raw_key = walker.string(f"the name of metadata key {i}")
            key = raw_key.decode("utf-8", "replace")
            kind = walker.unpack("I", f"the value type of '{key}'")
            value = walker.value(kind, f"metadata '{key}'")
            if raw_key == b"general.alignment":
                if kind != VT.UINT32 or not value or value & (value - 1):
                    raise walker.fail(f"metadata 'general.alignment' is {value!r}, not a power of two (uint32)")
                alignment = value
        walker.need(n_tensors * 32, f"{n_tensors} tensor entries")
        tensors = []
        for i in range(n_tensors):
            name = walker.string(f"the name of tensor {i}").decode("utf-8", "replace")
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


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file whose layout `check_layout` accepts; every way it can be broken is one ModelFormatError
    that names the file."""
    path = str(path)
    if not os.path.isfile(path):
        raise ModelFormatError(f"{path}: no such file")
    check_layout(path)
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # what the layout check cannot see (a field of the wrong type, ...)
        raise ModelFormatError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
