"""Keep the host heap's freed memory for reuse instead of handing it back to the kernel after every step.

XLA's CPU runtime allocates each step's temporaries with `malloc` and frees them when the step ends. glibc serves
an allocation above its mmap threshold (which grows to at most 32 MiB) with a fresh `mmap` and returns it with
`munmap` on free, and hands the freed top of a heap back to the kernel, so every step touches new pages: at the
Qwen3.5-0.8B shape a one-token decode step took 10,000 page faults, a quarter of its CPU time in the kernel.
Without mmap and without trimming, freed blocks stay in the heaps and the next step reuses them without a fault.

A block bigger than a thread arena's 64 MiB heap is still mapped fresh: XLA allocates a step's temporaries as one
block from a worker thread, 96 MB for the 0.8B's 4-token verify step. Only the main arena (grown with `brk`)
keeps such blocks, so for models whose steps have them `single_arena` sends every thread there. It is not the
default because the threads then share one lock for every allocation: on the bundled model, whose steps are
short and allocate often, one stream lost about a third of its throughput to that lock.

`retain_freed_memory` sets this up through `mallopt`; `load_model` calls it, from the model's GDN state size,
before JAX starts its threads (a thread keeps the arena it first allocates from), and when the weights are on the
device it hands back what loading freed (`release_freed_memory`): without trimming, the file's dequantized copies
would stay in the process for good. GDNSPEC_SYSTEM_MALLOC=1 leaves glibc's defaults alone. Elsewhere than glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

THREAD_HEAP_BYTES = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: the largest block a thread arena's heap holds


def glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (whose `mallopt` and `malloc_trim` this module uses), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


@functools.cache
def retain_freed_memory(single_arena: bool = False) -> bool:
    """Configure glibc malloc to reuse freed memory (see the module docstring). True if it took effect.

    single_arena: every thread allocates from the main arena, which also keeps blocks above THREAD_HEAP_BYTES;
    for threads that have not allocated yet."""
    libc = glibc()
    if libc is None or os.environ.get("GDNSPEC_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)) + (((M_ARENA_MAX, 1),) if single_arena else ())
    return all(mallopt(option, value) == 1 for option, value in settings)


def release_freed_memory() -> None:
    """Hand the heaps' free pages back to the kernel now (`malloc_trim`), once, after a burst of garbage such as
    loading weights; the step's temporaries are allocated again, and kept, on the next call."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
