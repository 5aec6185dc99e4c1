"""Riding out a Redis outage: the scheduler keeps its process, its jobs and its leases' meaning.

Workers and clients retry while Redis is away (`shared.redis_errors.REDIS_DOWN`); the
scheduler does the same in the places that talk to Redis on their own:

- arq's poll loop (`ResilientWorker`): a poll that cannot reach Redis is logged once and
  retried with backoff (0.25 s doubling to 10 s) instead of ending the process; running
  experiment tasks go on meanwhile (their model calls wait as every client's do). A job slot
  taken by a claim the outage cut short is given back, the claim's WatchError (redis-py's
  word for a connection lost while watching) counts as the outage it is, a claim lasts
  `lease_s` rather than the job timeout, and a job task that ended cancelled does not stop
  the process (arq would let these end the process, starve it or hold a job for days).
- an experiment's own start (`scheduler.run`): every round trip is retried the same way, and
  an outage that still escapes a run sends the job back to arq's queue (`Retry`) instead of
  failing it, which would leave its record "running" for good.
- a kind's checkpoint and an experiment's final status (`retrying`): retried the same way.
  A checkpoint stays exactly-once: its script appends rows only where the result list is as
  long as this run left it, and only while this run holds the experiment (its run token), so a
  retry after a reply lost with the connection writes nothing twice, and a run whose lease ran
  out during the outage (another scheduler took the experiment over) writes nothing at all.
  A Redis that came back without some writes it had acknowledged (``appendfsync everysec``)
  refuses the next checkpoint too; with no other live run behind the refusal the job goes
  back to arq's queue and the next run resumes from what Redis kept (`scheduler.run`).
- the dispatcher's read loop already logs and retries (`scheduler.dispatcher`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from arq import Worker
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

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
    """arq's worker, whose poll loop outlives a Redis outage (see the module docstring).

    `claim_lease_s` (the scheduler's ``lease_s``) is how long arq's claim of a job (its
    in-progress key) lasts until the run renews it. arq makes it the job timeout (days here),
    so a claim whose run never started, the connection lost between the two, kept the job
    from running anywhere for days; an experiment's run renews it every 0.25 s from its start.
    """

    def __init__(self, *args: Any, claim_lease_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if claim_lease_s is not None:
            self.in_progress_timeout_s = claim_lease_s

    async def _poll_iteration(self) -> None:
        await retrying(self._poll_once, "scheduler poll")

    async def _poll_once(self) -> None:
        """One arq poll. A job task that ended cancelled (arq surfaces each finished task's
        exception here) is logged: unless this poll itself is being cancelled (the process is
        stopping), it must not end the process, which would then exit as if told to stop."""
        try:
            await super()._poll_iteration()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            logger.warning("scheduler poll: a job's task ended cancelled; polling on")

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """arq's `start_jobs`, which takes a job slot (its semaphore and counter) before the
        round trips that claim the job and gives it back only if they answer: a connection
        lost among them kept the slot for good, and after ``max_jobs`` such outages the process
        ran nothing. Here the one slot taken for the job being claimed is given back."""
        # a job whose claim Redis lost (a restart) while this process runs it: claimed again,
        # it would run twice here, and arq's bookkeeping, keyed by job id, fails the second
        job_ids = [job for job in job_ids if not self._running_here(job.decode())]
        try:
            await super().start_jobs(job_ids)
        except REDIS_DOWN:
            self._give_slot_back()
            raise
        except WatchError as exc:
            # redis-py's word for a connection lost while a key is watched (the claim's
            # WATCH, EXISTS, ZSCORE; arq catches it only at EXEC): an outage, which ended
            # the process until it was said so
            self._give_slot_back()
            raise RedisConnectionError(f"claiming a job: {exc}") from exc

    async def close(self) -> None:
        """arq's `close`, which a job task that ended cancelled no longer aborts.

        A stop signal cancels the job tasks; one cancelled while arq writes its result (a
        shielded write, slow when Redis has just restarted and closed the pool's connections)
        ends with CancelledError, which arq's close re-raised from gathering the tasks: the
        process exited 1 without its on_shutdown or closing its pool, after a clean stop.
        """
        while True:
            try:
                await super().close()
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # this close itself is being cancelled
                cancelled = [job for job, task in self.tasks.items() if task.cancelled()]
                if not cancelled:
                    raise
                for job in cancelled:
                    del self.tasks[job]
                logger.info("stopping: %d job(s) cancelled mid-write", len(cancelled))

    def _running_here(self, job_id: str) -> bool:
        task = self.tasks.get(job_id)
        return task is not None and not task.done()

    def _give_slot_back(self) -> None:
        self.job_counter -= 1
        self.sem.release()
