"""`keep_freed_vectors_mapped`: a process reuses the memory of vectors it freed.

A client receives a 100-600 KB vector per reply into memory of its own, and frees it when
the program drops the result (or the local cache evicts it). glibc serves blocks from 128 KB
by a fresh ``mmap`` (zeroed pages, faulted in by the receiving copy) and returns the top of
its heap to the OS past a small threshold, so every vector arrived in new pages: a 196 KB
receive cost 62 CPU us of kernel time instead of 36 (11 page faults against 1; measured here
on 64-vector reads). Blocks up to 4 MB then come from the heap, and up to 64 MB of freed heap
top stays mapped: memory this process held a moment before, reused by the next vectors.

Process-wide, so a client does it once, unless told not to (``ClientSettings.heap_reuse``,
``LMQ_HEAP_REUSE=0``); workers fix their own thresholds (`workers.main`).
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["keep_freed_vectors_mapped"]

logger = logging.getLogger(__name__)

_MMAP_THRESHOLD_BYTES = 4 << 20
_TRIM_THRESHOLD_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_done: list[bool] = []


def keep_freed_vectors_mapped() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process; whether they are set."""
    if _done:
        return _done[0]
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):  # not glibc
        done = False
    logger.debug("malloc thresholds raised for vector reuse: %s", done)
    _done.append(done)
    return done
