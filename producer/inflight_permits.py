"""`InflightPermits`: how many requests a client may have in flight, first come first served.

It does what ``asyncio.Semaphore`` does, with an uncontended take that is two attribute checks:
``Semaphore.locked()`` walks its waiters through a generator, twice per ``acquire``: a few
percent of a call's CPU in the transport benchmark (BENCHMARKS.md, transport).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["InflightPermits"]


class InflightPermits:
    """`count` permits; `take` waits for one in arrival order, `release` gives one back."""

    def __init__(self, count: int) -> None:
        self._value = count  # free permits (asyncio.Semaphore's name, which tests look at)
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def free(self) -> int:
        """InflightPermits nobody holds."""
        return self._value

    def take_now(self) -> bool:
        """Take a permit if one is free and nobody is waiting for one; whether it was taken."""
        if self._value > 0 and not self._waiters:
            self._value -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a permit. A caller cancelled while waiting takes none (or gives it back)."""
        if self.take_now():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a permit as it was cancelled
                self.release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give a permit back: to the longest waiter, or to the free count."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._value += 1
