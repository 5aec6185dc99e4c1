"""`ReplyWriter`: what one batch writes back to Redis, and the claim-check decision.

A batch's `Outcome` holds replies (errors, cached results), fresh results that could travel
as claim-checks, cache entries, dead letters and acknowledgements. The writer decides how
each fresh result travels, writes everything, and only then acknowledges:

- A result goes out as a claim-check (its cache key instead of the vector) only if its
  cache entry is known to be stored: a separate cache instance is written first and its
  answer decides; on the queue's own instance the entries are written in the replies'
  pipeline, ahead of them. Any other result goes inline.
- If Redis refuses a cache entry written in the same pipeline as its claim-check (an ACL, a
  read-only replica: out of memory would have refused the replies too), that client pays one
  more request; claim-checks then pause for a minute rather than repeat it.
- Everything else (replies, dead letters, acks) is written in one pipeline, retried while
  Redis is down; entries stay pending if it never comes back, for a janitor to reclaim.
- On a Redis Cluster a pipeline's commands go to their keys' nodes concurrently, so order
  holds only per node: cache entries are written first (as for a separate cache instance),
  and acknowledgements after the replies, in a pipeline of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container
from typing import Any

from lmqueue.shared.connections import bounded, execute_pipeline, is_cluster
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import encode_claim, encode_result

from .metrics import WorkerMetrics
from .outcome import Outcome
from .request_stream import RequestStream

__all__ = ["ReplyWriter"]

logger = logging.getLogger(__name__)

_CLAIM_PAUSE_S = 60


class ReplyWriter:
    """Writes batch outcomes: cache entries, replies (inline or claim-check), dead letters, acks."""

    def __init__(
        self,
        redis: Any,
        stream: RequestStream,
        keys: KeySpace,
        settings: WorkerSettings,
        cache: SharedCache | None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.keys = keys
        self.settings = settings
        self.cache = cache
        self.metrics = metrics
        self.claims_paused_until = 0.0
        self._cluster = is_cluster(redis)

    async def flush(self, outcome: Outcome, attempts: int = 20) -> None:
        """Write `outcome`; retry while Redis is down, then leave its entries pending."""
        cache = self.cache
        apart = cache is not None and (cache.redis is not self.redis or self._cluster)
        if outcome.cache_puts and cache is not None and apart:
            stored = await cache.put_many(outcome.cache_puts, self.settings.cache_ttl_s)
            puts = zip(outcome.cache_puts, stored, strict=True)
            self._settle_claims(outcome, {key for (key, _), ok in puts if ok})
            outcome.cache_puts = []
        for attempt in range(attempts):
            try:
                timeout_s = self.settings.redis.stall_timeout_s
                await bounded(self._write(outcome), timeout_s, "writing replies")
                self._observe(outcome)
                return
            except REDIS_DOWN as exc:
                logger.warning("writing replies failed (%s); attempt %d", exc, attempt + 1)
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0))
        logger.error("gave up writing %d replies; their entries stay pending", len(outcome.replies))

    def _settle_claims(self, outcome: Outcome, stored: Container[str]) -> None:
        """Turn claimable results into replies: claim-checks for keys in `stored`, else inline."""
        sent = 0
        for item in outcome.claimable:
            if item.key in stored:
                fields = encode_claim(item.request_id, item.key, item.dtype)
                sent += 1
            else:
                fields = encode_result(item.request_id, item.payload, item.dtype)
            outcome.replies.append((item.client_id, fields))
        if self.metrics is not None:
            self.metrics.count_claim_checks(sent, len(outcome.claimable) - sent)
        outcome.claimable = []

    def _observe(self, outcome: Outcome) -> None:
        """Count what was written: replies by outcome, dead letters, times since XADD."""
        if self.metrics is None:
            return
        tenant = self.keys.tenant
        for name, count in outcome.outcomes.items():
            self.metrics.count_requests(tenant, name, count)
        self.metrics.count_dead_letters(tenant, len(outcome.dead))
        self.metrics.observe_replied(tenant, outcome.acks)

    async def _write(self, outcome: Outcome) -> None:
        """One pipeline: cache entries (same instance only), replies, dead letters, acks."""
        puts = outcome.cache_puts
        self._settle_claims(outcome, {key for key, _ in puts} if self._claims_allowed() else ())
        async with self.redis.pipeline(transaction=False) as pipe:
            SharedCache.queue_puts(pipe, puts, self.settings.cache_ttl_s)
            reply_keys = set()
            for client_id, fields in outcome.replies:
                key = self.keys.replies(client_id)
                reply_keys.add(key)
                pipe.xadd(key, fields)
            for key in reply_keys:
                pipe.expire(key, self.settings.reply_ttl_s)
            dead_stream = self.keys.dead_letters(self.settings.model)
            for entry, reason in outcome.dead:
                dead: dict[Any, bytes] = {**entry.fields, b"lmq.reason": reason.encode(),
                                          b"lmq.entry_id": entry.entry_id.encode()}  # fmt: skip
                # an archive for operators, not a queue: capped, unlike the request stream
                pipe.xadd(dead_stream, dead, maxlen=self.settings.max_dead_letters or None,
                          approximate=True)  # fmt: skip
            if not self._cluster:
                self.stream.ack(pipe, outcome.acks)
            results = await execute_pipeline(pipe, raise_on_error=False)
        self._check_written(results, len(puts))
        if self._cluster and outcome.acks:  # only once every reply is written, on any node
            async with self.redis.pipeline(transaction=False) as pipe:
                self.stream.ack(pipe, outcome.acks)
                for result in await execute_pipeline(pipe, raise_on_error=False):
                    if isinstance(result, Exception):
                        raise result

    def _claims_allowed(self) -> bool:
        return time.monotonic() >= self.claims_paused_until

    def _check_written(self, results: list[Any], puts: int) -> None:
        """Raise the first failure past the cache entries; pause claims if an entry failed."""
        failed_puts = [r for r in results[:puts] if isinstance(r, Exception)]
        if failed_puts:
            if self._claims_allowed():
                logger.warning("the queue instance refused %d cache entries (%s); claim-checks "
                               "paused for %d s", len(failed_puts), failed_puts[0],
                               _CLAIM_PAUSE_S)  # fmt: skip
            self.claims_paused_until = time.monotonic() + _CLAIM_PAUSE_S
        for result in results[puts:]:
            if isinstance(result, Exception):
                raise result
