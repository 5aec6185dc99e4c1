"""``lmq status [--json] [--watch]``: the fleet as Redis sees it, without Prometheus.

What is shown is `lmqueue.status_collect`'s; this module is the command: which Redis it reads
(said first, password masked, and said to be only the default when nothing named one), the
cache instance (``--cache-url``, else the address the workers publish, with the same
credentials), the text rendering (stale workers marked with how long they have been silent)
and the refresh loop, which flushes every refresh so ``--watch`` works into a pipe.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from typing import Any

from lmqueue.shared.cluster_client import cluster_rebuilds
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.redis_roles import (
    CACHE_POLICY,
    RedisRoles,
    connect_queue,
    connect_redis_roles,
)
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.settings import (
    RedisSettings,
    configured_metrics_host,
    mask_url,
    redis_url_source,
)

from .connection_url import say_default_url
from .status_collect import collect_status
from .status_metrics import serve_status_metrics

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
    parser.add_argument(
        "--metrics-host", default=None,
        help="address the exporter listens on (default: $LMQ_METRICS_HOST, else 127.0.0.1)",
    )  # fmt: skip


def render_text(status: dict[str, Any]) -> str:
    """The status as a few aligned tables for a terminal."""
    lines = [f"redis {status['url']}"] if "url" in status else []
    for model, info in status["models"].items():
        lines.append(f"model {model}: backlog {info['backlog']}")
        lines.append(_row("tenant", "backlog", "pending", "waiting", "oldest", "dead"))
        for tenant, s in info["tenants"].items():
            lines.append(_row(tenant, s["backlog"], s["pending"], s["undelivered"],
                              _age(s["oldest_age_s"]), s["dead_letters"]))  # fmt: skip
        lines.append(_row("worker", "heartbeat", "batch/s", "req/s", "backend", "tenants"))
        for name, w in info["workers"].items():
            beat = _age(w["heartbeat_age_s"]) + (" STALE" if w.get("stale") else "")
            lines.append(_row(
                name, beat, f"{w.get('batches_per_s', 0.0):.1f}",
                f"{w.get('requests_per_s', 0.0):.1f}", w.get("backend", "?"),
                ",".join(w.get("tenants", [])),
            ))  # fmt: skip
        if not info["workers"]:
            lines.append("  (no live workers)")
        stale = [(n, w) for n, w in info["workers"].items() if w.get("stale")]
        for name, w in stale:
            lines.append(f"  {name}: STALE, heartbeat silent for {_age(w['heartbeat_age_s'])}"
                         " (killed, frozen or cut off from Redis?)")  # fmt: skip
        lines += _rebuild_lines(info["workers"], status.get("time_ms"))
    if status.get("cluster_rebuilds"):
        lines.append(f"this connection: Redis Cluster client rebuilt {status['cluster_rebuilds']}x")
    for role in ("queue", "cache"):
        m = status[role]
        if role == "cache" and m.get("unreadable"):
            lines.append("cache redis: a separate instance this user cannot read (see above)")
            continue
        if role == "cache" and m.get("same_instance_as_queue"):
            lines.append("cache redis: the queue instance (no separate cache)")
            continue
        bound = _size(m["maxmemory_bytes"]) if m["maxmemory_bytes"] else "unbounded"
        rate = "-" if m["hit_rate"] is None else f"{100 * m['hit_rate']:.1f}%"
        lines.append(
            f"{role} redis: {_size(m['used_memory_bytes'])} of {bound} ({m['maxmemory_policy']}), "
            f"{m['evicted_keys']} evicted, hit rate {rate}"
        )
        if role == "cache" and m["maxmemory_policy"] in _RECENCY_POLICIES:
            lines.append(f"  {m['maxmemory_policy']} cannot tell entries of the same second apart: "
                         f"a cache holding seconds of results evicts among them at random, "
                         f"claim-checks included; ops/redis/cache.conf ships {CACHE_POLICY} "
                         f"(the oldest first)")  # fmt: skip
    return "\n".join(lines)


#: Eviction policies that cannot order entries written within one second (Redis's LRU clock
#: ticks once a second; a new entry's LFU counter is everyone's; random is random: README,
#: "Redis roles"): a separate cache under one of them loses fresh claim-checks when full.
_RECENCY_POLICIES = frozenset(
    ("allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu", "allkeys-random",
     "volatile-random")
)  # fmt: skip


def _rebuild_lines(workers: dict[str, Any], now_ms: int | None) -> list[str]:
    """One line per worker whose Redis Cluster client lost every node and was rebuilt."""
    lines = []
    for name, w in workers.items():
        if w.get("cluster_rebuilds"):
            ago = (now_ms - w["cluster_rebuilt_ms"]) / 1000 if now_ms else None
            lines.append(f"  {name}: Redis Cluster client rebuilt {w['cluster_rebuilds']}x, "
                         f"last {_age(ago)} ago")  # fmt: skip
    return lines


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


async def _connect(settings: RedisSettings) -> RedisRoles:
    """The queue and the cache instance to read: ``--cache-url``, else the address the
    workers publish (reached with the queue URL's credentials), else the queue itself."""
    queue = await connect_queue(settings)
    published = ""
    for name in sorted(await queue.smembers(settings.keyspace().models())):
        raw = await queue.get(settings.keyspace().model_info(_text(name)))
        published = published or (ModelInfo.from_bytes(raw).cache_address if raw else "")
    # a user without access to the cache still sees the queue (one warning says why)
    return await connect_redis_roles(settings, published, cache_required=False, queue=queue)


async def _show(args: argparse.Namespace, settings: RedisSettings) -> None:
    roles = await _connect(settings)
    redis, cache = roles.queue, roles.cache if roles.separate else None
    # (a separate cache this user cannot read: the queue's figures, replaced below)
    tty = sys.stdout.isatty()
    try:
        if args.metrics_port:
            await _export(args, settings, redis, cache)
            return
        while True:
            status = await collect_status(
                redis, settings.keyspace(), cache, args.tenant, args.model
            )
            status["url"] = mask_url(settings.url)
            status["cluster_rebuilds"] = cluster_rebuilds(redis, cache)[0]
            if roles.separate and roles.cache_url:
                status["cache"]["url"] = mask_url(roles.cache_url)
            if roles.separate and roles.cache is None:
                status["cache"] = {"unreadable": True}
            text = json.dumps(status, indent=2) if args.json else render_text(status)
            if args.watch and not args.json:
                clear = "\x1b[H\x1b[2J" if tty else ""  # a pipe gets refreshes one after another
                text = f"{clear}{time.strftime('%H:%M:%S')}\n{text}"
            print(text, flush=True)
            if not args.watch:
                return
            await asyncio.sleep(args.interval)
    finally:
        await roles.aclose()


async def _export(
    args: argparse.Namespace, settings: RedisSettings, redis: Any, cache: Any
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve_status_metrics(
        redis, settings.keyspace(), cache, args.tenant, args.model, args.metrics_port,
        args.interval, stop, host=configured_metrics_host(args.metrics_host),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print the status (once, or until interrupted with --watch); returns the exit code.

    Raises:
        Unavailable, Forbidden: if Redis cannot be reached or refuses (the CLI reports it).
    """
    settings = RedisSettings.from_env()
    url, source = redis_url_source(args.redis_url)
    settings = dataclasses.replace(settings, url=url)
    if args.cache_url:
        settings = dataclasses.replace(settings, cache_url=args.cache_url)
    say_default_url(url, source, "lmq status")
    try:
        with redis_boundary("lmq status", settings.url):
            asyncio.run(_show(args, settings))
    except KeyboardInterrupt:  # how --watch and the exporter are left
        return 0
    return 0
