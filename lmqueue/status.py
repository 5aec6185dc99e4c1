"""``lmq status [--json] [--watch]``: the fleet as Redis sees it, without Prometheus.

Per model and tenant: the backlog (XLEN: workers delete entries once answered, so the stream
holds exactly the pending plus the undelivered ones), how many of those a worker holds
(XPENDING), the age of the oldest (its stream id is Redis's clock at XADD) and the dead
letters. Per worker: the age of its heartbeat and the figures it keeps in its stats hash
(shared/worker_stats.py). For the cache role (and the queue role): memory, bound, policy,
evictions and the keyspace hit rate from INFO.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.partitions import stream_partitions
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.settings import RedisSettings
from lmqueue.shared.worker_stats import read_worker_stats

__all__ = ["add_arguments", "run", "collect_status", "render_text"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags."""
    parser.add_argument("--redis-url", help="queue Redis (default LMQ_REDIS_URL or REDIS_URL)")
    parser.add_argument("--cache-url", help="cache Redis (default LMQ_CACHE_URL, else the queue)")
    parser.add_argument(
        "--tenant",
        action="append",
        help="tenant to show (repeatable; default: LMQ_TENANT and every tenant added)",
    )
    parser.add_argument("--model", action="append", help="model to show (default: all published)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument(
        "--metrics-port", type=int, default=0,
        help="serve the status as Prometheus metrics on this port until stopped (an exporter "
        "for alerts and dashboards that runs while no worker does)",
    )  # fmt: skip


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
        row: dict[str, Any] = {"heartbeat_age_s": max(now_ms - int(score), 0) / 1000}
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


def render_text(status: dict[str, Any]) -> str:
    """The status as a few aligned tables for a terminal."""
    lines = []
    for model, info in status["models"].items():
        lines.append(f"model {model}: backlog {info['backlog']}")
        lines.append(_row("tenant", "backlog", "pending", "waiting", "oldest", "dead"))
        for tenant, s in info["tenants"].items():
            lines.append(_row(tenant, s["backlog"], s["pending"], s["undelivered"],
                              _age(s["oldest_age_s"]), s["dead_letters"]))  # fmt: skip
        lines.append(_row("worker", "heartbeat", "batch/s", "req/s", "backend", "tenants"))
        for name, w in info["workers"].items():
            lines.append(_row(
                name, _age(w["heartbeat_age_s"]), f"{w.get('batches_per_s', 0.0):.1f}",
                f"{w.get('requests_per_s', 0.0):.1f}", w.get("backend", "?"),
                ",".join(w.get("tenants", [])),
            ))  # fmt: skip
        if not info["workers"]:
            lines.append("  (no live workers)")
    for role in ("queue", "cache"):
        m = status[role]
        bound = _size(m["maxmemory_bytes"]) if m["maxmemory_bytes"] else "unbounded"
        rate = "-" if m["hit_rate"] is None else f"{100 * m['hit_rate']:.1f}%"
        lines.append(
            f"{role} redis: {_size(m['used_memory_bytes'])} of {bound} ({m['maxmemory_policy']}), "
            f"{m['evicted_keys']} evicted, hit rate {rate}"
        )
    return "\n".join(lines)


def _row(name: str, *cells: Any) -> str:
    return f"  {name:<28}" + "".join(f" {cell!s:>9}" for cell in cells)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _show(args: argparse.Namespace, settings: RedisSettings) -> None:
    redis = aioredis.Redis.from_url(settings.url)
    cache = None
    if settings.cache_url and settings.cache_url != settings.url:
        cache = aioredis.Redis.from_url(settings.cache_url)
    try:
        if args.metrics_port:
            await _export(args, settings, redis, cache)
            return
        while True:
            status = await collect_status(
                redis, settings.keyspace(), cache, args.tenant, args.model
            )
            text = json.dumps(status, indent=2) if args.json else render_text(status)
            if args.watch and not args.json:
                text = f"\x1b[H\x1b[2J{time.strftime('%H:%M:%S')}\n{text}"
            print(text, flush=True)
            if not args.watch:
                return
            await asyncio.sleep(args.interval)
    finally:
        await redis.aclose()
        if cache is not None:
            await cache.aclose()


async def _export(
    args: argparse.Namespace, settings: RedisSettings, redis: Any, cache: Any
) -> None:
    from .status_metrics import serve_status_metrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve_status_metrics(
        redis, settings.keyspace(), cache, args.tenant, args.model, args.metrics_port,
        args.interval, stop,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print the status (once, or until interrupted with --watch); returns the exit code.

    Raises:
        Unavailable, Forbidden: if Redis cannot be reached or refuses (the CLI reports it).
    """
    settings = RedisSettings.from_env()
    if args.redis_url:
        settings = dataclasses.replace(settings, url=args.redis_url)
    if args.cache_url:
        settings = dataclasses.replace(settings, cache_url=args.cache_url)
    try:
        with redis_boundary("lmq status"):
            asyncio.run(_show(args, settings))
    except KeyboardInterrupt:  # how --watch and the exporter are left
        return 0
    return 0
