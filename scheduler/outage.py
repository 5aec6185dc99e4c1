"""Riding out a Redis outage: the scheduler keeps its process, its jobs and its leases' meaning.

Workers and clients retry while Redis is away (`shared.redis_errors.REDIS_DOWN`); the
scheduler does the same in its three places that talk to Redis on their own:

- arq's poll loop (`ResilientWorker`): a poll that cannot reach Redis is logged once and
  retried with backoff (0.25 s doubling to 10 s) instead of ending the process; running
  experiment tasks go on meanwhile (their model calls wait as every client's do).
- a kind's checkpoint and an experiment's final status (`retrying`): retried the same way.
  A checkpoint stays exactly-once: its script appends rows only where the result list is as
  long as this run left it, and only while this run holds the experiment (its run token), so a
  retry after a reply lost with the connection writes nothing twice, and a run whose lease ran
  out during the outage (another scheduler took the experiment over) writes nothing at all.
- the dispatcher's read loop already logs and retries (`scheduler.dispatcher`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from arq import Worker

from lmqueue.shared.redis_errors import REDIS_AUTH, REDIS_DOWN

__all__ = ["ResilientWorker", "retrying", "BACKOFF_S"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: First and longest wait between tries while Redis is away.
BACKOFF_S = (0.25, 10.0)


async def retrying(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``await call()``, again after a backoff for as long as Redis cannot be reached (a wrong
    password is not retried); the outage is logged once, and its end."""
    delay_s, failed = BACKOFF_S[0], False
    while True:
        try:
            result = await call()
        except REDIS_AUTH:
            raise
        except REDIS_DOWN as exc:
            if not failed:
                logger.warning("%s: Redis cannot be reached (%r); retrying", what, exc)
                failed = True
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, BACKOFF_S[1])
            continue
        if failed:
            logger.warning("%s: Redis answers again", what)
        return result


class ResilientWorker(Worker):
    """arq's worker, whose poll loop outlives a Redis outage (see the module docstring)."""

    async def _poll_iteration(self) -> None:
        await retrying(super()._poll_iteration, "scheduler poll")
