"""The Redis-backed output cache that every worker and client of a model shares.

A value is one result vector as raw little-endian bytes, under a key made of model, revision,
result kind (``lp.float32``, ``lp.float16``) and a digest of the exact token tuple, so a new
model revision or wire dtype never reads stale entries. Entries carry a TTL; memory is bounded
by that TTL and, on a dedicated cache instance, by its LRU policy (ops/redis/cache.conf).
Cache operations are best effort: a failing cache slows requests down but never fails them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .keys import KeySpace

__all__ = ["SharedCache", "logprobs_kind"]

logger = logging.getLogger(__name__)


def logprobs_kind(dtype: str) -> str:
    """The cache kind of next-token log-probabilities in wire dtype `dtype`."""
    return f"lp.{dtype}"


class SharedCache:
    """Batched get and put of result vectors for one model revision."""

    def __init__(self, redis: Any, keys: KeySpace, model: str, revision: str) -> None:
        self._redis = redis
        self._keys = keys
        self._model = model
        self._revision = revision

    def key(self, dtype: str, token_bytes: bytes) -> str:
        """The cache key of the log-probabilities of `token_bytes` in `dtype`."""
        return self._keys.cache_entry(
            self._model, self._revision, logprobs_kind(dtype), token_bytes
        )

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of `keys` in order, None for misses; all misses if the cache is unreachable."""
        if not keys:
            return []
        try:
            return list(await self._redis.mget(keys))
        except Exception as exc:  # the cache is an optimisation; never fail a request on it
            logger.warning("shared cache read failed: %s", exc)
            return [None] * len(keys)

    async def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Store `(key, value)` pairs with a TTL; failures (e.g. OOM) are logged and ignored."""
        if not items:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, value in items:
                    pipe.set(key, value, ex=ttl_s or None)
                await pipe.execute()
        except Exception as exc:
            logger.warning("shared cache write of %d entries failed: %s", len(items), exc)
