"""The C heap of a long-running CPU server: glibc settings that keep its RSS flat, and a trim.

A serving process allocates activations of every size on several threads (the engine's forwards,
the tokenizer, the HTTP loop). Two glibc defaults make its resident memory creep for many minutes
although nothing leaks:

* **Arenas**: every thread that meets a locked arena gets one of its own, up to 8 per core, and
  a free chunk in one arena is never reused by another thread's arena.
* **The sliding mmap threshold**: a block above 128 KB is mmapped and goes back to the OS when
  freed, but freeing one raises the threshold to its size (up to 32 MB), so later blocks of that
  size come from the heap, where one live small chunk above them keeps all their pages resident.

:func:`tune_heap` caps the arenas and fixes the threshold (the server calls it first thing, before
any thread exists); :func:`malloc_trim` hands free heap pages back (the engine's loop calls it
every few seconds). Both are no-ops (None / False) on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

# glibc's <malloc.h> parameter numbers for mallopt
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


@functools.cache  # find_library may run ldconfig: once per process
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- both exist on glibc only
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)`` (returns free heap pages to the OS), or None on other C libraries."""
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


def tune_heap(arena_max: int | None = 2, mmap_threshold: int | None = 1 << 20) -> dict[str, bool]:
    """Cap glibc's arenas at ``arena_max`` and mmap every block of at least ``mmap_threshold`` bytes.

    Call before the process starts threads (arenas made before stay). None leaves that setting at
    glibc's default. Returns which settings took (``{"arena_max": bool, "mmap_threshold": bool}``):
    all False off glibc. A fixed threshold also stops glibc from sliding it (see the module doc);
    blocks above it cost one mmap + munmap and their page faults each, small next to the forward
    that uses them.
    """
    if arena_max is not None and arena_max < 1:
        raise ValueError(f"arena_max must be >= 1 (or None: glibc's default), got {arena_max}")
    if mmap_threshold is not None and not 0 < mmap_threshold <= 32 << 20:
        raise ValueError(f"mmap_threshold must be in (0, 32 MiB] bytes (or None: glibc's default), got {mmap_threshold}")
    done = {"arena_max": False, "mmap_threshold": False}
    libc = _glibc()
    if libc is None:
        return done
    if arena_max is not None:
        done["arena_max"] = libc.mallopt(M_ARENA_MAX, arena_max) == 1
    if mmap_threshold is not None:
        done["mmap_threshold"] = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    return done
