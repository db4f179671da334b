"""The training corpus: the Python standard library's own source files, split into train and held-out sets.

The split is a deterministic rule on each file's path relative to the stdlib root, so every machine with the
same Python version draws the same split. Test suites, generated tables and vendored packages are left out.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELD_OUT_MODULUS = 20  # one file in 20 is held out
EXCLUDED_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"})
EXCLUDED_PREFIXES = ("_sysconfigdata",)
MAX_FILE_BYTES = 400_000  # a handful of huge generated files would dominate the corpus


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """The split rule: crc32 of the '/'-joined relative path, modulo HELD_OUT_MODULUS, equals 0."""
    return zlib.crc32(relative_path.encode("utf-8")) % HELD_OUT_MODULUS == 0


def _wanted(rel: Path) -> bool:
    return not (set(rel.parts) & EXCLUDED_PARTS) and not rel.name.startswith(EXCLUDED_PREFIXES)


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]


def load_corpus(root: Path | None = None) -> Corpus:
    """All wanted .py files under `root` (default: the stdlib), sorted by path and split by `is_held_out`."""
    root = root or stdlib_root()
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not _wanted(rel) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        item = SourceFile(rel.as_posix(), text)
        (held_out if is_held_out(item.path) else train).append(item)
    return Corpus(tuple(train), tuple(held_out))


def token_stream(files: Sequence[SourceFile], encode, separator: int) -> np.ndarray:
    """Each file's token ids followed by `separator` (the end-of-text id), concatenated. -> [N] int32

    encode: list[str] -> list[list[int]] (a batch encoder, e.g. a tokenizers.Tokenizer's encode_batch wrapper).
    """
    ids = encode([f.text for f in files])
    return np.fromiter((t for doc in ids for t in (*doc, separator)), dtype=np.int32)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` windows of `length` tokens at uniformly random offsets. -> [batch, length] int32"""
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s : s + length] for s in starts])


def fixed_windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    """`count` windows of `length` tokens spread evenly over the stream (the same every run). -> [count, length]"""
    starts = np.linspace(0, len(stream) - length, count).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts])
