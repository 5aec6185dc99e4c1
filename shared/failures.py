"""How a command-line program reports a failure: one line naming the error and what to do.

Used by every ``lmq`` command and by ``python -m lmqueue.workers``. The traceback is for developers
and shows only with ``--verbose``; the line says which error it was, its message, and the
likeliest remedy, and the exit code says whether the command line names something that
cannot work (2: a bad setting or input, a model nobody serves) or something failed (1).
"""

from __future__ import annotations

import sys
import traceback
from typing import TextIO

from .errors import (
    BadRequest,
    Busy,
    Forbidden,
    LMQueueError,
    SettingsError,
    Unavailable,
    UnknownModel,
)

__all__ = ["report_failure", "USAGE_EXIT", "FAILURE_EXIT", "INTERRUPTED_EXIT"]

USAGE_EXIT = 2
FAILURE_EXIT = 1
INTERRUPTED_EXIT = 130

_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (SettingsError, "fix the flag or LMQ_* variable named above"),
    (Unavailable, "is Redis running and reachable at the URL? set --redis-url or LMQ_REDIS_URL"),
    (Forbidden, "this Redis user lacks the permission: ask the operator (lmq tenant ...)"),
    (UnknownModel, "start a worker for it: lmq worker --model NAME --redis-url URL"),
    (Busy, "the queue is full or a quota is reached: retry later"),
    (BadRequest, "check the input named above"),
)


def report_failure(
    prog: str, error: BaseException, verbose: bool = False, stream: TextIO | None = None
) -> int:
    """Print `error` as one line (and its traceback if `verbose`); return the exit code."""
    stream = stream or sys.stderr
    if verbose:
        traceback.print_exception(error, file=stream)
    if isinstance(error, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=stream)
        return INTERRUPTED_EXIT
    if isinstance(error, LMQueueError):
        hint = next((text for cls, text in _HINTS if isinstance(error, cls)), "")
        line = f"{prog}: {type(error).__name__}: {error.message}"
        print(f"{line} ({hint})" if hint else line, file=stream)
        usage = isinstance(error, (SettingsError, BadRequest, UnknownModel))
        return USAGE_EXIT if usage else FAILURE_EXIT
    more = "" if verbose else "; run with --verbose for the traceback"
    print(f"{prog}: unexpected {type(error).__name__}: {error}{more}", file=stream)
    return FAILURE_EXIT
