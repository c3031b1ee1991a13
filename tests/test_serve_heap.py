"""serve.heap: the glibc settings keep freed activations from staying resident, and the trim hands pages back.

Each case runs in a fresh interpreter (heap settings are per process and must come before the blocks they
govern): it frees one 8 MB block (glibc then slides its mmap threshold above 3 MB), allocates 32 blocks of
3 MB, each followed by a 256 KB block that stays live, frees the 3 MB blocks and prints how many MB of
resident memory they left behind.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from serve.heap import malloc_trim, tune_heap

PROBE = r"""
import ctypes, sys
from serve.heap import malloc_trim, tune_heap
if sys.argv[1] == "tuned":
    assert tune_heap(arena_max=2, mmap_threshold=1 << 20) == {"arena_max": True, "mmap_threshold": True}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
first = libc.malloc(8 << 20); ctypes.memset(first, 1, 8 << 20); libc.free(first)
r0, big, pins = rss(), [], []
for _ in range(32):
    b = libc.malloc(3 << 20); ctypes.memset(b, 1, 3 << 20); big.append(b)
    pins.append(libc.malloc(256 << 10))
for b in big:
    libc.free(b)
if sys.argv[1] == "trimmed":
    malloc_trim()(0)
print(rss() - r0)
"""


def _left_behind_mb(case: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, case], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc_trim() is None or not sys.platform.startswith("linux"), reason="glibc (Linux) only")
def test_fixed_mmap_threshold_returns_freed_blocks_and_trim_returns_heap_pages():
    plain, tuned, trimmed = (_left_behind_mb(c) for c in ("plain", "tuned", "trimmed"))
    assert plain > 64  # glibc's sliding default: the 3 MB blocks came from the heap and stay resident
    assert tuned < 8  # mmapped: gone on free
    assert trimmed < 8  # malloc_trim gives the free pages between the live blocks back


def test_tune_heap_refuses_impossible_settings():
    with pytest.raises(ValueError, match="arena_max must be >= 1"):
        tune_heap(arena_max=0)
    with pytest.raises(ValueError, match="mmap_threshold must be in"):
        tune_heap(arena_max=None, mmap_threshold=64 << 20)
