"""`ClaimKeeper`: a batch's entries stay claimed while it runs, at the cost of a timer.

A janitor hands an entry idle for ``claim_idle_ms`` to another worker, so a batch that runs
longer resets its entries' idle time every third of that (`RequestStream.touch`). Nearly every
batch ends long before the first reset is due; a task started for each one (created, cancelled,
awaited) was ~25 CPU us of the worker's loop a batch, where a timer cancelled unfired is ~3.
The keeper arms the timer, and only a batch still running when it fires gets a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["ClaimKeeper"]


class ClaimKeeper:
    """Calls `touch` every `interval_s` from `interval_s` after it is made until `stop`.

    Made on the running loop. A `touch` that raises ends the keeping (`touch` handles its own
    Redis trouble); `stop` waits for a touch under way to finish or be cancelled.
    """

    def __init__(self, touch: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self._touch = touch
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval_s, self._start)

    @property
    def started(self) -> bool:
        """Whether the batch ran long enough to need touches (a task runs them)."""
        return self._task is not None

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        while True:
            await self._touch()
            await asyncio.sleep(self._interval_s)

    async def stop(self) -> None:
        """No more touches: the timer cancelled, or the task cancelled and awaited."""
        self._timer.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
