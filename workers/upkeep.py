"""`Upkeep`: what a worker does beside reading and answering, each on its own loop.

* a heartbeat, which also writes the stats hash `lmq status` reads and re-publishes the model
  after a Redis restart (the registry entry is gone);
* a tenant refresh, so new tenants and changed weights are served within a few seconds, and
  so are LoRA adapters added or removed in the model's registry (`AdapterSet`);
* a janitor sweep, which answers entries abandoned by dead workers on every lane, and prunes;
* claims of entries read ahead, waiting in the fair-share scheduler for a batch, kept fresh
  (as a running batch keeps its own), so no janitor reclaims them during a long forward;
* readiness, failed the moment the worker is told to stop.

Kept apart from `Worker` so that the worker module reads as lifecycle, reading and answering.
`Upkeep` is handed the parts it works on (`UpkeepParts`) and two callbacks into the worker,
never the worker itself, so the dependency runs one way: the worker owns its upkeep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from lmqueue.shared.cluster_client import cluster_rebuilds
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import REDIS_DOWN, REDIS_TROUBLE
from lmqueue.shared.registry import ModelInfo, ModelRegistry
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.worker_stats import WorkerStats, write_worker_stats

from .adapter_set import AdapterSet
from .fair_share import FairShare
from .health import HealthState
from .metrics import WorkerMetrics
from .request_stream import Entry
from .tenant_lanes import Lane, TenantLanes

__all__ = ["Upkeep", "UpkeepParts", "health_state", "sleep_unless", "TENANT_REFRESH_S"]

logger = logging.getLogger(__name__)

#: How often the operator's tenant list is read again.
TENANT_REFRESH_S = 2.0


@dataclass(frozen=True)
class UpkeepParts:
    """What the upkeep loops read and change: the worker's parts, not the worker."""

    settings: WorkerSettings
    info: ModelInfo
    redis: Any
    keys: KeySpace
    registry: ModelRegistry
    health: HealthState
    metrics: WorkerMetrics
    lanes: TenantLanes
    scheduler: FairShare[tuple[Lane, Entry]]
    adapters: AdapterSet


#: Re-publish the model (its registry entry vanished, e.g. after a Redis restart).
Publish = Callable[[], Awaitable[None]]
#: Answer abandoned entries of one lane (the worker's own answering path), until `stop`.
Recover = Callable[[Lane, AsyncGenerator[Entry, None], asyncio.Event], Awaitable[None]]


class Upkeep:
    """The background loops of one worker."""

    def __init__(self, parts: UpkeepParts, publish: Publish, recover: Recover) -> None:
        self.parts = parts
        self._publish, self._recover = publish, recover
        self._started_ms = int(time.time() * 1000)
        self._stats_refused = False
        self._rebuilds_seen = 0
        self._rebuilt_ms = 0

    def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """Start the heartbeat, the tenant refresh and readiness; they run until `stop`."""
        return [
            asyncio.create_task(self._heartbeat(stop), name="heartbeat"),
            asyncio.create_task(self._tenant_loop(stop), name="tenants"),
            asyncio.create_task(self._not_ready_once(stop), name="readiness"),
            asyncio.create_task(self._keep_queued_claims(stop), name="queued-claims"),
        ]

    async def _keep_queued_claims(self, stop: asyncio.Event) -> None:
        """Every third of the claim timeout, reset the idle time of the entries queued."""
        parts = self.parts
        interval_s = parts.settings.claim_idle_ms / 3000
        while not stop.is_set():
            await sleep_unless(stop, interval_s)
            by_stream: dict[str, tuple[Lane, list[str]]] = {}
            for lane, entry in parts.scheduler.queued():
                by_stream.setdefault(lane.stream.stream, (lane, []))[1].append(entry.entry_id)
            for lane, entry_ids in by_stream.values():
                try:
                    await lane.stream.touch(entry_ids)
                except REDIS_TROUBLE as exc:  # e.g. NOGROUP after a restart
                    logger.info("keeping queued claims fresh failed: %s", exc)

    def start_janitor(self, stop: asyncio.Event) -> asyncio.Task[None]:
        """Start the janitor sweep; it runs until `stop`."""
        return asyncio.create_task(self._janitor_loop(stop), name="janitor")

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        parts = self.parts
        while not stop.is_set():
            try:
                if not await parts.registry.is_published(parts.info.name):
                    logger.warning("model registry entry missing (Redis restarted?); re-publishing")
                    await self._publish()
                await self.beat()
            except REDIS_DOWN as exc:
                logger.warning("heartbeat failed: %s", exc)
                parts.health.heartbeat(reached_redis=False)
            await sleep_unless(stop, parts.settings.heartbeat_s)

    async def beat(self) -> None:
        """Write the heartbeat and the stats hash (`lmq status`)."""
        parts = self.parts
        info, settings, metrics = parts.info, parts.settings, parts.metrics
        await parts.registry.heartbeat(info.name, settings.name)
        parts.health.heartbeat(reached_redis=True)
        metrics.mark_heartbeat()
        batches_per_s, requests_per_s = metrics.rates()
        hits, misses = metrics.shared_cache_counts()
        stats = WorkerStats(
            info.name, settings.backend, info.revision,
            tuple(parts.lanes.tenants()), settings.batch_size,
            self._started_ms, int(time.time() * 1000), metrics.batches_total,
            metrics.requests_total, batches_per_s, requests_per_s, hits, misses,
            *self._cluster_rebuilds(),
        )  # fmt: skip
        ttl_s = max(10, int(5 * settings.heartbeat_s))
        try:
            await write_worker_stats(parts.redis, parts.keys, settings.name, stats, ttl_s)
        except ResponseError as exc:  # e.g. an ACL without the stats key: lmq status shows less
            if not self._stats_refused:
                logger.warning("writing the stats hash failed: %s", exc)
            self._stats_refused = True

    def _cluster_rebuilds(self) -> tuple[int, int]:
        """The worker's cluster-client rebuilds so far and when the count last grew (Unix ms)."""
        lanes = self.parts.lanes
        rebuilds, _ = cluster_rebuilds(lanes.redis, lanes.cache_redis)
        if rebuilds != self._rebuilds_seen:
            self._rebuilds_seen, self._rebuilt_ms = rebuilds, int(time.time() * 1000)
        return rebuilds, self._rebuilt_ms

    async def _not_ready_once(self, stop: asyncio.Event) -> None:
        """Fail readiness the moment the worker is told to stop, not when its loop notices."""
        await stop.wait()
        self.parts.health.mark_stopping()

    async def _tenant_loop(self, stop: asyncio.Event) -> None:
        """Pick up new tenants and changed settings every few seconds, without a restart."""
        while not stop.is_set():
            await sleep_unless(stop, TENANT_REFRESH_S)
            try:
                await self.refresh_tenants()
            except REDIS_TROUBLE as exc:
                logger.warning("reading tenants failed: %s", exc)

    async def refresh_tenants(self) -> None:
        """Read the tenant list again and give the scheduler each lane's weight; load added
        LoRA adapters and unload removed ones."""
        parts = self.parts
        await parts.adapters.refresh()
        await parts.lanes.refresh()
        for lane in parts.lanes:
            parts.scheduler.set_weight(lane.tenant, lane.weight)

    async def _janitor_loop(self, stop: asyncio.Event) -> None:
        """Recover idle entries of dead workers on every lane, and prune; nothing ends it."""
        parts = self.parts
        interval_s = max(parts.settings.claim_idle_ms / 2000, 0.05)
        while not stop.is_set():
            await sleep_unless(stop, interval_s)
            if stop.is_set():
                return
            for lane in parts.lanes:
                try:
                    await self._recover(lane, lane.janitor.idle_entries(), stop)
                    await lane.janitor.prune_if_due()
                except REDIS_TROUBLE as exc:
                    logger.warning("janitor sweep of %s failed: %s", lane.tenant, exc)
                except Exception:
                    logger.exception("janitor sweep of %s failed", lane.tenant)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, waking early when `stop` is set."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


def health_state(settings: WorkerSettings) -> HealthState:
    """Probe thresholds for a worker: its read loop turns at least every stall timeout plus
    half a second, its heartbeat loop every `heartbeat_s`; allow several of each."""
    return HealthState(
        loop_stale_s=max(60.0, 3 * settings.redis.stall_timeout_s),
        heartbeat_stale_s=max(30.0, 5 * settings.heartbeat_s),
    )
