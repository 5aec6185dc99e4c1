"""Redis connections configured for streams, and a watchdog for reads that may never return.

Blocking stream reads (XREAD/XREADGROUP BLOCK) must not be cut by a socket timeout, so command
sockets have none; connecting is bounded instead, idle connections are health-checked before
reuse (a Redis restart surfaces as one ConnectionError, not a hang), and the kernel gives up on
a peer that vanished from the network (keepalive probes, ``TCP_USER_TIMEOUT``) in about half a
minute.

A peer whose kernel still acknowledges but that never answers (a frozen Redis, a userspace
proxy that lost its upstream) passes those checks, so the calls every request depends on (a
client's reply reads and sends, a worker's request reads and reply writes) run in `bounded`
and are retried on a fresh connection. Not a socket timeout, and not ``asyncio.timeout``: on
3.11 redis-py's zero-delay timeouts can leave a task's cancel count one too high, and an
enclosing timeout then turns a real cancellation into a TimeoutError, so the task never stops
(reproduced: 10 of 40 cancellations of a reader with ``socket_timeout=10`` were swallowed).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["async_redis", "sync_redis", "bounded"]

T = TypeVar("T")

#: Probe an idle connection after 10 s, every 5 s, give up after 3 unanswered probes; give up
#: on data unacknowledged for 30 s (Linux names; options a platform lacks are left out).
_KEEPALIVE = {
    option: value
    for name, value in (
        ("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", 30_000),
    )
    if (option := getattr(socket, name, None)) is not None
}  # fmt: skip


def _options(connect_timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout_s,
        "socket_keepalive": True,
        "socket_keepalive_options": _KEEPALIVE,
        "health_check_interval": 15,
        "max_connections": 64,
    }


def async_redis(url: str, connect_timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio client of the Redis at `url` (connects lazily, on first command)."""
    return aioredis.Redis.from_url(url, **_options(connect_timeout_s))


def sync_redis(url: str, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A blocking client of the Redis at `url`."""
    return redis.Redis.from_url(url, **_options(connect_timeout_s))


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await `awaitable` in a task of its own; past `timeout_s`, cancel it and raise.

    Cancelling a redis-py command closes its connection, so the caller's retry starts on a
    fresh one.

    Raises:
        redis.exceptions.TimeoutError: if `awaitable` took longer than `timeout_s`.
    """
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(_retrieve)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()
    if not done:
        await asyncio.wait({task})
        raise RedisTimeoutError(f"{what} got no answer in {timeout_s:g} s")
    return task.result()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark an abandoned task's outcome as seen (its caller already moved on)."""
    if not task.cancelled():
        task.exception()
