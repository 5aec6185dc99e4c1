"""`RequestChannel`: everything that carries one client's requests to the workers and back.

A request takes an in-flight permit (at most ``max_inflight`` distinct requests are outstanding,
which bounds this client's memory and the replies queued for it in Redis however slowly it
reads them; further callers wait for a permit within their own deadline), joins an identical
in-flight request if there is one, and otherwise gets a request id and a deadline in the
`InflightTable`. The `Submitter` sends requests in micro-batches (shared-cache hits never
reach a worker); the `ReplyReader` settles them from this client's reply stream (read on a
`ReplyThread` of the client's own where Redis is plain TCP or a Unix socket, a single instance
or a cluster: vectors received in place, claim-checks fetched from the shared cache, 16-bit
vectors widened, all off the event loop) and resubmits everything in flight when Redis
restarted. Both are tasks the channel owns between `start` and `close` (the reply thread
with them); `close` fails whatever is still pending with `Cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import numpy as np

from lmqueue.shared.adapters import AdapterRecord
from lmqueue.shared.cluster_client import cluster_rebuilds
from lmqueue.shared.cluster_targets import SlotTargets
from lmqueue.shared.connections import bounded, is_cluster
from lmqueue.shared.errors import Cancelled, DeadlineExceeded
from lmqueue.shared.partitions import Partitioning, stream_partitions
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.resp_socket import target_of
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import Request

from .admission import Admission
from .claims import ClaimResolver
from .inflight import InflightTable, Pending
from .inflight_permits import InflightPermits
from .node_pipes import NodePipes
from .reply_reader import BLOCK_MS, ReplyReader
from .reply_thread import ReplyThread
from .resp_pipe import RespPipe
from .slot_pipe import SlotPipe
from .submitter import Submitter

__all__ = ["RequestChannel"]

_BLOCK_S = BLOCK_MS / 1000


class RequestChannel:
    """One client's send and receive sides, its in-flight requests and their permits.

    Args:
        info: the model's published info (its name, revision and backlog bound are used).
        settings: the client's settings.
        redis: the queue role's asyncio client; `cache_redis` the cache role's (may be the same).
        run_id: the queue server's run id at connect time, to notice a restart.
        on_restart: called (on the loop) after a Redis restart, once everything in flight has
            been queued again.
        cache_namespace: whose cached vectors to read (the operator's choice for the tenant,
            mirrored into its quota hash); empty: the tenant's own.
    """

    def __init__(
        self,
        info: ModelInfo,
        settings: ClientSettings,
        redis: Any,
        cache_redis: Any,
        run_id: str | None = None,
        on_restart: Callable[[], None] | None = None,
        cache_namespace: str = "",
    ) -> None:
        self.settings = settings
        self.client_id = uuid.uuid4().hex[:16]
        self.redis = redis
        self.cache_redis = cache_redis
        self._on_restart_hook = on_restart
        keys = settings.redis.keyspace()
        if cache_namespace:
            keys = keys.for_tenant(keys.tenant, cache_namespace)
        stall_timeout_s = settings.redis.stall_timeout_s
        self.permits = InflightPermits(settings.max_inflight)
        self.inflight = InflightTable(
            self.client_id, on_settled=self.permits.release, keep_float16=settings.half_results
        )
        #: The model's adapter records, kept current in place (`set_adapters`) for the cache.
        self._adapter_records: dict[str, AdapterRecord] = {}
        shared = (
            SharedCache(
                cache_redis,
                keys,
                info.name,
                info.revision,
                stall_timeout_s,
                info.vector_size,
                self._adapter_records,
            )
            if settings.use_shared_cache
            else None
        )
        timeout_s, url, cache_url = (settings.redis.connect_timeout_s, settings.redis.url,
                                     settings.redis.effective_cache_url)  # fmt: skip
        replies_pipe: RespPipe | SlotPipe | None = None
        if RespPipe.supports(url):  # on a cluster: aimed at the node of this client's replies
            replies_pipe = (
                SlotPipe(redis, keys.replies(self.client_id), url, timeout_s)
                if is_cluster(redis)
                else RespPipe(url, timeout_s)
            )
        claims_pipe, claims_nodes = None, None  # a cluster's claims span its masters
        if RespPipe.supports(cache_url):
            if is_cluster(cache_redis):
                claims_nodes = NodePipes(cache_redis, cache_url, timeout_s)
            else:
                claims_pipe = RespPipe(cache_url, timeout_s)
        self.pipes: list[RespPipe | SlotPipe | NodePipes | None] = [
            replies_pipe, claims_pipe, claims_nodes
        ]  # fmt: skip
        self.claims = ClaimResolver(
            cache_redis, stall_timeout_s, pipe=claims_pipe, vector_size=info.vector_size,
            nodes=claims_nodes,
        )  # fmt: skip
        self.thread = self._reply_thread(redis, cache_redis, settings)
        self.keys = keys
        self.submitter = Submitter(
            self.inflight, shared, self._admissions(info), stall_timeout_s,
            Partitioning(info.partitions, info.partition_block_tokens),
        )  # fmt: skip
        self.reader = ReplyReader(
            redis, keys.replies(self.client_id), self.inflight, on_restart=self._restarted,
            read_count=settings.read_count, run_id=run_id, stall_timeout_s=stall_timeout_s,
            claims=self.claims, on_claim_missed=self._ask_inline, pipe=replies_pipe,
            thread=self.thread,
        )  # fmt: skip
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False

    def _reply_thread(
        self, redis: Any, cache_redis: Any, settings: ClientSettings
    ) -> ReplyThread | None:
        """A reply thread, where the queue and the cache are plain TCP or Unix sockets (each a
        single instance or a cluster)."""
        if not (
            RespPipe.supports(settings.redis.url)
            and RespPipe.supports(settings.redis.effective_cache_url)
        ):
            return None
        replies = None if is_cluster(redis) else target_of(redis)
        cache = SlotTargets(cache_redis) if is_cluster(cache_redis) else target_of(cache_redis)
        if (replies is None and not is_cluster(redis)) or cache is None:
            return None
        redis_settings = settings.redis
        return ReplyThread(
            replies, cache, self.claims, redis_settings.connect_timeout_s,
            _BLOCK_S + redis_settings.stall_timeout_s, keep_float16=settings.half_results,
        )  # fmt: skip

    def _admissions(self, info: ModelInfo) -> list[Admission]:
        """One admission per request stream of the model (per partition, if it has several)."""
        bound, keys, name = self.settings.max_backlog or info.max_backlog, self.keys, info.name
        return [
            Admission(
                self.redis, keys.requests(name, p), bound, keys.quota(name, p), keys.rate(name, p)
            )  # fmt: skip
            for p in stream_partitions(info.partitions)
        ]

    def set_adapters(self, records: dict[str, AdapterRecord]) -> None:
        """The model's adapter records, for the cache keys of adapters' rows."""
        self._adapter_records.clear()
        self._adapter_records.update(records)

    def adopt(self, info: ModelInfo) -> None:
        """Send by the model's info as re-published (a new backlog bound or partitioning)."""
        self.submitter.admissions = self._admissions(info)
        chosen = self.submitter.partitioning
        if (chosen.count, chosen.block_tokens) != (info.partitions, info.partition_block_tokens):
            self.submitter.partitioning = Partitioning(info.partitions, info.partition_block_tokens)

    def start(self) -> None:
        """Start the submitting and reply-reading tasks on the running loop."""
        self._tasks = [
            asyncio.create_task(self.submitter.run(), name=f"lmq-submit-{self.client_id}"),
            asyncio.create_task(self.reader.run(), name=f"lmq-replies-{self.client_id}"),
        ]

    async def close(self) -> None:
        """Stop both tasks, fail pending requests with `Cancelled`, delete the reply stream."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inflight.fail_all(Cancelled, "the client was closed")
        for pipe in self.pipes:
            if pipe is not None:
                pipe.close()
        if self.thread is not None:
            self.thread.close()
        # Replies still on their way recreate the stream, with the workers' TTL on it.
        with contextlib.suppress(Exception):
            await bounded(self.redis.delete(self.reader.stream), 1.0, "deleting replies")

    async def request(self, prompt: PromptKey, kind: str, dtype: str, **extra: Any) -> np.ndarray:
        """Submit (or join) one request and wait for its result vector.

        The vector is as it travelled, except that float16 and bfloat16 ones come widened to
        float32 (float16 ones not, with ``half_results``); a writable one is the first
        caller's own, later callers get copies.

        Args: the prompt's key (its adapter and token bytes), the kind (``logprobs`` or
        ``mass``), the wire dtype, and for masses the `Request` fields ``mass_op``,
        ``node_bytes``, ``vocab_digest``.
        """
        if self.closed:
            raise Cancelled("the client is closed")
        dedup_key = (prompt, kind, dtype, *sorted(extra.items()))
        pending = self.inflight.find(dedup_key)
        if pending is None:
            pending = await self._new_request(prompt, dedup_key, kind, dtype, extra)
        waiter = self.inflight.wait(pending)
        try:
            return await waiter
        except asyncio.CancelledError:
            self.inflight.leave(pending, waiter)
            raise

    async def _new_request(
        self, prompt: PromptKey, dedup_key: Hashable, kind: str, dtype: str, extra: dict[str, Any]
    ) -> Pending:
        """Take an in-flight permit (waiting within the deadline if all are taken) and submit.

        The permit is given back when the request settles, however it settles (`InflightTable`).
        """
        timeout_s = self.settings.timeout_s
        started = time.time()
        try:
            if not self.permits.take_now():  # not asyncio.timeout: see shared.connections.bounded
                await asyncio.wait_for(self.permits.take(), timeout_s or None)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no in-flight permit within {timeout_s:g} s (max_inflight="
                f"{self.settings.max_inflight})", timeout_s=timeout_s,
            ) from None  # fmt: skip
        joined = self.inflight.find(dedup_key)  # made by another caller while this one waited
        if joined is not None or self.closed:
            self.permits.release()
            if joined is None:
                raise Cancelled("the client is closed")
            return joined
        remaining_s = max(timeout_s - (time.time() - started), 0.001) if timeout_s else 0
        deadline_ms = int((started + timeout_s) * 1000) if timeout_s else 0
        logprobs = kind == "logprobs"
        request = Request(
            self.inflight.next_request_id(), self.client_id, prompt.tokens, kind, dtype,
            deadline_ms, claims=logprobs and self.claims.enabled, adapter=prompt.adapter,
            packs=True, looked=logprobs and self.submitter.cache is not None, **extra,
        )  # fmt: skip
        pending = self.inflight.add(request, prompt, dedup_key, remaining_s)
        self.submitter.submit(pending)
        return pending

    def _ask_inline(self, request_ids: list[str]) -> None:
        """Their claimed results were gone: send them again, asking for inline replies."""
        again = []
        for request_id in request_ids:
            pending = self.inflight.get(request_id)
            if pending is not None:
                pending.request = replace(pending.request, claims=False, looked=False)
                pending.inline_retry = True
                again.append(pending)
        self.submitter.resubmit(again)

    def _restarted(self) -> None:
        """Redis restarted: resubmit everything in flight, then tell the owner."""
        self.submitter.resubmit(self.inflight)
        if self._on_restart_hook is not None:
            self._on_restart_hook()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests sent, shared-cache hits, replies read, claim-checks, reconnects,
        rebuilds of a Redis Cluster client that had lost every node (`shared.cluster_client`)."""
        return {
            "sent": self.submitter.sent,
            "cache_hits": self.submitter.cache_hits,
            "replies_read": self.reader.replies_read,
            "duplicate_replies": self.inflight.duplicate_replies,
            "claims_resolved": self.claims.resolved,
            "claims_missed": self.claims.missed,
            "reconnects": self.reader.reconnects,
            "server_restarts": self.reader.restarts_seen,
            "inflight": len(self.inflight),
            **self._cluster_stats(),
        }

    def _cluster_stats(self) -> dict[str, int]:
        """Rebuilds of the cluster clients (queue and cache roles) and whether one runs now."""
        rebuilds, rebuilding = cluster_rebuilds(self.redis, self.cache_redis)
        return {"cluster_rebuilds": rebuilds, "cluster_rebuilding": int(rebuilding)}
