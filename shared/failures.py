"""How a command-line program reports a failure: one line naming the error and what to do.

Used by every ``lmq`` command and by ``python -m lmqueue.workers``. The traceback is for developers
and shows only with ``--verbose``; the line says which error it was, its message, and the
likeliest remedy, naming the real thing (the setting, the input, the models served), and the
exit code says whether the command line names something that cannot work (2: a bad setting
or input, a model nobody serves, a file that cannot be read, a wrong user or password or a
permission the user lacks) or something failed (1). Every line passes through
`mask_secrets`: a password in a URL is never printed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import NoReturn, TextIO

from .errors import (
    AuthenticationFailed,
    BadRequest,
    Busy,
    EmptyPrompt,
    Forbidden,
    LMQueueError,
    OversizeRequest,
    SettingsError,
    Unavailable,
    UnknownModel,
)
from .settings import mask_secrets

__all__ = [
    "ArgumentParser",
    "configure_logging",
    "report_failure",
    "remedy",
    "USAGE_EXIT",
    "FAILURE_EXIT",
    "INTERRUPTED_EXIT",
]

USAGE_EXIT = 2
FAILURE_EXIT = 1
INTERRUPTED_EXIT = 130

_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (Unavailable, "is Redis running and reachable at that address? set --redis-url or "
     "LMQ_REDIS_URL"),
    (AuthenticationFailed, "check the user and password in the URL; the operator issues a new "
     "one with `lmq tenant set NAME --new-password`"),
    (Forbidden, "this Redis user lacks the permission: ask the operator (lmq tenant ...)"),
    (Busy, "the queue is full or a quota is reached: retry later"),
    (OversizeRequest, "send a shorter prompt, or raise LMQ_MAX_REQUEST_BYTES on the workers"),
    (EmptyPrompt, "give a prompt of at least one token"),
)  # fmt: skip
#: Errors that say the command line itself cannot work as given.
_USAGE: tuple[type[BaseException], ...] = (SettingsError, BadRequest, UnknownModel, Forbidden)


def remedy(error: LMQueueError) -> str:
    """What to do about `error`: its own ``remedy`` if it carries one, else its kind's."""
    own = error.data.get("remedy")
    if isinstance(own, str) and own:
        return own
    if isinstance(error, UnknownModel):
        known = error.data.get("known")
        served = ", ".join(known) if isinstance(known, list) and known else "none"
        return f"models served here: {served}; or start a worker: lmq worker --model NAME"
    return next((text for cls, text in _HINTS if isinstance(error, cls)), "")


def report_failure(
    prog: str, error: BaseException, verbose: bool = False, stream: TextIO | None = None
) -> int:
    """Print `error` as one line (and its traceback if `verbose`); return the exit code."""
    stream = stream or sys.stderr
    if verbose:
        text = "".join(traceback.format_exception(error))
        print(mask_secrets(text), end="", file=stream)
    if isinstance(error, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=stream)
        return INTERRUPTED_EXIT
    if isinstance(error, LMQueueError):
        hint = remedy(error)
        line = f"{prog}: {type(error).__name__}: {error.message}"
        print(mask_secrets(f"{line} ({hint})" if hint else line), file=stream)
        return USAGE_EXIT if isinstance(error, _USAGE) else FAILURE_EXIT
    if isinstance(error, OSError) and error.filename is not None:
        # a file named on the command line (--data, --config, a prompt file) cannot be read
        print(mask_secrets(f"{prog}: cannot read {error.filename}: {error.strerror}"), file=stream)
        return USAGE_EXIT
    more = "" if verbose else "; run with --verbose for the traceback"
    print(mask_secrets(f"{prog}: unexpected {type(error).__name__}: {error}{more}"), file=stream)
    return FAILURE_EXIT


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors mask URL passwords (``unrecognized arguments:
    --redis-url redis://admin:***@...``); its subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE_EXIT, mask_secrets(f"{self.prog}: error: {message}\n"))


class _MaskingFilter(logging.Filter):
    """Masks every URL password in a record's message before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


def configure_logging(level: str | int = "INFO", fmt: str | None = None) -> None:
    """Log to stderr at `level` (unless logging is set up already), every handler of the
    root logger masking URL passwords."""
    fmt = fmt or "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _MaskingFilter) for f in handler.filters):
            handler.addFilter(_MaskingFilter())
