"""`WriterThread`: the worker's thread that writes batches' replies, off the event loop.

Writing a batch's replies is mostly the kernel copying vectors into sockets. On the event loop
that copy ran in 64 KiB steps, a wake-up and a callback each once the socket was full, and
the loop (so the next batch's reading, decoding and answering) waited behind it. Here one
thread per worker owns blocking connections (`RespSocket`, one per Redis node it writes to)
and each batch's writes run there as one job, in the order batches finish: one ``sendmsg``
per pipeline, with the GIL released while the kernel copies. The event loop meanwhile
reads and computes the next batch, so a worker is not capped by one Python core.

Jobs run one at a time, in submission order. `aclose` ends the thread after the jobs queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lmqueue.shared.job_thread import JobThread
from lmqueue.shared.resp_socket import RespSocket, Target

__all__ = ["WriterThread"]

T = TypeVar("T")


class WriterThread:
    """One writer thread and its connections; jobs are functions run there, in order."""

    def __init__(self, connect_timeout_s: float = 5.0, timeout_s: float = 10.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._thread = JobThread("lmq-reply-writer")
        self._sockets: dict[tuple[Any, ...], RespSocket] = {}

    @property
    def jobs(self) -> int:
        """Jobs submitted so far."""
        return self._thread.jobs

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """Run ``job(*args)`` on the thread, after the jobs submitted before it."""
        return await self._thread.run(job, *args)

    def socket(self, target: Target) -> RespSocket:
        """The thread's connection to `target` (only jobs call this, on the thread)."""
        key = tuple(sorted(target.items()))
        sock = self._sockets.get(key)
        if sock is None:
            sock = self._sockets[key] = RespSocket(target, self.connect_timeout_s, self.timeout_s)
        return sock

    async def aclose(self) -> None:
        """Finish the queued jobs, close the connections and end the thread (idempotent).

        A later `run` starts a new thread (a worker serving again after `run_until_idle`).
        """
        if not self._thread.running:
            return
        await self._thread.run(self._close_sockets)
        self._thread.close()

    def _close_sockets(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
