"""`Backoff`: the one definition of how lmqueue's loops space their retries while Redis is away.

A loop that must never give up (a client's submitter and reply reader, the cluster client's
rebuild of its node list) waits 50 ms after the first failure, twice as long after each next
one up to a ceiling, and starts again from 50 ms after a success. Doubling keeps a dead
Redis from being dialled hundreds of times a second by every waiting task; the ceiling keeps
the wait after Redis returns short. Callers' deadlines, not the backoff, decide when a request
stops waiting.
"""

from __future__ import annotations

import asyncio

__all__ = ["Backoff"]


class Backoff:
    """Exponential delays between retries, reset by a success.

    Args:
        first_s: the delay after the first failure of a streak.
        max_s: the longest delay.
    """

    def __init__(self, first_s: float = 0.05, max_s: float = 2.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s
        #: Failures since the last success.
        self.failures = 0

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed (a streak of failures is under way)."""
        return self.failures > 0

    def delay_s(self) -> float:
        """Count a failure; the delay to wait before the next attempt."""
        self.failures += 1
        delay_s = self._next_s
        self._next_s = min(self._next_s * 2, self.max_s)
        return delay_s

    async def wait(self) -> None:
        """Count a failure and sleep the delay before the next attempt."""
        await asyncio.sleep(self.delay_s())

    def reset(self) -> bool:
        """Count a success; return whether it ended a streak of failures."""
        ended = self.failures > 0
        self.failures = 0
        self._next_s = self.first_s
        return ended
