"""`retain_freed_memory`: a step's large temporaries, freed and allocated again, reuse their pages."""

import os
import platform
import subprocess
import sys

import pytest

# Allocates, touches and frees 96 MiB three times in a worker thread (as XLA's CPU runtime does with a step's
# temporaries) and prints the page faults each round took.
PROBE = """
import ctypes, resource, threading
from jaxmodel.host_memory import retain_freed_memory
print(retain_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(96 << 20)
        ctypes.memset(block, 1, 96 << 20)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        libc.free(block)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(*faults)
"""

PAGES = (96 << 20) // 4096

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")


def _probe(**env) -> tuple[bool, list[int]]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split("\n")
    return out[0] == "True", [int(n) for n in out[1].split()]


def test_freed_temporaries_are_reused_without_page_faults():
    retained, faults = _probe(GDNSPEC_SYSTEM_MALLOC="0")
    assert retained
    assert faults[0] > PAGES // 2  # the first round grows the heap
    assert max(faults[1:]) < PAGES // 100, faults


def test_system_malloc_opt_out_maps_fresh_pages_every_round():
    retained, faults = _probe(GDNSPEC_SYSTEM_MALLOC="1")
    assert not retained
    assert min(faults) > 0, faults  # 24,576 with 4 KiB pages; fewer where transparent huge pages are "always"
