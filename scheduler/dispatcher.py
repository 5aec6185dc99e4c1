"""`Dispatcher`: turns the tenants' submission orders into arq jobs.

Tenants cannot write arq's keys, so each posts orders on its own inbox stream; the scheduler
processes share one consumer group over all the inboxes of the tenants they serve. The tenant
of an order is the stream it was read from, never a field the client wrote. Enqueueing uses
the tenant-scoped job id, so an order read twice (after a crash) enqueues one job.

The inboxes are on the data plane. On a single instance one XREADGROUP reads them all; on a
Redis Cluster each inbox hashes to its own slot (the key carries no hash tag: a tenant's keys
are named by the tenant alone), and a multi-stream XREADGROUP must stay in one slot, so each
group of inboxes sharing a slot has its own blocking read loop (`slot_groups`), concurrently.
A scheduler serving T tenants on a cluster thus holds up to T blocked connections.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from lmqueue.producer.experiments import ExperimentStatus, validate_experiment_id
from lmqueue.shared.connections import slot_groups
from lmqueue.shared.errors import InvalidName
from lmqueue.shared.redis_errors import REDIS_TROUBLE

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
    """Read every served tenant's inbox and enqueue each submitted experiment once.

    `redis` is the data plane (a plain or a cluster client), `arq` arq's pool (control plane).
    """

    def __init__(self, settings: SchedulerSettings, redis: Any, arq: Any, kinds: set[str]) -> None:
        self.settings = settings
        self.redis = redis
        self.arq = arq
        self.kinds = kinds
        self.tenant_of = {
            settings.keyspace(t).experiment_inbox().encode(): t for t in settings.tenants
        }

    @property
    def groups(self) -> list[list[bytes]]:
        """The inboxes one XREADGROUP can read together: all of them, or one slot's on a cluster."""
        return slot_groups(self.redis, self.tenant_of)

    async def run(self) -> None:
        """Dispatch until cancelled, one read loop per group of inboxes."""
        await asyncio.gather(*(self._run_group(group) for group in self.groups))

    async def _run_group(self, inboxes: list[bytes]) -> None:
        """Dispatch the orders of `inboxes`; Redis troubles are logged and outlived.

        After every (re)connection it first dispatches the orders it had read itself and not
        acknowledged (the connection broke mid-dispatch, or Redis restarted from its AOF
        between the read and the enqueue), and it takes over other processes' idle orders
        every half `_RECLAIM_IDLE_MS` while it runs, not only when it (re)connects: an order
        read just before an outage would otherwise stay pending for good, its experiment
        ``queued`` forever (found by ``lmq bench soak``).
        """
        ready, reclaimed_at = False, 0.0
        while True:
            try:
                if not ready:
                    await self._create_groups(inboxes)
                    await self.dispatch_once(None, inboxes, start="0")  # its own pending ones
                    ready = True
                if time.monotonic() - reclaimed_at >= _RECLAIM_IDLE_MS / 2000:
                    await self._reclaim(inboxes)
                    reclaimed_at = time.monotonic()
                await self.dispatch_once(_BLOCK_MS, inboxes)
            except REDIS_TROUBLE as exc:
                logger.warning("dispatcher: %r; retrying in 1 s", exc)
                ready = False
                await asyncio.sleep(1)

    async def dispatch_once(
        self, block_ms: int | None = None, inboxes: list[bytes] | None = None, start: str = ">"
    ) -> int:
        """Read and dispatch one batch of orders of `inboxes` (one group; default: all, which
        only a single instance reads at once); how many. `start` ``"0"`` reads the orders
        this process was given before and has not acknowledged, instead of new ones."""
        streams = {stream: start for stream in (self.tenant_of if inboxes is None else inboxes)}
        reply = await self.redis.xreadgroup(
            SCHEDULER_GROUP, self.settings.name, streams, count=100, block=block_ms
        )
        count = 0
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                if fields:  # a pending order whose entry was deleted comes back empty
                    await self._dispatch(self.tenant_of[stream], fields)
                await self.redis.xack(stream, SCHEDULER_GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)
                count += 1
        return count

    async def _create_groups(self, inboxes: list[bytes]) -> None:
        for stream in inboxes:
            try:
                await self.redis.xgroup_create(stream, SCHEDULER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _reclaim(self, inboxes: list[bytes]) -> None:
        """Orders a dead scheduler read but never acknowledged: dispatch them (idempotent)."""
        for stream in inboxes:
            tenant = self.tenant_of[stream]
            _, entries, *_ = await self.redis.xautoclaim(
                stream, SCHEDULER_GROUP, self.settings.name, _RECLAIM_IDLE_MS, count=1000
            )
            for entry_id, fields in entries:
                if fields:
                    await self._dispatch(tenant, fields)
                await self.redis.xack(stream, SCHEDULER_GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)

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
