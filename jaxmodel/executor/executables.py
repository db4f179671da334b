"""Compiled step executables kept on disk, so that a restarted server loads each step shape instead of tracing,
lowering and compiling it again.

JAX's persistent compilation cache saves the compile alone: every shape is still traced and lowered to StableHLO
before its cache key can be computed, and on a warm start that is most of the time (docs/performance.md, "A warm
start loads the step executables"). An `ExecutableStore` keys a shape's executable by what decides it without
tracing it:

- the model code (a digest of the `jaxmodel` package's sources), JAX's version, the devices and their platform;
- the environment that changes what is traced or compiled (GDNSPEC_* switches, XLA_FLAGS, JAX's x64 and matmul
  precision settings, the CPU's feature flags);
- the call's name (its function and the model's config), its arguments' tree, shapes, dtypes and placement, and its
  static arguments.

A miss compiles the shape and saves it; a hit deserializes it, about a quarter of a second of a core on CPU. A
shape's module is named after its key: an executable JAX loaded from its own cache cannot be serialized again on
CPU (its code is not kept), and the name keeps JAX's cache from holding a shape this store has not saved. A file
that cannot be read is removed and its shape compiled again; a folder that cannot be written leaves the shape
unsaved. Loading an executable runs code, so the store lives in the user's own cache directory, as JAX's does.
With several processes (`jax.distributed`) no store is used.

`PackedCall` (host_io) uses the store kept by `keep_executables`: `gdnspec serve` and `bench.speculation` keep one
in a `steps` folder of JAX's cache directory (`keep_beside_jax_cache`; GDNSPEC_STEP_STORE=0 keeps none).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 2  # of the files (zlib-compressed pickles); a file of another format is a miss
SUFFIX = ".executable"
# Environment variables that never change a compiled step (a secret among them).
_UNRELATED_ENV = frozenset({"GDNSPEC_API_KEY", "GDNSPEC_CACHE", "GDNSPEC_STEP_STORE"})
_PACKAGE = Path(__file__).resolve().parents[1]  # jaxmodel


@dataclass
class StoreCounts:
    hits: int = 0
    misses: int = 0
    saved: int = 0
    unreadable: int = 0  # files removed because they could not be loaded
    not_saved: int = 0  # compiled executables that could not be serialized or written


@dataclass
class ExecutableStore:
    """Executables in `directory`, one file each, named by their key. `max_bytes`: past it, saving removes the files
    used longest ago (a load touches its file)."""

    directory: Path
    max_bytes: int = 4 << 30
    counts: StoreCounts = field(default_factory=StoreCounts)

    def __post_init__(self):
        self.directory = Path(self.directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def key(self, name: str, args, static) -> str:
        """The hex key of a call `name` (its function and model config) of these arguments (a pytree of jax or
        numpy arrays) and static arguments (anything with a faithful repr)."""
        leaves, treedef = jax.tree.flatten(args)
        digest = hashlib.sha256()
        digest.update(repr((_environment(), _switches(), name, str(treedef), static)).encode())
        for leaf in leaves:
            digest.update(_signature(leaf).encode())
        return digest.hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str) -> tuple[jax.stages.Compiled, Any] | None:
        """The executable saved under `key` and what was saved beside it, or None."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:  # absent, or a folder this process cannot read
            if not isinstance(exc, FileNotFoundError):
                log.warning("cannot read stored executable %s: %s", path.name, exc)
            self.counts.misses += 1
            return None
        try:
            entry = pickle.loads(zlib.decompress(data))
            if entry["format"] != FORMAT:
                raise ValueError(f"format {entry['format']}, not {FORMAT}")
            compiled = serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"],
                                                                 entry["out_tree"])
        except Exception as exc:  # a truncated or foreign file, or one this JAX cannot load: compile again
            log.warning("removing stored executable %s: %s", path.name, exc)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            self.counts.unreadable += 1
            self.counts.misses += 1
            return None
        with contextlib.suppress(OSError):  # another process may have pruned it meanwhile
            os.utime(path)
        self.counts.hits += 1
        return compiled, entry["extra"]

    def compile_and_save(self, key: str, lowered: jax.stages.Lowered, extra: Any = None) -> jax.stages.Compiled:
        """Compile `lowered`, save it under `key` with `extra` (picklable), and return it. Its module should be named
        after `key` (`module_name`), so that JAX's persistent cache holds it only where this store saved it."""
        with _watching_cache_hits() as fresh:
            compiled = lowered.compile()
        if not fresh():  # from JAX's cache (this store lost its file): an executable that cannot be saved again
            self.counts.not_saved += 1
            return compiled
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            entry = dict(format=FORMAT, executable=executable, in_tree=in_tree, out_tree=out_tree, extra=extra)
            data = zlib.compress(pickle.dumps(entry), 1)  # a fifth of the bytes, milliseconds to inflate
        except Exception as exc:  # e.g. an executable with constants folded in, which JAX cannot serialize
            log.info("not storing executable %s: %s", key[:16], exc)
            self.counts.not_saved += 1
            return compiled
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)  # whole or absent, for a reader in another process
        except OSError as exc:  # a full disk, a folder gone or made read-only: the step runs unsaved
            log.warning("cannot store executable %s: %s", path.name, exc)
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            self.counts.not_saved += 1
            return compiled
        self.counts.saved += 1
        with contextlib.suppress(OSError):
            self._prune()
        return compiled

    def _prune(self) -> None:
        """Remove the files used longest ago until the folder holds at most max_bytes."""
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):  # another process removed it
                stat = path.stat()
                files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def module_name(key: str) -> str:
    """The name a stored call's function takes (its module's): JAX's persistent cache keys by the module, which the
    name makes this key's alone."""
    return f"stored_{key[:32]}"


_store: ExecutableStore | None = None


def keep_executables(directory: str | os.PathLike | None, max_bytes: int = 4 << 30) -> ExecutableStore | None:
    """Keep compiled steps in `directory` from now on (None: keep none); returns the store."""
    global _store
    _store = None if directory is None else ExecutableStore(Path(directory), max_bytes)
    return _store


def keep_beside_jax_cache(directory: str | os.PathLike | None = None) -> ExecutableStore | None:
    """Keep compiled steps in a `steps` folder of `directory` (default: JAX's persistent cache directory, where one
    is set), unless GDNSPEC_STEP_STORE=0; returns the store."""
    directory = directory or jax.config.jax_compilation_cache_dir
    if not directory or os.environ.get("GDNSPEC_STEP_STORE", "1") == "0":
        return None
    try:
        return keep_executables(Path(directory) / "steps")
    except OSError as exc:  # a cache folder that cannot be made: serve without
        log.warning("not keeping compiled steps in %s: %s", directory, exc)
        return keep_executables(None)


def store() -> ExecutableStore | None:
    """The store `keep_executables` set, unless this is one of several processes."""
    return _store if _store is not None and _one_process() else None


@functools.lru_cache(maxsize=1)
def _one_process() -> bool:  # asked first at a step, after any `jax.distributed.initialize`
    return jax.process_count() == 1


# ---------------------------------------------------------------------------------------------------- the key


@functools.lru_cache(maxsize=1)
def _environment() -> tuple:
    """What a process's compiled steps depend on that does not change while it runs."""
    import jaxlib

    from ..kernels import cpu_matmul

    sources = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in (".py", ".cc", ".h")):
        sources.update(str(path.relative_to(_PACKAGE)).encode())
        sources.update(path.read_bytes())
    devices = jax.devices()
    backend = devices[0].client
    return (FORMAT, sources.hexdigest(), jax.__version__, jaxlib.__version__, backend.platform,
            backend.platform_version, tuple(d.device_kind for d in devices), _cpu_flags(), cpu_matmul.available())


def _switches() -> tuple:
    """The settings, read at each key, that change what a step traces or compiles to."""
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if (k.startswith("GDNSPEC_") and k not in _UNRELATED_ENV) or k == "XLA_FLAGS"))
    return env, tuple(str(getattr(jax.config, name, None)) for name in ("jax_enable_x64",
                                                                           "jax_default_matmul_precision"))


def _cpu_flags() -> str:
    """The CPU's feature flags (XLA compiles CPU code for the host's), where Linux tells them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _signature(leaf) -> str:
    if isinstance(leaf, jax.Array):
        return f"{jax.typeof(leaf)} {_placement(leaf.sharding)};"
    leaf = np.asarray(leaf)
    return f"{leaf.dtype}{list(leaf.shape)} host;"


@functools.lru_cache(maxsize=256)
def _placement(sharding) -> str:
    mesh = getattr(sharding, "mesh", None)
    devices = mesh.devices.flat if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)
    return f"{sharding!r} on {[d.id for d in devices]}"


# ---------------------------------------------------------------------------------------------------- fresh compiles


class _ThreadHits(threading.local):
    count = 0


_hits = _ThreadHits()
_listening = False
_listen_lock = threading.Lock()


def _count_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count += 1


@contextlib.contextmanager
def _watching_cache_hits():
    """Yields a function that says whether no compile in this block, in this thread, came from JAX's persistent
    cache."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count_hit)
            _listening = True
    before = _hits.count
    yield lambda: _hits.count == before
