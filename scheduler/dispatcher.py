"""`Dispatcher`: turns the tenants' submission orders into arq jobs.

Tenants cannot write arq's keys, so each posts orders on its own inbox stream; the scheduler
processes share one consumer group over all the inboxes of the tenants they serve. The tenant
of an order is the stream it was read from, never a field the client wrote. Enqueueing uses
the tenant-scoped job id, so an order read twice (after a crash) enqueues one job.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from producer.experiments import ExperimentStatus, validate_experiment_id
from shared.errors import InvalidName
from shared.redis_errors import REDIS_TROUBLE

from .settings import SchedulerSettings

__all__ = ["Dispatcher", "SCHEDULER_GROUP", "JOB_FUNCTION"]

logger = logging.getLogger(__name__)

#: The consumer group of scheduler processes on every inbox.
SCHEDULER_GROUP = "schedulers"
#: The arq function every experiment runs in.
JOB_FUNCTION = "run_experiment"
_BLOCK_MS = 1000
_RECLAIM_IDLE_MS = 10_000


class Dispatcher:
    """Read every served tenant's inbox and enqueue each submitted experiment once."""

    def __init__(self, settings: SchedulerSettings, redis: Any, arq: Any, kinds: set[str]) -> None:
        self.settings = settings
        self.redis = redis
        self.arq = arq
        self.kinds = kinds
        self.tenant_of = {
            settings.keyspace(t).experiment_inbox().encode(): t for t in settings.tenants
        }

    async def run(self) -> None:
        """Dispatch until cancelled; Redis troubles are logged and outlived."""
        ready = False
        while True:
            try:
                if not ready:
                    await self._create_groups()
                    await self._reclaim()
                    ready = True
                await self.dispatch_once(_BLOCK_MS)
            except REDIS_TROUBLE as exc:
                logger.warning("dispatcher: %r; retrying in 1 s", exc)
                ready = False
                await asyncio.sleep(1)

    async def dispatch_once(self, block_ms: int | None = None) -> int:
        """Read and dispatch one batch of orders; how many."""
        streams = {stream: ">" for stream in self.tenant_of}
        reply = await self.redis.xreadgroup(
            SCHEDULER_GROUP, self.settings.name, streams, count=100, block=block_ms
        )
        count = 0
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                await self._dispatch(self.tenant_of[stream], fields)
                await self.redis.xack(stream, SCHEDULER_GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)
                count += 1
        return count

    async def _create_groups(self) -> None:
        for stream in self.tenant_of:
            try:
                await self.redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _reclaim(self) -> None:
        """Orders a dead scheduler read but never acknowledged: dispatch them (idempotent)."""
        for stream, tenant in self.tenant_of.items():
            _, entries, *_ = await self.redis.xautoclaim(
                stream, SCHEDULER_GROUP, self.settings.name, _RECLAIM_IDLE_MS, count=1000
            )
            for entry_id, fields in entries:
                if fields:
                    await self._dispatch(tenant, fields)
                await self.redis.xack(stream, SCHEDULER_GROUP, entry_id)

    async def _dispatch(self, tenant: str, fields: dict[bytes, bytes]) -> None:
        try:
            experiment_id = validate_experiment_id(fields.get(b"id", b"").decode(errors="replace"))
        except InvalidName as exc:
            logger.info("tenant %s: order ignored: %s", tenant, exc.message)
            return
        await self.enqueue(tenant, experiment_id)

    async def enqueue(self, tenant: str, experiment_id: str) -> bool:
        """Enqueue the experiment's job (deferred to its start time); False if not runnable."""
        keys = self.settings.keyspace(tenant)
        record = keys.experiment_record(experiment_id)
        raw = await self.redis.hgetall(record)
        if not raw:
            return False
        status = ExperimentStatus.from_record(tenant, experiment_id, raw)
        if status.finished:
            return False
        if status.kind not in self.kinds:
            known = ", ".join(sorted(self.kinds))
            error = f"unknown kind {status.kind!r}; this scheduler runs: {known}"
            now_ms = int(time.time() * 1000)
            await self.redis.hset(
                record, mapping={"status": "failed", "error": error, "finished_ms": now_ms}
            )
            return False
        defer: dict[str, Any] = {}
        if status.start_after_ms > time.time() * 1000:
            when = datetime.datetime.fromtimestamp(status.start_after_ms / 1000, datetime.UTC)
            defer["_defer_until"] = when
        job = await self.arq.enqueue_job(
            JOB_FUNCTION,
            tenant,
            experiment_id,
            _job_id=keys.experiment_job_id(experiment_id),
            _queue_name=keys.scheduler_queue(),
            **defer,
        )
        logger.info(
            "tenant %s: experiment %s %s", tenant, experiment_id,
            "enqueued" if job is not None else "already enqueued",
        )  # fmt: skip
        return True
