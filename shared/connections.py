"""Redis connections configured for streams.

Blocking stream reads (XREAD/XREADGROUP BLOCK) must not be cut by a socket timeout, so command
sockets have none; connecting is bounded instead, and idle connections are health-checked
before reuse so a Redis restart surfaces as one ConnectionError, not a hang.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

__all__ = ["async_redis", "sync_redis"]


def _options(connect_timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": None,
        "socket_connect_timeout": connect_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": 15,
        "max_connections": 64,
    }


def async_redis(url: str, connect_timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio client of the Redis at `url` (connects lazily, on first command)."""
    return aioredis.Redis.from_url(url, **_options(connect_timeout_s))


def sync_redis(url: str, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A blocking client of the Redis at `url`."""
    return redis.Redis.from_url(url, **_options(connect_timeout_s))
