"""Stage marks: where a request's round trip spends its milliseconds, across processes.

A diagnostic for the scheduling questions a profile cannot answer (who waited for whom, and
how long the backend idled: BENCHMARKS.md, fairness). Off by default: a mark is then one call
that returns. A process that calls `start(directory, role)` appends a line per mark to
``<directory>/<role>-<pid>.txt``: ``<monotonic seconds> <stage> <details>``. The monotonic
clock is the machine's, so the files of a worker, its clients and a benchmark line up
(``lmqueue.bench.lib.stage_report`` reads them).

The sink is process-wide, like logging's: marks come from the worker's event loop, its writer
thread and a client's reply path, which would otherwise each need it passed down. Lines are
buffered and written in blocks, and at `stop` or exit; `start` is called once, in a process's
``main`` (a worker: ``LMQ_STAGE_TRACE_DIR``) or by a benchmark for itself.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["enabled", "mark", "start", "stop"]

#: Lines kept before they are written out together.
_BLOCK_LINES = 4096

_lock = threading.Lock()
_lines: list[str] = []
_path: Path | None = None


def enabled() -> bool:
    """Whether marks are recorded (build costly details only then)."""
    return _path is not None


def mark(stage: str, *details: Any) -> None:
    """Record that this process reached `stage` now (nothing unless started)."""
    if _path is None:
        return
    line = f"{time.monotonic():.6f} {stage} {' '.join(map(str, details))}\n"
    with _lock:
        _lines.append(line)
        full = len(_lines) >= _BLOCK_LINES
    if full:
        _write()


def start(directory: str | Path, role: str) -> Path:
    """Record this process's marks under `directory` (created if missing); the file's path."""
    global _path
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    atexit.unregister(stop)  # one registration, however many recordings a process starts
    atexit.register(stop)
    _path = folder / f"{role}-{os.getpid()}.txt"
    return _path


def stop() -> None:
    """Write what is buffered and record no more (idempotent)."""
    global _path
    _write()
    _path = None


def _write() -> None:
    with _lock:
        lines, _lines[:] = list(_lines), []
        path = _path
    if path is not None and lines:
        with path.open("a") as out:
            out.writelines(lines)
