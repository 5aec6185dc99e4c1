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
- On the writer thread, a large batch's fresh results are written in parts of about
  `REPLY_PART_BYTES` (cache entries, then their claim-checks, part after part; the acks with
  the last; redis-py's path, over TLS, writes a batch whole): a lock-step
  program's client reads and converts the first part while the writer writes the next, where
  it waited for all of a step's rows (a GPU worker's batch of 64 rows is 12.6 MB of float32).
- On a Redis Cluster a pipeline's commands go to their keys' nodes concurrently, so order
  holds only per node: cache entries are written first (as for a separate cache instance),
  and acknowledgements after the replies, in a pipeline of their own.
- A batch may hold a tenant's entries of several partitions, answered as one
  (`Outcome.acks_by_stream`): each entry is acknowledged on the stream it was read from.

Where the connections are plain (not TLS), all of it runs on the worker's `WriterThread`:
blocking connections, one ``sendmsg`` per pipeline and node (`threaded_write`), while the
event loop goes on with the next batch. Over TLS redis-py's asyncio pipelines write it, and
on a cluster they write a batch whose slot moved meanwhile (they follow the redirection).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container
from typing import Any

from lmqueue.shared import stage_trace
from lmqueue.shared.connections import bounded, execute_pipeline, is_cluster
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.resp_socket import Target
from lmqueue.shared.serial_torch import serial_torch_here
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import encode_claim, encode_result, payload_bytes

from .metrics import WorkerMetrics
from .outcome import Outcome
from .reply_routes import Routes
from .request_stream import RequestStream
from .threaded_write import (
    Redirected,
    Routed,
    execute_routed,
    put_routed,
    reply_commands,
    routed_sets,
)
from .writer_thread import WriterThread

__all__ = ["ReplyWriter"]

logger = logging.getLogger(__name__)

_CLAIM_PAUSE_S = 60
#: A batch's fresh results are written in parts of about this many bytes: a client reads
#: (claims) the first while the writer writes the next, instead of waiting for all of them:
#: a 64-row step of a 49,152-token vocabulary is 12.6 MB of float32 (BENCHMARKS.md, model).
REPLY_PART_BYTES = 4 << 20
#: Reply stream names kept (one per client recently answered); cleared when full.
_REPLY_KEYS_KEPT = 4096


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
        thread: WriterThread | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.keys = keys
        self.settings = settings
        self.cache = cache
        self.metrics = metrics
        self.claims_paused_until = 0.0
        self._cluster = is_cluster(redis)
        clients = [redis] if cache is None else [redis, cache.redis]
        #: Writes on the writer thread where it can reach every instance; else redis-py.
        self.thread = thread if all(Routes.supports(c) for c in clients) else None
        self._routes = Routes(redis)
        self._cache_routes = self._routes if cache is None else Routes(cache.redis)
        self._reply_keys: dict[str, str] = {}
        #: Batches written through redis-py because a cluster slot had moved.
        self.redirected = 0

    @property
    def _apart(self) -> bool:
        """Whether cache entries are written before the replies, apart (another instance,
        or a cluster, where order holds per node only)."""
        cache = self.cache
        return cache is not None and (cache.redis is not self.redis or self._cluster)

    async def flush(self, outcome: Outcome, attempts: int = 20) -> None:
        """Write `outcome`; retry while Redis is down, then leave its entries pending."""
        thread = self.thread
        if thread is None:
            await self._put_apart(outcome)
        for attempt in range(attempts):
            try:
                if thread is not None:
                    await self._write_on_thread(thread, outcome)
                else:
                    timeout_s = self.settings.redis.stall_timeout_s
                    await bounded(self._write(outcome), timeout_s, "writing replies")
                self._observe(outcome)
                return
            except REDIS_DOWN as exc:
                logger.warning("writing replies failed (%s); attempt %d", exc, attempt + 1)
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0))
        logger.error("gave up writing %d replies; their entries stay pending", len(outcome.replies))

    async def _put_apart(self, outcome: Outcome) -> None:
        """redis-py's path: cache entries apart first; their answers decide the claims."""
        cache = self.cache
        if outcome.cache_puts and cache is not None and self._apart:
            stored = await cache.put_many(outcome.cache_puts, self.settings.cache_ttl_s)
            puts = zip(outcome.cache_puts, stored, strict=True)
            self._settle_claims(outcome, {key for (key, _), ok in puts if ok})
            outcome.cache_puts = []

    async def _write_on_thread(self, thread: WriterThread, outcome: Outcome) -> None:
        """Write on the writer thread; through redis-py if a cluster slot moved meanwhile."""
        reply_keys, routes = self._route(outcome)
        try:
            await thread.run(self._write_blocking, thread, outcome, reply_keys, routes)
        except Redirected as exc:
            self.redirected += 1
            self._routes.stale()
            self._cache_routes.stale()
            logger.info("a slot moved (%s); writing this batch through redis-py", exc)
            await self._put_apart(outcome)
            await bounded(self._write(outcome), self.settings.redis.stall_timeout_s,
                          "writing replies")  # fmt: skip

    def _route(self, outcome: Outcome) -> tuple[dict[str, str], dict[str, Target]]:
        """The batch's reply streams by client, and every key it writes to its connection
        (on the loop: redis-py's slot map is read here)."""
        known = self._reply_keys
        if len(known) > _REPLY_KEYS_KEPT:
            known.clear()
        reply_keys: dict[str, str] = {}
        for client_id in [c for c, _ in outcome.replies] + [i.client_id for i in outcome.claimable]:
            if client_id not in reply_keys:
                key = known.get(client_id)
                if key is None:
                    key = known[client_id] = self.keys.replies(client_id)
                reply_keys[client_id] = key
        routes = {key: self._cache_routes.of(key) for key, _ in outcome.cache_puts}
        streams = [stream for stream, _ in outcome.ack_groups(self.stream.stream)]
        for key in [*reply_keys.values(), *streams, self._dead_stream]:
            routes[key] = self._routes.of(key)
        return reply_keys, routes

    @property
    def _dead_stream(self) -> str:
        return self.keys.dead_letters(self.settings.model)

    def _write_blocking(
        self,
        thread: WriterThread,
        outcome: Outcome,
        reply_keys: dict[str, str],
        routes: dict[str, Target],
    ) -> None:
        """On the writer thread: a large batch's fresh results in parts of about
        `REPLY_PART_BYTES` (`Outcome.in_parts`), then the rest; in each, cache entries apart
        first, then the replies, acks last (only the rest has any). A written part is dropped
        from `outcome`, so a retry after an outage writes only what is left."""
        stage_trace.mark("writer_start", len(outcome.acks))
        serial_torch_here()  # deferred payloads convert here, one op each
        ttl_s = self.settings.cache_ttl_s
        for part in outcome.in_parts(REPLY_PART_BYTES):
            if part.cache_puts and self._apart:
                self._settle_claims(part, put_routed(thread, part.cache_puts, routes, ttl_s))
                part.cache_puts = []
            puts = part.cache_puts
            self._settle_claims(part, {key for key, _ in puts} if self._claims_allowed() else ())
            commands = routed_sets(puts, routes, ttl_s)
            commands += reply_commands(part, reply_keys, routes, self.settings, self._dead_stream)
            acks = self._ack_commands(part, routes)
            if not self._cluster:  # one instance: in the same pipeline, after the replies
                commands, acks = commands + acks, []
            stage_trace.mark("writer_cmds")
            self._check_written(execute_routed(thread, commands), len(puts))
            if acks:  # a cluster: only once every reply is written, on any node
                for result in execute_routed(thread, acks):
                    if isinstance(result, Exception):
                        raise result
        stage_trace.mark("writer_done")

    def _ack_commands(self, outcome: Outcome, routes: dict[str, Target]) -> list[Routed]:
        """XACK and XDEL of the outcome's entries, on each stream they were read from."""
        group = self.stream.group
        commands: list[Routed] = []
        for stream, ids in outcome.ack_groups(self.stream.stream):
            target = routes[stream]
            commands += [(target, ("XACK", stream, group, *ids)), (target, ("XDEL", stream, *ids))]
        return commands

    def _queue_acks(self, pipe: Any, outcome: Outcome) -> None:
        """Queue the outcome's acknowledgements on a redis-py pipeline (see `_ack_commands`)."""
        for stream, ids in outcome.ack_groups(self.stream.stream):
            pipe.xack(stream, self.stream.group, *ids)
            pipe.xdel(stream, *ids)

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
            for client_id, fields in outcome.reply_entries():
                key = self.keys.replies(client_id)
                reply_keys.add(key)
                pipe.xadd(key, {name: payload_bytes(value) for name, value in fields.items()})
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
                self._queue_acks(pipe, outcome)
            results = await execute_pipeline(pipe, raise_on_error=False)
        self._check_written(results, len(puts))
        if self._cluster and outcome.acks:  # only once every reply is written, on any node
            async with self.redis.pipeline(transaction=False) as pipe:
                self._queue_acks(pipe, outcome)
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
            if isinstance(result, list):  # a transaction's (EXEC) answers
                failed = next((r for r in result if isinstance(r, Exception)), None)
                if failed is not None:
                    raise failed
