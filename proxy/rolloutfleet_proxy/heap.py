"""Returning freed heap pages to the OS with glibc's malloc_trim, where it exists."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("rolloutfleet.proxy.heap")


def resolve_malloc_trim() -> Callable[[int], int] | None:
    """Look the symbol up once; musl and non-glibc platforms have none (AttributeError/OSError)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


M_ARENA_MAX = -8  # glibc mallopt parameter


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas (as MALLOC_ARENA_MAX does) before worker threads start: each thread
    that tokenizes a large turn otherwise gets an arena of its own, and the hundreds of MiB the
    tokenizer's native code used there stay mapped after it is freed. False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1


class HeapTrimmer:
    """Call `trim` from a worker thread: malloc_trim can take long on a big heap."""

    def __init__(self, enabled: bool = True, trim_fn: Callable[[int], int] | None = None):
        self._trim = (trim_fn or resolve_malloc_trim()) if enabled else None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> bool:
        if self._trim is None:
            return False
        try:
            self._trim(0)
        except (OSError, AttributeError) as exc:
            log.warning("malloc_trim failed, disabling heap trimming: %s", exc)
            self._trim = None
            return False
        self.trims += 1
        return True
