"""Matrix products on CPU as XLA FFI custom calls (cpu_matmul.cc), over weights stored [N, K] (GGUF's order).

`rows_matmul(x [M, K], w [N, K]) -> [M, N]`, float32 weights: streams each weight row once for a tile of rows,
so a few-row product costs little more than a one-row one, where XLA's dot costs about as many times more as it
has rows (docs/performance.md, "Model step"); `linear` uses it for every M when `load_model` stored a weight transposed
(`weights.Transposed`, `precision.takes_rows_kernel`).

`q8_rows_matmul(x [M, K], quants [N, K], scales [N, K/32]) -> [M, N]`, Q8_0 weights as the file holds them, eight
rows' quants interleaved four bytes at a time (`interleave_q8_rows`; `weights.Q8Rows`): llama.cpp's arithmetic for
a Q8_0 matmul (x quantized to Q8_0 per row, each block's 8-bit products summed exactly as one integer, then scaled),
reading a quarter of float32's bytes; `linear` uses it for every M. On the bundled Q8_0 model its logits stay within
0.2 of llama.cpp's, same argmax (tests/test_cpu_q8_matmul.py): llama.cpp's x86 dot product sums a block in eight
partial sums, so the last bits differ.

Both take `live` [M], which rows are real: a step padded to its shape bucket (tokens past a row's own, a batch's
empty rows) skips the padding's products, so it costs its tokens; those rows come back as 0.

The library, these products, CPU attention (`cpu_attention`, from cpu_attention.cc), the gated delta rule
(`cpu_gdn`, from cpu_gdn.cc), greedy's argmax (`cpu_argmax`, from cpu_argmax.cc) and the GDN's causal conv
(`cpu_conv`, from cpu_conv.cc), is compiled from the sources
beside this file with the system's C++ compiler ($CXX, else g++) for the machine it runs on (-march=native), on first
use or by `build()` (the Makefile's install step), into $GDNSPEC_KERNEL_DIR (default
~/.cache/gdnspec/kernels), named by a digest of the sources, the flags, jaxlib's version and the CPU's features.
Without a compiler, or with GDNSPEC_CPU_KERNEL=0, `available()` is False and the model keeps XLA's products and
attention.
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
import numpy as np

log = logging.getLogger(__name__)

# The CPU kernels' sources, built into one library: the products here, attention (`cpu_attention`), the gated
# delta rule (`cpu_gdn`), greedy's argmax (`cpu_argmax`), the GDN's causal conv (`cpu_conv`).
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_matmul.cc", "cpu_attention.cc", "cpu_gdn.cc", "cpu_argmax.cc", "cpu_conv.cc"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_pool.h", "cpu_vector.h", "cpu_blocks.h"))
TARGET = "gdnspec_rows_matmul"
TARGET_Q8 = "gdnspec_q8_rows_matmul"
TARGET_Q8_PROLOGUE = "gdnspec_q8_rows_matmul_prologue"
TARGET_BLOCKS = "gdnspec_block_rows_matmul"
TARGET_BLOCKS_PROLOGUE = "gdnspec_block_rows_matmul_prologue"
TARGET_ATTENTION = "gdnspec_paged_attention"
TARGET_ATTENTION_F16 = "gdnspec_paged_attention_f16"
TARGET_GDN = "gdnspec_gdn_recurrent"
TARGET_ARGMAX = "gdnspec_argmax_rows"
TARGET_CONV = "gdnspec_causal_conv"
TARGET_CONV_PLANES = "gdnspec_causal_conv_planes"
Q8_BLOCK = 32  # weights per Q8_0 block (one scale each)
Q8_ROW_GROUP = 8  # rows the Q8_0 product's weights interleave, one per vector lane (cpu_matmul.cc, "Q8_0")
Q8_QUAD = 4  # bytes of a row side by side in the interleaved order
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
# GDNSPEC_CPU_BLOCKS=avx2 builds the block products' 256-bit forms on a CPU that has AVX-512 (what a CPU without
# it runs; tests/test_cpu_block_matmul.py checks them that way).
BLOCKS_ISA_FLAGS = {"avx2": ("-DGDNSPEC_BLOCKS_AVX2_ONLY",)}


def flags() -> tuple[str, ...]:
    """The compiler flags of this process's library: FLAGS, and those GDNSPEC_CPU_BLOCKS asks for."""
    choice = os.environ.get("GDNSPEC_CPU_BLOCKS", "")
    if choice and choice not in BLOCKS_ISA_FLAGS:
        raise KernelUnavailable(f"GDNSPEC_CPU_BLOCKS={choice!r}: one of {sorted(BLOCKS_ISA_FLAGS)} or unset")
    return FLAGS + BLOCKS_ISA_FLAGS.get(choice, ())


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
    for part in (*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(flags()).encode(),
                 jaxlib.__version__.encode(), _cpu_features().encode(),
                 platform.machine().encode()):
        digest.update(part)
    cache = Path(os.environ.get("GDNSPEC_KERNEL_DIR") or Path.home() / ".cache" / "gdnspec" / "kernels")
    return cache / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def cxx() -> str:
    """The C++ compiler the kernels build with: $CXX, else g++, else c++."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    return compiler


def build(path: Path | None = None) -> Path:
    """Compile the library to `path` (default `library_path()`) unless it is there; returns its path. The build
    writes a temporary file and renames it, so concurrent builds (test workers) never load a partial library."""
    path = path or library_path()
    if path.exists():
        return path
    compiler = cxx()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler, *flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
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
    """Whether the CPU kernels (`rows_matmul`, `q8_rows_matmul`, `cpu_attention.paged_attention_cpu`,
    `cpu_gdn.gdn_recurrent_cpu`, `cpu_argmax.argmax_rows`, `cpu_conv.causal_conv_cpu`) can run here:
    the default backend is CPU, GDNSPEC_CPU_KERNEL is not 0, and the library builds and loads (the first call
    registers it with XLA; a failure is logged once)."""
    if os.environ.get("GDNSPEC_CPU_KERNEL", "1") == "0" or jax.default_backend() != "cpu":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as error:
        log.warning("the CPU kernels are unavailable, using XLA's products and attention: %s", error)
        return False
    _block_kernels.append(int(library.gdnspec_block_kernels()))
    for target in (TARGET, TARGET_Q8, TARGET_Q8_PROLOGUE, TARGET_BLOCKS, TARGET_BLOCKS_PROLOGUE, TARGET_ATTENTION, TARGET_ATTENTION_F16, TARGET_GDN,
                   TARGET_ARGMAX, TARGET_CONV, TARGET_CONV_PLANES):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    return True


_block_kernels: list[int] = []  # set by `available()`: 0, or the vector bits of the block products (256, 512)


def block_kernels() -> bool:
    """Whether the block products (`block_rows_matmul`) run here: the library is `available()` and was built for a
    CPU with AVX2, F16C and FMA."""
    return available() and _block_kernels[-1] > 0


def block_kernel_isa() -> str:
    """Which block products this machine's library has: "avx512-vnni" (512-bit products for the K-quants, on CPUs
    with AVX-512 BW, VL and VNNI), "avx2", or "" (none; the model dequantizes block weights with jnp)."""
    if not block_kernels():
        return ""
    return "avx512-vnni" if _block_kernels[-1] == 512 else "avx2"


# ggml types `block_rows_matmul` multiplies (gguf.GGMLQuantizationType values), and the activation type each
# quantizes x to, as llama.cpp's CPU backend does: Q8_0 for the 32-weight blocks, Q8_K for the super-blocks.
BLOCK_TYPES = {2: "Q8_0", 6: "Q8_0", 8: "Q8_0", 12: "Q8_K", 13: "Q8_K", 14: "Q8_K", 23: "Q8_K"}


def _live_rows(live: jax.Array | None, M: int) -> jax.Array:
    """live [M] (bool or int) as the kernels' int32 [M]; None: every row."""
    if live is None:
        return jnp.ones((M,), jnp.int32)
    if live.shape != (M,):
        raise ValueError(f"live must be [M] = [{M}], one flag per row of x; got {live.shape}")
    return live.astype(jnp.int32)


def _zero_dead_rows(y: jax.Array, live: jax.Array | None) -> jax.Array:
    return y if live is None else jnp.where(live.astype(bool)[:, None], y, 0.0)


def rows_matmul(x: jax.Array, w: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """x [M, K] float32 @ w [N, K]^T float32 -> [M, N] float32, by the kernel (requires `available()`).

    live [M] (optional): rows where it is false are padding, not computed, and come back as 0.
    Row m of the result depends on x[m] and w only, summed in the same order for every M (see cpu_matmul.cc)."""
    M, K = x.shape
    N, K_w = w.shape
    if K != K_w or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"rows_matmul takes float32 x [M, K] and w [N, K]; got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, _live_rows(live, M))


def rows_matmul_reference(x: jax.Array, w: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """The specification: x [M, K] @ w [N, K]^T -> [M, N] in float32 (XLA's dot), rows not live 0."""
    y = jnp.einsum("mk,nk->mn", x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return _zero_dead_rows(y, live)


def q8_rows_matmul(x: jax.Array, quants: jax.Array, scales: jax.Array, live: jax.Array | None = None) -> jax.Array:
    """x [M, K] float32 @ (quants [N, K] int8 * scales [N, K/32] float32, per block of 32)^T -> [M, N] float32,
    as llama.cpp computes a Q8_0 matmul on CPU: x's rows quantized to Q8_0, 8-bit products summed exactly per
    block, scaled and accumulated in float32 (see cpu_matmul.cc; requires `available()`). Any M; row m of the
    result depends on x[m], quants and scales only. live [M] (optional): rows where it is false are padding, not
    computed, and come back as 0."""
    M, K = x.shape
    N, K_q = quants.shape
    if (K != K_q or K % Q8_BLOCK or scales.shape != (N, K // Q8_BLOCK) or x.dtype != jnp.float32
            or quants.dtype != jnp.int8 or scales.dtype != jnp.float32):
        raise ValueError(f"q8_rows_matmul takes float32 x [M, K], int8 quants [N, K] and float32 scales [N, K/32], K a "
                         f"multiple of 32; got {x.dtype}{x.shape}, {quants.dtype}{quants.shape}, "
                         f"{scales.dtype}{scales.shape}")
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    return jax.ffi.ffi_call(TARGET_Q8, out, vmap_method="sequential")(x, quants, scales, _live_rows(live, M))


# The prologues of `q8_rows_matmul_prologue` (cpu_matmul.cc, "Prologues"), by the kernel's numbers.
PROLOGUES = {"rms_norm": 1, "swiglu": 2, "gated_rms_norm": 3}


def _prologue_operands(prologue: str, weight: jax.Array | None, gate: jax.Array | None):
    """(weight, gate) as the prologue kernels take them, float32, a placeholder for one the prologue has not; an
    error where the prologue's operands are missing or extra."""
    if (weight is None) != (prologue == "swiglu") or (gate is None) != (prologue != "gated_rms_norm"):
        raise ValueError(f"{prologue!r} takes {'no weight' if prologue == 'swiglu' else 'a weight'} and "
                         f"{'a gate' if prologue == 'gated_rms_norm' else 'no gate'}")
    nothing = jnp.zeros((1,), jnp.float32)
    return (nothing if weight is None else weight.astype(jnp.float32),
            nothing if gate is None else gate.astype(jnp.float32))


def q8_rows_matmul_prologue(prologue: str, x: jax.Array, quants: jax.Array, scales: jax.Array,
                            live: jax.Array | None = None, weight: jax.Array | None = None,
                            gate: jax.Array | None = None, eps: float = 0.0) -> jax.Array:
    """`q8_rows_matmul` of x after a prologue each live row goes through in the kernel, just before it is quantized
    (requires `available()`); `prologue_reference` is its specification:
      "rms_norm"        x [M, K], weight [K]:              x / sqrt(mean(x^2) + eps) * weight
      "swiglu"          x [M, 2K] (gate | up):             silu(gate) * up
      "gated_rms_norm"  x [M, K], weight [G], gate [M, K]: per group of G columns (K a multiple of G),
                                                           x / sqrt(mean(x^2) + eps) * weight * silu(gate)
    quants [N, K], scales [N, K/32] -> [M, N]; row m depends on row m of x (and of gate) only."""
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; one of {sorted(PROLOGUES)}")
    width = "2K" if prologue == "swiglu" else "K"
    K = x.shape[-1] // 2 if prologue == "swiglu" else x.shape[-1]
    if x.ndim != 2 or x.dtype != jnp.float32 or quants.shape[1] != K or K % Q8_BLOCK:
        raise ValueError(f"q8_rows_matmul_prologue({prologue!r}) takes float32 x [M, {width}] and quants [N, K], K a "
                         f"multiple of 32; got {x.dtype}{x.shape}, {quants.shape}")
    weight, gate = _prologue_operands(prologue, weight, gate)
    M = x.shape[0]
    out = jax.ShapeDtypeStruct((M, quants.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_Q8_PROLOGUE, out, vmap_method="sequential")(
        x, quants, scales, _live_rows(live, M), weight, gate, prologue=np.int32(PROLOGUES[prologue]),
        eps=np.float32(eps))  # fmt: skip


def prologue_reference(prologue: str, x: jax.Array, weight: jax.Array | None = None, gate: jax.Array | None = None,
                       eps: float = 0.0) -> jax.Array:
    """What `q8_rows_matmul_prologue` feeds its product, in jnp: x [..., K] (swiglu: [..., 2K]) -> [..., K]. The
    model's own `layers.rms_norm`, so that other weights multiply what they did before the prologues."""
    from jaxmodel.layers import rms_norm

    if prologue == "swiglu":
        g, u = jnp.split(x, 2, axis=-1)
        return jax.nn.silu(g) * u
    if prologue == "rms_norm":
        return rms_norm(x, weight, eps)
    groups = x.reshape(*x.shape[:-1], -1, weight.shape[0])
    return rms_norm(groups, weight, eps).reshape(x.shape) * jax.nn.silu(gate)


def _regroup_q8_rows(quants, scales, to_kernel: bool):
    """quants [N, K] and scales [N, K/32] between the file's order and the kernel's (`interleave_q8_rows`)."""
    xp = jnp if isinstance(quants, jax.Array) or isinstance(scales, jax.Array) else np
    N, K = quants.shape
    n_blocks, quads = K // Q8_BLOCK, Q8_BLOCK // Q8_QUAD
    full = N // Q8_ROW_GROUP * Q8_ROW_GROUP

    def regroup(q, s, g):  # q [n, K], s [n, n_blocks], n a multiple of g
        groups = q.shape[0] // g
        file_q, kernel_q = (groups, g, n_blocks, quads, Q8_QUAD), (groups, n_blocks, quads, g, Q8_QUAD)
        file_s, kernel_s = (groups, g, n_blocks), (groups, n_blocks, g)
        if to_kernel:
            return (q.reshape(file_q).transpose(0, 2, 3, 1, 4).reshape(q.shape),
                    s.reshape(file_s).transpose(0, 2, 1).reshape(s.shape))
        return (q.reshape(kernel_q).transpose(0, 3, 1, 2, 4).reshape(q.shape),
                s.reshape(kernel_s).transpose(0, 2, 1).reshape(s.shape))

    parts = [regroup(quants[:full], scales[:full], Q8_ROW_GROUP)] if full else []
    if N > full:
        parts.append(regroup(quants[full:], scales[full:], N - full))
    if len(parts) == 1:
        return parts[0]
    return xp.concatenate([q for q, _ in parts]), xp.concatenate([s for _, s in parts])


def interleave_q8_rows(quants, scales):
    """Q8_0 quants [N, K] int8 and scales [N, K/32] in the file's order -> the kernel's (numpy or jax arrays): rows in
    groups of Q8_ROW_GROUP = 8 (the last may hold fewer, g), each group stored block after block, and within a
    block, four bytes of each of its rows in turn (quad q: bytes 4q..4q+3 of row 0, of row 1, ...). One 32-byte
    vector then holds four consecutive quants of each of eight rows, one row per lane of an integer product, and a
    tile of a group's rows streams from one place. Scales: block after block, the group's g each.

    Example, two rows a, b of one block of 32 (one group of g = 2): quants a[0:4] b[0:4] a[4:8] b[4:8] ...
    a[28:32] b[28:32]; with two blocks, scales a0 b0 a1 b1."""
    return _regroup_q8_rows(quants, scales, to_kernel=True)


def file_order_q8_rows(quants, scales):
    """The inverse of `interleave_q8_rows`."""
    return _regroup_q8_rows(quants, scales, to_kernel=False)


def quantize_rows_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float32 -> (quants [M, K] int8, scales [M, K/32] float32): llama.cpp's quantize_row_q8_0 as its
    AVX2 path computes it (d = amax / 127 rounded to f16; q = x * (127 / amax), rounded to nearest, ties to even)."""
    M, K = x.shape
    blocks = x.reshape(M, K // Q8_BLOCK, Q8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inverse = jnp.where(amax != 0, jnp.float32(127) / jnp.where(amax != 0, amax, 1), 0)
    quants = jnp.round(blocks * inverse).astype(jnp.int8).reshape(M, K)
    scales = (amax[..., 0] / jnp.float32(127)).astype(jnp.float16).astype(jnp.float32)
    return quants, scales


def q8_rows_matmul_reference(x: jax.Array, quants: jax.Array, scales: jax.Array,
                             live: jax.Array | None = None) -> jax.Array:
    """The specification of `q8_rows_matmul`: x quantized by `quantize_rows_q8_0`, each block's integer dot
    product exact, scaled by both blocks' scales and summed in float32 (XLA's order, not the kernel's); quants and
    scales in the kernel's order; rows not live 0."""
    (M, K), N = x.shape, quants.shape[0]
    quants, scales = file_order_q8_rows(quants, scales)
    xq, xd = quantize_rows_q8_0(x)
    dots = jnp.einsum("mbi,nbi->mnb", xq.reshape(M, K // Q8_BLOCK, Q8_BLOCK).astype(jnp.int32),
                      quants.reshape(N, K // Q8_BLOCK, Q8_BLOCK).astype(jnp.int32))
    return _zero_dead_rows(jnp.sum(dots.astype(jnp.float32) * (xd[:, None, :] * scales[None, :, :]), axis=-1), live)


# Rows per group of the products over row groups (cpu_matmul.cc, "... row groups"), by ggml type: Q4_0 in groups of
# 8 (256-bit lanes), Q4_K, Q5_K and Q6_K in groups of 16 (512-bit lanes; only where the 512-bit forms build,
# `row_groups`).
ROW_GROUPS = {2: 8, 12: 16, 13: 16, 14: 16}
# A block's bytes in the row groups' order, as segments (start, stop, unit): within a group's block, each segment
# in turn, unit after unit, each unit's bytes of every row of the group in turn.
_GROUP_SEGMENTS = {
    2: ((0, 2, 2), (2, 18, 4)),  # Q4_0: d; 16 bytes of nibbles, four at a time
    12: ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 144, 4)),  # Q4_K: d; dmin; 12 scale bytes, one at a time; nibbles
    13: ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 48, 4), (48, 176, 4)),  # Q5_K: the same, fifth bits before nibbles
    14: ((0, 128, 4), (128, 192, 4), (192, 208, 1), (208, 210, 2)),  # Q6_K: ql; qh; 16 int8 scales; d
}


def row_groups() -> dict[int, int]:
    """The row groups this machine's block products take (ggml type -> rows per group): Q4_0 wherever they build,
    Q4_K, Q5_K and Q6_K where the 512-bit forms do."""
    if not block_kernels():
        return {}
    return {t: g for t, g in ROW_GROUPS.items() if g == 8 or block_kernel_isa() == "avx512-vnni"}


def _regroup_block_rows(blocks, qtype: int, to_kernel: bool):
    """Blocks [N, row_bytes] of a type in ROW_GROUPS between the file's order and the row groups'
    (`interleave_block_rows`)."""
    from jaxmodel.quant_blocks import FORMATS

    if int(qtype) not in ROW_GROUPS:
        raise ValueError(f"ggml type {qtype} has no row-group order (only Q4_0, Q4_K, Q5_K and Q6_K)")
    xp = jnp if isinstance(blocks, jax.Array) else np
    size, segments = FORMATS[int(qtype)].block_bytes, _GROUP_SEGMENTS[int(qtype)]
    group = ROW_GROUPS[int(qtype)]
    N, row = blocks.shape
    nb = row // size
    full = N // group * group

    def regroup(b, g, out):  # b [n, row], n a multiple of g; numpy fills out [n, row], jax returns the result
        groups = b.shape[0] // g
        result = b if out is None else out
        file = (b if to_kernel else result).reshape(groups, g, nb, size)
        kernel = (result if to_kernel else b).reshape(groups, nb, size * g)
        views = []  # (a segment in the file's order, the same in the kernel's), both [groups, nb, units, g, unit]
        for a, z, u in segments:
            views.append((file[..., a:z].reshape(groups, g, nb, (z - a) // u, u).transpose(0, 2, 3, 1, 4),
                          kernel[..., a * g : z * g].reshape(groups, nb, (z - a) // u, g, u)))
        if out is not None:  # segment by segment into the output: no copy of the whole weight but the output
            for there, here in views:
                np.copyto(here, there) if to_kernel else np.copyto(there, here)
            return out
        if to_kernel:
            return jnp.concatenate([there.reshape(groups, nb, -1) for there, _ in views], axis=-1).reshape(b.shape)
        return jnp.concatenate([here.transpose(0, 3, 1, 2, 4).reshape(groups, g, nb, -1) for _, here in views],
                               axis=-1).reshape(b.shape)

    out = np.empty_like(blocks) if xp is np else None
    parts = [regroup(blocks[:full], group, None if out is None else out[:full])] if full else []
    if N > full:
        parts.append(regroup(blocks[full:], N - full, None if out is None else out[full:]))
    if out is not None:
        return out
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def interleave_block_rows(blocks, qtype: int):
    """A Q4_0, Q4_K, Q5_K or Q6_K weight's blocks [N, row_bytes] (uint8, numpy or jax) in the file's order -> the row
    groups' order: rows in groups of ROW_GROUPS[qtype] (8 for Q4_0, 16 for the others; the last may hold fewer,
    g), each group block after block, a block's bytes for the g rows segment by segment (`_GROUP_SEGMENTS`), each
    segment unit by unit, a unit's bytes of every row in turn. Q4_0: the g f16 scales, then for q = 0..3 bytes
    4q..4q+3 of each row's nibbles, so a 32-byte vector of quad q holds weights 4q..4q+3 (low nibbles) and
    16+4q..16+4q+3 (high nibbles) of each of eight rows, one row per lane of an integer product. Q4_K: the g d's,
    the g dmin's, scale byte i of each row for i = 0..11, then the nibbles four bytes at a time (a 64-byte vector:
    four weights of two sub-blocks of each of sixteen rows); Q5_K likewise, its 32 bytes of fifth bits four at a
    time before the nibbles. Q6_K: ql and qh four bytes at a time, the 16 scale bytes one at a time, d.

    Example, two Q4_0 rows a, b (one group, g = 2) of one block: da db a[0:4] b[0:4] a[4:8] b[4:8] ... a[12:16]
    b[12:16] (a[i]: byte i of a's nibbles, weights i and 16 + i)."""
    return _regroup_block_rows(blocks, qtype, to_kernel=True)


def file_order_block_rows(blocks, qtype: int):
    """The inverse of `interleave_block_rows`."""
    return _regroup_block_rows(blocks, qtype, to_kernel=False)


def _check_blocks(name: str, K: int, blocks: jax.Array, qtype: int, row_group: int = 1) -> None:
    from jaxmodel.quant_blocks import FORMATS, row_bytes

    if int(qtype) not in BLOCK_TYPES:
        names = ", ".join(FORMATS[t].qtype.name for t in FORMATS if int(t) in BLOCK_TYPES)
        raise ValueError(f"{name}: no product for ggml type {qtype} (one of {names})")
    if row_group != 1 and row_groups().get(int(qtype)) != row_group:
        raise ValueError(f"{name}: no product for ggml type {qtype} in row groups of {row_group} (this machine's "
                         f"row groups: {row_groups()})")
    if blocks.ndim != 2 or blocks.dtype != jnp.uint8 or blocks.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"{name} takes uint8 blocks [N, {row_bytes(qtype, K)}] for K = {K}; got "
                         f"{blocks.dtype}{blocks.shape}")


def block_rows_matmul(x: jax.Array, blocks: jax.Array, qtype: int, live: jax.Array | None = None,
                      row_group: int = 1) -> jax.Array:
    """x [M, K] float32 @ dequant(blocks [N, K / block * block_bytes] uint8, ggml type qtype)^T -> [M, N] float32,
    as llama.cpp's CPU backend computes it: x's rows quantized to the type's activation format (`BLOCK_TYPES`), exact
    integer products per block (cpu_blocks.h; requires `block_kernels()`). Row m depends on x[m] and the weight
    only. live [M] (optional): rows where it is false are padding, not computed, and come back as 0.
    row_group: 1, blocks in the file's order; row_groups()[qtype], a weight in `interleave_block_rows`' order
    (each block's products summed as integers in one lane per weight row and scaled once for the group)."""
    M, K = x.shape
    _check_blocks("block_rows_matmul", K, blocks, qtype, row_group)
    out = jax.ShapeDtypeStruct((M, blocks.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_BLOCKS, out, vmap_method="sequential")(
        x.astype(jnp.float32), blocks, _live_rows(live, M), type=np.int32(qtype), row_group=np.int32(row_group))


def block_rows_matmul_prologue(prologue: str, x: jax.Array, blocks: jax.Array, qtype: int,
                               live: jax.Array | None = None, weight: jax.Array | None = None,
                               gate: jax.Array | None = None, eps: float = 0.0, row_group: int = 1) -> jax.Array:
    """`block_rows_matmul` of x after a prologue, as `q8_rows_matmul_prologue` (its operands and shapes)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; one of {sorted(PROLOGUES)}")
    K = x.shape[-1] // 2 if prologue == "swiglu" else x.shape[-1]
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"block_rows_matmul_prologue({prologue!r}) takes float32 x [M, K]; got {x.dtype}{x.shape}")
    _check_blocks("block_rows_matmul_prologue", K, blocks, qtype, row_group)
    weight, gate = _prologue_operands(prologue, weight, gate)
    M = x.shape[0]
    out = jax.ShapeDtypeStruct((M, blocks.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_BLOCKS_PROLOGUE, out, vmap_method="sequential")(
        x, blocks, _live_rows(live, M), weight, gate, type=np.int32(qtype), row_group=np.int32(row_group),
        prologue=np.int32(PROLOGUES[prologue]), eps=np.float32(eps))  # fmt: skip


def quantize_rows_q8_K(x: jax.Array) -> jax.Array:
    """x [M, K] float32 (K a multiple of 256) -> its Q8_K values d * q [M, K] as llama.cpp's quantize_row_q8_K
    makes them: per 256, the element of largest magnitude maps to -127, q = round(x / d) (half to even) capped at
    127."""
    M, K = x.shape
    blocks = x.reshape(M, K // 256, 256)
    at = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]  # the first of the largest, as llama.cpp's strict >
    peak = jnp.take_along_axis(blocks, at, axis=-1)
    iscale = jnp.where(peak != 0, jnp.float32(-127) / jnp.where(peak != 0, peak, 1), 0)
    q = jnp.minimum(jnp.round(iscale * blocks), 127)
    d = jnp.where(peak != 0, 1 / jnp.where(iscale != 0, iscale, 1), 0)
    return (q * d).reshape(M, K)


def block_rows_matmul_reference(x: jax.Array, blocks: jax.Array, qtype: int,
                                live: jax.Array | None = None, row_group: int = 1) -> jax.Array:
    """The specification of `block_rows_matmul`: the weight dequantized (`quant_blocks.dequantize`, ggml's
    values), x's rows quantized to the type's activation format and back, one float32 product (XLA's order, not
    the kernel's); rows not live 0."""
    from jaxmodel.quant_blocks import dequantize

    if row_group != 1:
        blocks = file_order_block_rows(blocks, qtype)

    M, K = x.shape
    if BLOCK_TYPES[int(qtype)] == "Q8_K":
        xq = quantize_rows_q8_K(x)
    else:
        q, d = quantize_rows_q8_0(x)
        xq = (q.reshape(M, K // Q8_BLOCK, Q8_BLOCK).astype(jnp.float32) * d[..., None]).reshape(M, K)
    w = dequantize(blocks, qtype)
    y = jnp.einsum("mk,nk->mn", xq, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return _zero_dead_rows(y, live)
