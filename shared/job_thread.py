"""`JobThread`: one thread that runs an event loop's blocking jobs in order, cheaply.

A worker's reply writer and a client's reply reader each hand one job per batch to a thread
of their own. ``loop.run_in_executor`` costs the loop ~3x what this does per job (a
`concurrent.futures.Future` chained to an asyncio one, a work item, the pool's semaphore):
here a job is a tuple on a `queue.SimpleQueue`, and its result comes back through one
``call_soon_threadsafe``. The thread is a daemon: a job blocked on a dead peer never holds
the interpreter's exit; `close` ends it once the jobs queued before have run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["JobThread"]

T = TypeVar("T")


class JobThread:
    """Runs jobs (plain functions) one at a time, in submission order, on its own thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether the thread runs (started by a job, not closed since)."""
        return self._thread is not None

    def submit(self, job: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``job(*args)``; a future of the running loop settled with its outcome.

        Cancelling the future does not stop the job; its outcome is then dropped.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self.jobs += 1
        self._queue.put((loop, future, job, args))
        return future

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """Run ``job(*args)`` on the thread after the jobs queued before it; its result."""
        return await self.submit(job, *args)

    def close(self, last: Callable[[], Any] | None = None) -> None:
        """End the thread after the jobs queued so far (and `last`, if given) have run.

        A later `submit` starts a new thread.
        """
        if self._thread is None:
            return
        if last is not None:
            self._queue.put((None, None, last, ()))
        self._queue.put(None)
        self._thread = None

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, job, args = item
            try:
                outcome: tuple[Any, BaseException | None] = (job(*args), None)
            except BaseException as exc:  # handed to the awaiting coroutine
                outcome = (None, exc)
            if loop is None:
                continue
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
