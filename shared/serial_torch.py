"""`serial_torch_here`: torch ops of the calling thread run serially, no other thread's change.

Converting a vocabulary-sized vector between float32 and float16 takes one short torch op
serially. On a thread whose OpenMP team has several threads, an op that large is handed to
the team, whose threads then spin for milliseconds on other cores; cut into pieces below
ATen's grain size (`shared.wire.cast_in_chunks`) it costs several times the op in Python and
dispatch.
Threads that only move vectors (a worker's event loop, a client's reply thread) want
neither: they run torch ops serially.

``torch.set_num_threads`` cannot say that for one thread: it also sets the default of every
thread that first runs torch later (the user's main thread included, in a client). OpenMP's
own ``omp_set_num_threads`` sets the calling thread's team size alone, so that is called,
through ctypes, on the libgomp torch loaded. Where there is none (another OpenMP runtime,
torch not imported), nothing changes and conversions keep their pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["serial_torch_here", "serial_torch", "serial_here", "imported_torch"]

_state = threading.local()
_LIBGOMP: list[Any] = []


def serial_torch_here() -> bool:
    """Make torch ops of this thread serial (once per thread); whether they are now.

    Only where torch is imported already: a numpy-only client never loads it for this.
    """
    done = getattr(_state, "serial", None)
    if done is not None:
        return bool(done)
    torch = imported_torch()
    if torch is None:
        return False
    torch.get_num_threads()  # this thread's lazy init first: it would undo what follows
    omp = _libgomp()
    if omp is not None:
        omp.omp_set_num_threads(1)
    _state.serial = torch.get_num_threads() == 1
    return bool(_state.serial)


@contextlib.contextmanager
def serial_torch() -> Iterator[bool]:
    """Torch ops of this thread run serially inside the block (yields whether they do), and
    with this thread's team size of before after it."""
    torch = imported_torch()
    omp = _libgomp() if torch is not None else None
    if torch is None or omp is None:
        yield False
        return
    before = torch.get_num_threads()
    omp.omp_set_num_threads(1)
    try:
        yield torch.get_num_threads() == 1
    finally:
        omp.omp_set_num_threads(before)


def serial_here() -> bool:
    """Whether torch ops of this thread run serially now (one torch thread)."""
    torch = imported_torch()
    return torch is not None and torch.get_num_threads() == 1


def imported_torch() -> Any:
    """torch, if some thread imported it already (completely: not still importing), else None."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def _libgomp() -> Any:
    """The GNU OpenMP runtime torch uses, or None (call with torch imported)."""
    if not _LIBGOMP:
        _LIBGOMP.append(_find_libgomp(sys.modules["torch"]))
    return _LIBGOMP[0]


def _find_libgomp(torch: Any) -> Any:
    """Of the libgomp copies loaded (torch ships its own; another library may load the
    system's), the one whose team size torch's ops follow, tried on a thread of its own."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    home = str(getattr(torch, "__file__", "")).rsplit("/", 1)[0]
    for path in sorted(paths, key=lambda p: (not p.startswith(home), p)):
        try:
            library = ctypes.CDLL(path)
            library.omp_set_num_threads.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            continue
        if _governs(library, torch):
            return library
    return None


def _governs(library: Any, torch: Any) -> bool:
    """Whether `library`'s ``omp_set_num_threads`` sets torch's team size (on a thread that
    ends at once, so no thread of the process keeps the setting)."""
    seen: list[int] = []

    def probe() -> None:
        torch.get_num_threads()
        library.omp_set_num_threads(1)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=probe, name="lmq-libgomp-probe")
    thread.start()
    thread.join()
    return seen == [1]
