"""`collect_status`: the fleet as Redis sees it, as one JSON-able dict.

Per model and tenant: the backlog (XLEN: workers delete entries once answered, so the stream
holds exactly the pending plus the undelivered ones), how many of those a worker holds
(XPENDING), the age of the oldest (its stream id is Redis's clock at XADD) and the dead
letters. Per worker: the age of its heartbeat, whether it is stale (silent for longer than
`STALE_AFTER_S`: killed, frozen or cut off, still listed until the janitor drops it), and the
figures it keeps in its stats hash (shared/worker_stats.py). For the queue role and the cache
role: memory, bound, policy, evictions and the keyspace hit rate from INFO, and whether the
cache is the queue instance itself.

Read by ``lmq status`` (`lmqueue.status`) and its exporter (`lmqueue.status_metrics`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.partitions import stream_partitions
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.worker_stats import read_worker_stats

__all__ = ["collect_status", "STALE_AFTER_S"]

#: A worker whose heartbeat is older is marked stale (workers beat every 2 s by default).
STALE_AFTER_S = 15.0


async def collect_status(
    redis: Any,
    keys: KeySpace,
    cache_redis: Any | None = None,
    tenants: Sequence[str] | None = None,
    models: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The status as a JSON-able dict (see the module docstring for what is in it)."""
    now_s, now_us = await redis.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    if not models:
        models = [_text(name) for name in await redis.smembers(keys.models())]
    if not tenants:  # the settings' tenant and every tenant the operator added
        tenants = sorted({keys.tenant, *(_text(t) for t in await redis.hkeys(keys.tenants()))})
    tenant_keys = {t: dataclasses.replace(keys, tenant=t) for t in tenants}
    status: dict[str, Any] = {"time_ms": now_ms, "models": {}}
    for model in sorted(models):
        raw_info = await redis.get(keys.model_info(model))
        partitions = ModelInfo.from_bytes(raw_info).partitions if raw_info else 1
        streams = {
            tenant: await _stream_status(redis, tenant_space, model, partitions, now_ms)
            for tenant, tenant_space in tenant_keys.items()
        }
        status["models"][model] = {
            "partitions": partitions,
            "backlog": sum(s["backlog"] for s in streams.values()),
            "tenants": streams,
            "workers": await _workers(redis, keys, model, now_ms),
        }
    status["queue"] = await _memory(redis)
    status["cache"] = await _memory(cache_redis if cache_redis is not None else redis)
    status["cache"]["same_instance_as_queue"] = cache_redis is None
    return status


async def _stream_status(
    redis: Any, keys: KeySpace, model: str, partitions: int, now_ms: int
) -> dict[str, Any]:
    """One tenant's streams of `model`, every partition's summed (the oldest: the oldest's)."""
    backlog = pending = 0
    oldest_ms: int | None = None
    for partition in stream_partitions(partitions):
        stream = keys.requests(model, partition)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xlen(stream)
            pipe.xrange(stream, count=1)
            length, first = await pipe.execute()
        backlog += int(length)
        try:
            pending += int((await redis.xpending(stream, WORKER_GROUP))["pending"])
        except ResponseError:  # no stream or no group yet
            pass
        if first:
            enqueued_ms = int(_text(first[0][0]).partition("-")[0])
            oldest_ms = enqueued_ms if oldest_ms is None else min(oldest_ms, enqueued_ms)
    dead = await redis.xlen(keys.dead_letters(model))
    oldest_age_s = None if oldest_ms is None else max(now_ms - oldest_ms, 0) / 1000
    return {
        "backlog": backlog,
        "pending": pending,
        "undelivered": max(backlog - pending, 0),
        "oldest_age_s": oldest_age_s,
        "dead_letters": int(dead),
    }


async def _workers(redis: Any, keys: KeySpace, model: str, now_ms: int) -> dict[str, Any]:
    beats = await redis.zrange(keys.model_workers(model), 0, -1, withscores=True)
    names = [_text(name) for name, _ in beats]
    stats = await read_worker_stats(redis, keys, model, names)
    workers = {}
    for name, (_, score) in zip(names, beats, strict=True):
        age_s = max(now_ms - int(score), 0) / 1000
        row: dict[str, Any] = {"heartbeat_age_s": age_s, "stale": age_s > STALE_AFTER_S}
        if name in stats:
            figures = dataclasses.asdict(stats[name])
            figures["tenants"] = list(figures["tenants"])
            del figures["model"]
            row.update(figures)
            lookups = stats[name].shared_cache_hits + stats[name].shared_cache_misses
            row["shared_cache_hit_rate"] = (
                stats[name].shared_cache_hits / lookups if lookups else None
            )
        workers[name] = row
    return workers


async def _memory(redis: Any) -> dict[str, Any]:
    memory = await redis.info("memory")
    stats = await redis.info("stats")
    hits, misses = int(stats.get("keyspace_hits", 0)), int(stats.get("keyspace_misses", 0))
    return {
        "used_memory_bytes": int(memory.get("used_memory", 0)),
        "maxmemory_bytes": int(memory.get("maxmemory", 0)),
        "maxmemory_policy": _text(memory.get("maxmemory_policy", "")),
        "evicted_keys": int(stats.get("evicted_keys", 0)),
        "keyspace_hits": hits,
        "keyspace_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
