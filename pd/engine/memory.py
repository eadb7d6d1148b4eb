"""Giving freed heap memory back to the operating system.

Prefill activations come in every chunk length. glibc serves them from its
heap and keeps what is freed for reuse, so fragments build up and a replica's
resident memory creeps upward (13% over a 5-minute soak, with no object
leaked). ``malloc_trim`` returns the free pages; the engine loop calls it now
and then and whenever it goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot (not glibc)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
