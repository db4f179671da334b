"""`retain_freed_memory`: a step's large temporaries, freed and allocated again, reuse their pages."""

import os
import subprocess
import sys

import pytest

from jaxmodel.host_memory import glibc

# Allocates, touches and frees a block three times in a worker thread (as XLA's CPU runtime does with a step's
# temporaries) and prints whether the settings took effect and the page faults each round took.
PROBE = """
import ctypes, resource, sys, threading
from jaxmodel.host_memory import retain_freed_memory
size, single_arena = int(sys.argv[1]), sys.argv[2] == "1"
print(retain_freed_memory(single_arena=single_arena))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        libc.free(block)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(*faults)
"""

WITHIN_THREAD_HEAP = 48 << 20  # glibc's thread heaps hold up to 64 MiB
BEYOND_THREAD_HEAP = 96 << 20  # the 0.8B shape's 4-token verify step allocates a 96 MB block

pytestmark = pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's")


def _probe(size: int, single_arena: bool = False, system_malloc: bool = False) -> tuple[bool, list[int]]:
    env = {**os.environ, "GDNSPEC_SYSTEM_MALLOC": "1" if system_malloc else "0"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(size), "1" if single_arena else "0"], env=env,
                         capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split("\n")
    return out[0] == "True", [int(n) for n in out[1].split()]


@pytest.mark.parametrize("size, single_arena", [(WITHIN_THREAD_HEAP, False), (BEYOND_THREAD_HEAP, True)])
def test_freed_temporaries_are_reused_without_page_faults(size, single_arena):
    retained, faults = _probe(size, single_arena)
    pages = size // 4096
    assert retained
    assert faults[0] > 0  # the first round grows the heap (pages // 2 or more with 4 KiB pages)
    assert max(faults[1:]) < pages // 100, faults


def test_a_block_beyond_a_thread_heap_needs_the_single_arena():
    retained, faults = _probe(BEYOND_THREAD_HEAP, single_arena=False)
    assert retained
    assert min(faults) > 0, faults


def test_system_malloc_opt_out_maps_fresh_pages_every_round():
    retained, faults = _probe(WITHIN_THREAD_HEAP, system_malloc=True)
    assert not retained
    assert min(faults) > 0, faults  # 12,288 with 4 KiB pages; fewer where transparent huge pages are "always"
