"""`connect_redis_roles`: the one way a process connects to the queue and the shared cache.

Clients and workers both call it. The queue role is the URL a process is given; its
credentials are checked at once, so a wrong user or password is an `AuthenticationFailed`
within one round trip instead of a connection retried until a timeout. The cache role is,
in this order, the URL given for it (``LMQ_CACHE_URL``, ``--cache-url``), the address the
model's workers publish in the registry (`ModelInfo.cache_address`, no credentials) with
the queue URL's user and password (``lmq tenant add`` makes the same user on every instance
of the deployment), or the queue instance itself. A tenant's program therefore needs only
the one URL ``lmq tenant add`` printed.

A worker cannot serve without its cache user (`cache_required`): a refused login there is
fatal, an unreachable cache is retried lazily as before. A client can: if the cache refuses
or cannot be reached, it says so once and works without it (no shared-cache lookups, no
claim-checks it could not redeem), so workers never compute a result twice for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AuthenticationError, NoPermissionError

from .connections import bounded, connect_async_redis
from .redis_errors import REDIS_DOWN, translate
from .settings import RedisSettings, mask_url, same_instance, with_credentials_of

__all__ = ["CACHE_POLICY", "RedisRoles", "connect_redis_roles", "connect_queue", "cache_url_for"]

logger = logging.getLogger(__name__)

#: The cache role's eviction policy, as `ops/redis/cache.conf` ships it: the entry nearest its
#: expiry goes first, which, every entry written with the workers' one TTL, is the oldest write.
#: ``allkeys-lru`` ranks keys by a clock of one-second ticks: a cache holding only seconds of
#: results (a GPU fleet's gigabytes a second) evicted among them at random, claim-checks
#: fetched milliseconds after their write included (up to 1.6% of them in
#: ``lmq bench transport``).
CACHE_POLICY = "volatile-ttl"


@dataclass
class RedisRoles:
    """A process's asyncio clients of the two Redis roles."""

    queue: Any
    #: The cache role's client: `queue` itself on one instance; None where a client could not
    #: use the cache (it then works without one).
    cache: Any | None
    #: The cache role's URL (credentials included), None where `cache` is None.
    cache_url: str | None
    #: Whether `cache` is another instance than the queue's.
    separate: bool

    async def aclose(self) -> None:
        """Close both clients (once where they are the same)."""
        await self.queue.aclose()
        if self.separate and self.cache is not None:
            await self.cache.aclose()


def cache_url_for(settings: RedisSettings, published: str = "") -> str:
    """The URL of the cache role: the configured one, else the published address with the
    queue URL's credentials, else the queue's own URL."""
    if settings.cache_url:
        return settings.cache_url
    if published:
        return with_credentials_of(published, settings.url)
    return settings.url


async def connect_redis_roles(
    settings: RedisSettings,
    published_cache: str = "",
    *,
    cache_required: bool = True,
    queue: Any | None = None,
) -> RedisRoles:
    """Connect to the queue (or reuse `queue`, already connected) and to the cache role.

    Raises:
        AuthenticationFailed: if the queue, or a required cache, refuses the URL's user or
            password.
    """
    if queue is None:
        queue = await connect_queue(settings)
    url = cache_url_for(settings, published_cache)
    if same_instance(url, settings.url):
        return RedisRoles(queue, queue, settings.url, separate=False)
    cache = await connect_async_redis(url, settings.connect_timeout_s)
    try:
        await _check_login(cache, url, settings.connect_timeout_s, probe=not cache_required)
    except Exception as exc:
        await cache.aclose()
        if cache_required:
            await queue.aclose()
            raise
        logger.warning(
            "the shared cache at %s cannot be used (%s): this client works without it (no "
            "shared-cache lookups or claim-checks; every result travels inline). Ask the "
            "operator for a user there (lmq tenant add makes it) or set LMQ_CACHE_URL",
            mask_url(url), exc,
        )  # fmt: skip
        return RedisRoles(queue, None, None, separate=True)
    return RedisRoles(queue, cache, url, separate=True)


async def connect_queue(settings: RedisSettings) -> Any:
    """The queue role's client, its login checked (see `connect_redis_roles`)."""
    queue = await connect_async_redis(settings.url, settings.connect_timeout_s)
    try:
        await _check_login(queue, settings.url, settings.connect_timeout_s)
    except BaseException:
        await queue.aclose()
        raise
    return queue


async def _check_login(client: Any, url: str, timeout_s: float, probe: bool = False) -> None:
    """PING once: a refused login raises `AuthenticationFailed` at once. Otherwise an
    unreachable server is left to the caller's own retries, unless `probe` asks that it be
    reachable and let this user read (then any failure raises)."""
    what = "logging in"
    try:
        await bounded(client.ping(), timeout_s + 1, "PING")
    except AuthenticationError as exc:
        raise translate(exc, what, url) from exc
    except NoPermissionError:
        return  # a user without PING: its first real command will tell
    except REDIS_DOWN as exc:
        if probe:
            raise translate(exc, what, url) from exc
