"""``lmq status --metrics-port``: the status as Prometheus metrics, from an always-up process.

Workers export what they do; what they have not done yet (the backlog, the age of the oldest
waiting request, workers that stopped beating) has to come from somewhere that runs when no
worker does, or a fleet scaled to zero could not raise the alert that it should not be. This
exporter refreshes `collect_status` every few seconds and serves the result with the same
`HealthServer` the workers use (``/healthz``: the refresh loop turns; ``/readyz``: the last
refresh reached Redis).

    lmq_backlog_requests{model,tenant}             unanswered requests (XLEN)
    lmq_pending_requests{model,tenant}             of which a worker holds (XPENDING)
    lmq_oldest_request_age_seconds{model,tenant}   age of the oldest unanswered (0 if none)
    lmq_dead_letter_entries{model,tenant}          entries in the dead-letter stream
    lmq_workers{model,kind}                        kind=live (heartbeat fresh) | stale
    lmq_redis_memory_used_bytes{kind}              kind=queue | cache (INFO memory)
    lmq_redis_maxmemory_bytes{kind}                the bound (0: none)
    lmq_redis_evicted_keys_total{kind}             keys evicted by the policy
    lmq_redis_keyspace_hits_total{kind}, lmq_redis_keyspace_misses_total{kind}
    lmq_status_refresh_timestamp_seconds           Unix time of the last successful refresh
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from lmqueue.shared.keys import KeySpace
from lmqueue.workers.health import DEFAULT_METRICS_HOST, HealthServer, HealthState

from .status_collect import STALE_AFTER_S, collect_status

__all__ = ["StatusCollector", "serve_status_metrics"]

logger = logging.getLogger(__name__)

_STREAM_GAUGES = (
    ("lmq_backlog_requests", "backlog", "Unanswered requests (XLEN of the request stream)."),
    ("lmq_pending_requests", "pending", "Unanswered requests a worker holds (XPENDING)."),
    ("lmq_dead_letter_entries", "dead_letters", "Entries in the dead-letter stream."),
)


class StatusCollector(Collector):
    """Turns the latest `collect_status` result into metric families at each scrape.

    Args:
        stale_after_s: a worker whose heartbeat is older counts as ``stale``.
    """

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self.status: dict[str, Any] | None = None
        self.refreshed_s = 0.0

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return iter(())
        families: list[Metric] = []
        for name, field, doc in _STREAM_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model", "tenant"])
            for model, info in status["models"].items():
                for tenant, stream in info["tenants"].items():
                    family.add_metric([model, tenant], stream[field])
            families.append(family)
        families += [self._ages(status), self._workers(status), *self._redis(status)]
        refreshed = GaugeMetricFamily(
            "lmq_status_refresh_timestamp_seconds", "Unix time of the last successful refresh."
        )
        refreshed.add_metric([], self.refreshed_s)
        families.append(refreshed)
        return iter(families)

    @staticmethod
    def _ages(status: dict[str, Any]) -> Metric:
        family = GaugeMetricFamily(
            "lmq_oldest_request_age_seconds", "Age of the oldest unanswered request (0: none).",
            labels=["model", "tenant"],
        )  # fmt: skip
        for model, info in status["models"].items():
            for tenant, stream in info["tenants"].items():
                family.add_metric([model, tenant], stream["oldest_age_s"] or 0.0)
        return family

    def _workers(self, status: dict[str, Any]) -> Metric:
        family = GaugeMetricFamily(
            "lmq_workers", "Workers in the live set: kind=live (heartbeat fresh) or stale.",
            labels=["model", "kind"],
        )  # fmt: skip
        for model, info in status["models"].items():
            ages = [w["heartbeat_age_s"] for w in info["workers"].values()]
            live = sum(age <= self.stale_after_s for age in ages)
            family.add_metric([model, "live"], live)
            family.add_metric([model, "stale"], len(ages) - live)
        return family

    @staticmethod
    def _redis(status: dict[str, Any]) -> list[Metric]:
        used = GaugeMetricFamily(
            "lmq_redis_memory_used_bytes", "Memory Redis uses.", labels=["kind"]
        )
        bound = GaugeMetricFamily(
            "lmq_redis_maxmemory_bytes", "Redis's maxmemory (0: none).", labels=["kind"]
        )
        counters = {
            field: CounterMetricFamily(f"lmq_redis_{field}", doc, labels=["kind"])
            for field, doc in (
                ("evicted_keys", "Keys evicted by the maxmemory policy."),
                ("keyspace_hits", "Key lookups that found the key."),
                ("keyspace_misses", "Key lookups that did not."),
            )
        }
        for role in ("queue", "cache"):
            memory = status[role]
            used.add_metric([role], memory["used_memory_bytes"])
            bound.add_metric([role], memory["maxmemory_bytes"])
            for field, family in counters.items():
                family.add_metric([role], memory[field])
        return [used, bound, *counters.values()]


async def serve_status_metrics(
    redis: Any,
    keys: KeySpace,
    cache_redis: Any | None,
    tenants: Sequence[str] | None,
    models: Sequence[str] | None,
    port: int,
    interval_s: float,
    stop: asyncio.Event,
    host: str | None = None,
) -> None:
    """Refresh the status every `interval_s` and serve it on `port` until `stop` is set."""
    registry = CollectorRegistry(auto_describe=True)
    collector = StatusCollector()
    registry.register(collector)
    state = HealthState(
        loop_stale_s=max(30.0, 3 * interval_s), heartbeat_stale_s=max(30.0, 3 * interval_s)
    )
    async with HealthServer(state, registry, host or DEFAULT_METRICS_HOST, port):
        state.mark_serving()
        while not stop.is_set():
            state.tick()
            try:
                collector.status = await collect_status(redis, keys, cache_redis, tenants, models)
                collector.refreshed_s = time.time()
                state.heartbeat(reached_redis=True)
                state.mark_published()
            except (RedisError, OSError) as exc:
                logger.warning("refreshing the status failed: %s", exc)
                state.heartbeat(reached_redis=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
