"""Keep the host heap's freed memory for reuse instead of handing it back to the kernel after every step.

XLA's CPU runtime allocates each step's temporaries with `malloc` and frees them when the step ends. glibc serves
an allocation above its mmap threshold (at most 32 MiB), or any allocation too big for a thread's 64 MiB heap,
with a fresh `mmap` and returns it with `munmap` on free, so every step touches new pages: at the Qwen3.5-0.8B
shape one 4-token verify step maps a 96 MB temporary from an XLA worker thread and takes 23,000 page faults
(about a quarter of its CPU time in the kernel). With one arena, no mmap and no trimming, the same step takes none.

`retain_freed_memory()` sets that up through `mallopt`. It must run before the XLA CPU client starts its threads
(a thread keeps the arena it first allocated from), so the command line calls it first thing and `load_model`
calls it again for library users. GDNSPEC_SYSTEM_MALLOC=1 leaves glibc's defaults alone. Elsewhere than glibc it
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


@functools.cache
def retain_freed_memory() -> bool:
    """Configure glibc malloc to reuse freed memory (see the module docstring). True if it took effect."""
    if os.environ.get("GDNSPEC_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(option, value) == 1 for option, value in settings)
