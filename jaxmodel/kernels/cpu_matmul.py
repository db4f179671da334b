"""Few-row matrix products on CPU: an XLA FFI custom call (cpu_matmul.cc) over weights stored [N, K].

`rows_matmul(x [M, K], w [N, K]) -> [M, N]` streams each weight row once for all M rows, so a 4-row product costs
1.2-1.5x a one-row one alone (1.8x inside the 0.8B step) instead of 2-2.5x with XLA's dot (README, "Model step");
`linear` uses it for M <= ROWS_KERNEL_MAX_ROWS when `load_model` stored a weight transposed (`weights.Transposed`,
`precision.takes_rows_kernel`).

The library is compiled from the source beside this file with the system's C++ compiler ($CXX, else g++) for the
machine it runs on (-march=native), on first use or by `build()` (the Makefile's install step), into
$GDNSPEC_KERNEL_DIR (default ~/.cache/gdnspec/kernels), named by a digest of the source, the flags, jaxlib's
version and the CPU's features. Without a compiler, or with GDNSPEC_CPU_KERNEL=0, `available()` is False and the
model keeps XLA's products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "gdnspec_rows_matmul"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
ROWS_KERNEL_MAX_ROWS = 16  # above this (prefill chunks) XLA's dot on the [N, K] weight is as fast or faster


class KernelUnavailable(RuntimeError):
    """The kernel library could not be built or loaded; the message says why."""


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def library_path() -> Path:
    """Where this source, compiler flags, jaxlib and CPU's library lives (it may not exist yet)."""
    import jaxlib

    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), _cpu_features().encode(),
                 platform.machine().encode()):
        digest.update(part)
    cache = Path(os.environ.get("GDNSPEC_KERNEL_DIR") or Path.home() / ".cache" / "gdnspec" / "kernels")
    return cache / f"cpu_matmul-{digest.hexdigest()[:16]}.so"


def build(path: Path | None = None) -> Path:
    """Compile the library to `path` (default `library_path()`) unless it is there; returns its path. The build
    writes a temporary file and renames it, so concurrent builds (test workers) never load a partial library."""
    path = path or library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except OSError as error:
            raise KernelUnavailable(f"cannot run the C++ compiler {compiler!r}: {error}") from error
        if done.returncode != 0:
            raise KernelUnavailable(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether `rows_matmul` can run here: the default backend is CPU, GDNSPEC_CPU_KERNEL is not 0, and the library
    builds and loads (the first call registers it with XLA; a failure is logged once)."""
    if os.environ.get("GDNSPEC_CPU_KERNEL", "1") == "0" or jax.default_backend() != "cpu":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as error:
        log.warning("the CPU few-row matmul kernel is unavailable, using XLA's products: %s", error)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, TARGET)), platform="cpu")
    return True


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] float32 @ w [N, K]^T float32 -> [M, N] float32, by the kernel (requires `available()`).

    Row m of the result depends on x[m] and w only, summed in the same order for every M (see cpu_matmul.cc)."""
    M, K = x.shape
    N, K_w = w.shape
    if K != K_w or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"rows_matmul takes float32 x [M, K] and w [N, K]; got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


def rows_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """The specification: x [M, K] @ w [N, K]^T -> [M, N] in float32 (XLA's dot)."""
    return jnp.einsum("mk,nk->mn", x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

