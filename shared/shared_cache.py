"""The Redis-backed output cache that every worker and client of a model shares.

A value is one result vector as raw little-endian bytes, under a key made of model, revision,
result kind (``lp.float32``, ``lp.float16``) and a digest of the exact token tuple, so a new
model revision or wire dtype never reads stale entries. A row of a LoRA adapter carries the
adapter's name and revision too (its record in `adapters`), and a private adapter's rows stay
in its tenant's own namespace even when the tenant shares a cache pool (the one spelling of
those keys: `PromptKey.cache_key`). Entries carry a TTL; memory is bounded by that TTL and, on
a dedicated cache instance, by its LRU policy (ops/redis/cache.conf).
Cache operations are best effort: a failing cache slows requests down but never fails them.
Writes report which entries were stored, because a worker may only hand out a claim-check (a
reply naming a cache key instead of carrying the vector, see `shared.wire`) for an entry that
is really there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .adapters import AdapterRecord
from .connections import bounded, multi_get
from .keys import KeySpace, token_digest
from .prompt_key import PromptKey
from .wire import holds_vector, payload_bytes

__all__ = ["SharedCache", "logprobs_kind"]

logger = logging.getLogger(__name__)


def logprobs_kind(dtype: str) -> str:
    """The cache kind of next-token log-probabilities in wire dtype `dtype`."""
    return f"lp.{dtype}"


class SharedCache:
    """Batched get and put of result vectors for one model revision."""

    def __init__(
        self,
        redis: Any,
        keys: KeySpace,
        model: str,
        revision: str,
        timeout_s: float = 10.0,
        vector_size: int = 0,
        adapters: dict[str, AdapterRecord] | None = None,
    ) -> None:
        self.redis = redis
        self.timeout_s = timeout_s
        self._mget = multi_get(redis)  # split per node on a cluster
        #: Values read must hold exactly this many values of their dtype (0: whole values).
        self.vector_size = vector_size
        self._keys = keys
        self._model = model
        self._revision = revision
        #: The model's adapter records by name: the owner's own dict (client or worker), which
        #: it keeps current in place; an adapter's keys carry its record's revision.
        self.adapters: dict[str, AdapterRecord] = {} if adapters is None else adapters
        #: The base model's key prefix of each dtype (`KeySpace.cache_prefix`), made once.
        self._base_prefixes: dict[str, str] = {}

    def key_of(self, prompt: PromptKey, dtype: str) -> str:
        """The cache key of `prompt`'s log-probabilities in `dtype` (`PromptKey.cache_key`).

        A base-model prompt's key is its dtype's prefix, made once, and its tokens' digest: a
        key a request on the worker's loop and in the client, where the calls that build the
        prefix again each time cost about as much as the digest.

        Raises:
            KeyError: the prompt's adapter is not in `adapters` (callers check names first).
        """
        if prompt.adapter is None:
            prefix = self._base_prefixes.get(dtype)
            if prefix is None:
                prefix = self._base_prefixes[dtype] = self._keys.cache_prefix(
                    self._model, self._revision, logprobs_kind(dtype)
                )
            return prefix + token_digest(prompt.tokens)
        return prompt.cache_key(
            self._keys, self._model, self._revision, logprobs_kind(dtype), self.adapters
        )

    def key(self, dtype: str, token_bytes: bytes, adapter: str | None = None) -> str:
        """`key_of` for a caller holding the raw fields: token bytes and adapter (None: base)."""
        return self.key_of(PromptKey(adapter, token_bytes), dtype)

    async def get_many(
        self, keys: Sequence[str], dtypes: Sequence[str] | None = None
    ) -> list[bytes | None]:
        """Values of `keys` in order, None for misses; all misses if the cache is unreachable.

        With `dtypes` (one per key), a value that is not a vector of that dtype and of
        `vector_size` values is a miss: whoever wrote it, it is never handed out.
        """
        if not keys:
            return []
        try:
            values = list(await bounded(self._mget(keys), self.timeout_s, "shared cache read"))
        except Exception as exc:  # the cache is an optimisation; never fail a request on it
            logger.warning("shared cache read failed: %s", exc)
            return [None] * len(keys)
        if dtypes is None:
            return values
        checked = [
            value if value is None or holds_vector(value, dtype, self.vector_size) else None
            for value, dtype in zip(values, dtypes, strict=True)
        ]
        if (bad := sum(v is not None for v in values) - sum(v is not None for v in checked)) > 0:
            logger.warning("ignored %d cached values of the wrong size or dtype", bad)
        return checked

    async def put_many(self, items: Sequence[tuple[str, Any]], ttl_s: int) -> list[bool]:
        """Store `(key, value)` pairs with a TTL; which were stored, in order.

        Failures (out of memory, an unreachable or silent cache) are logged, never raised.
        """
        if not items:
            return []
        try:
            return await bounded(self._put(items, ttl_s), self.timeout_s, "shared cache write")
        except Exception as exc:
            logger.warning("shared cache write of %d entries failed: %s", len(items), exc)
            return [False] * len(items)

    async def _put(self, items: Sequence[tuple[str, Any]], ttl_s: int) -> list[bool]:
        async with self.redis.pipeline(transaction=False) as pipe:
            self.queue_puts(pipe, items, ttl_s)
            results = await pipe.execute(raise_on_error=False)
        stored = [result is True for result in results]
        if not all(stored):
            failed = next(r for r in results if r is not True)
            logger.warning("shared cache refused %d of %d entries: %s",
                           stored.count(False), len(items), failed)  # fmt: skip
        return stored

    @staticmethod
    def queue_puts(pipe: Any, items: Sequence[tuple[str, Any]], ttl_s: int) -> None:
        """Queue the SETs of `items` on a pipeline of the cache's instance (one SET each)."""
        for command in SharedCache.set_commands(items, ttl_s):
            pipe.execute_command(*command)

    @staticmethod
    def set_commands(items: Sequence[tuple[str, Any]], ttl_s: int) -> list[tuple[Any, ...]]:
        """The SET commands that store `items` with a TTL (none: 0), in order (deferred
        payloads made into bytes here, on the writer's thread)."""
        if ttl_s:
            return [("SET", key, payload_bytes(value), "EX", ttl_s) for key, value in items]
        return [("SET", key, payload_bytes(value)) for key, value in items]
