"""The worker's event loop: uvloop's where it is installed, else the standard library's.

A worker's loop does per-request Python (decoding, keys, the fair share) and, per batch, a
dozen turns of the loop itself (a read, the hand-off to the writer thread, the backend's
batching turn). uvloop runs the turns and their callbacks in C: the loop's CPU a float16 reply
in the transport benchmark's scale runs was 5-7% lower on it (medians of four alternated
pairs, 43 against 45.5 us on the cluster; BENCHMARKS.md, transport), and the loop's CPU is what
caps one worker's replies per second.

It is a choice of the worker process only (``LMQ_EVENT_LOOP``): a client runs on whatever loop
its program runs, uvloop's included (tests/test_end_to_end.py). Nothing in the worker depends
on which: its connection code takes CPython's socket transport where it finds one and writes
through any other transport otherwise (`shared.connections`), as over TLS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.settings import EVENT_LOOPS

__all__ = ["loop_factory", "run_on", "loop_name"]

T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of `choice`'s loop (None: the standard library's).

    Raises:
        SettingsError: `choice` is "uvloop" and uvloop is not installed, or is unknown.
    """
    if choice == "asyncio":
        return None
    if choice not in EVENT_LOOPS:
        raise SettingsError(f"event_loop={choice!r}: expected {', '.join(EVENT_LOOPS)}")
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SettingsError(
                "event_loop='uvloop' but uvloop is not installed (pip install uvloop; "
                "LMQ_EVENT_LOOP=auto falls back to asyncio's loop)"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_on(choice: str, main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on `choice`'s loop."""
    try:
        factory = loop_factory(choice)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """ "uvloop" or "asyncio": what the startup line says the worker runs on."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
