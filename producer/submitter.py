"""`Submitter`: sends the client's new requests in micro-batches.

Requests made in the same event-loop pass are sent together: one MGET against the shared
cache answers the hits without any worker, then the misses are added to the model's request
stream (through `Admission`, which refuses batches past the backlog bound, and requests past
the tenant's quotas with `QuotaExceeded`). A model split into partitions has one stream and
one `Admission` each; a request goes to the partition its prompt chooses
(`shared.partitions.Partitioning`), and the partitions of one batch are sent concurrently.
While
Redis is unreachable, or a send gets no answer within the stall timeout, the batch is kept
and retried with backoff until each request's own deadline settles it (a retried send may
enqueue a request twice; it is answered twice and settled once). A refusal by Redis itself
(out of memory, a wrong key type) fails the batch's requests with a typed error at once;
nothing ends the task but cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from redis.exceptions import RedisError

from lmqueue.shared import stage_trace
from lmqueue.shared.backoff import Backoff
from lmqueue.shared.connections import bounded
from lmqueue.shared.errors import Busy, LMQueueError, QuotaExceeded, Unavailable
from lmqueue.shared.partitions import Partitioning
from lmqueue.shared.redis_errors import REDIS_DOWN, translate
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import Reply, encode_request

from .admission import Admission
from .inflight import InflightTable, Pending

__all__ = ["Submitter"]

logger = logging.getLogger(__name__)


class Submitter:
    """Owns the send side of one client: a queue of pending requests and one task draining it."""

    def __init__(
        self,
        inflight: InflightTable,
        cache: SharedCache | None,
        admissions: Admission | Sequence[Admission],
        stall_timeout_s: float = 10.0,
        partitioning: Partitioning | None = None,
    ) -> None:
        self.inflight = inflight
        self.stall_timeout_s = stall_timeout_s
        self.cache = cache
        self.admissions = [admissions] if isinstance(admissions, Admission) else list(admissions)
        self.partitioning = partitioning or Partitioning(len(self.admissions))
        if self.partitioning.count != len(self.admissions):
            raise ValueError("one admission per partition is needed")
        self._queue: list[Pending] = []
        self._wake = asyncio.Event()
        self.sent = 0
        self.cache_hits = 0

    def submit(self, pending: Pending) -> None:
        """Queue a request for the next micro-batch."""
        self._queue.append(pending)
        self._wake.set()

    def resubmit(self, pendings: Iterable[Pending]) -> None:
        """Queue requests again (after a reconnect); request ids make duplicates harmless."""
        self._queue.extend(pendings)
        self._wake.set()

    async def run(self) -> None:
        """Drain the queue forever (cancel to stop)."""
        backoff = Backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self._live(self._queue)
            self._queue = []
            if not batch:
                continue
            try:
                await bounded(self._send(batch), self.stall_timeout_s, "submitting requests")
                backoff.reset()
            except REDIS_DOWN as exc:
                logger.warning("submitting %d requests failed (%s); retrying", len(batch), exc)
                self._queue[:0] = batch
                await backoff.wait()
                self._wake.set()
            except Exception as exc:  # refused or a bug: fail these requests, keep the task
                self._refuse(batch, exc)

    def _refuse(self, batch: list[Pending], exc: Exception) -> None:
        """Fail requests that Redis refused (e.g. OOM) or that hit an unexpected error."""
        error: LMQueueError
        if isinstance(exc, RedisError):
            error = translate(exc, "submitting requests")
        else:
            logger.error("submitting %d requests failed", len(batch), exc_info=exc)
            error = Unavailable(f"submitting failed: {type(exc).__name__}: {exc}")
        for pending in batch:
            self.inflight.fail(pending.request_id, type(error)(error.message, **error.data))

    @staticmethod
    def _live(batch: list[Pending]) -> list[Pending]:
        """Drop requests already settled (deadline, withdrawal) and duplicates."""
        seen: set[str] = set()
        live = []
        for pending in batch:
            if not pending.settled and pending.request_id not in seen:
                seen.add(pending.request_id)
                live.append(pending)
        return live

    async def _send(self, batch: list[Pending]) -> None:
        misses = await self._answer_from_cache(batch)
        if not misses:
            return
        parts: dict[int, list[Pending]] = {}
        for pending in misses:
            partition = self.partitioning.of(pending.prompt)
            parts.setdefault(partition, []).append(pending)
        if len(parts) == 1:
            ((partition, part),) = parts.items()
            await self._enqueue(self.admissions[partition], part)
            return
        results = await asyncio.gather(
            *(self._enqueue(self.admissions[p], part) for p, part in parts.items()),
            return_exceptions=True,
        )
        for result in results:  # e.g. a lost connection: the whole batch is sent again
            if isinstance(result, BaseException):
                raise result

    async def _enqueue(self, admission: Admission, misses: list[Pending]) -> None:
        """Add `misses` to one stream; fail those a bound or quota refused."""
        stage_trace.mark("submit", len(misses))
        envelopes = [encode_request(p.request)["m"] for p in misses]
        tokens = [p.prompt.token_count for p in misses]
        try:
            await admission.enqueue(envelopes, tokens)
        except Busy as exc:  # QuotaExceeded too: the first `admitted` were enqueued
            admitted = int(exc.data.get("admitted", 0)) if isinstance(exc, QuotaExceeded) else 0
            for pending in misses[admitted:]:
                self.inflight.fail(pending.request_id, type(exc)(exc.message, **exc.data))
            self.sent += admitted
            return
        self.sent += len(misses)
        stage_trace.mark("submitted")

    async def _answer_from_cache(self, batch: list[Pending]) -> list[Pending]:
        """Resolve requests whose log-probabilities the shared cache holds; return the rest."""
        lookups = [p for p in batch if p.request.kind == "logprobs" and not p.inline_retry]
        if self.cache is None or not lookups:
            return batch
        cache = self.cache
        keys = [cache.key_of(p.prompt, p.request.dtype) for p in lookups]
        values = await cache.get_many(keys, [p.request.dtype for p in lookups])
        hits = set()
        for pending, value in zip(lookups, values, strict=True):
            if value is not None:
                hits.add(pending.request_id)
                self.inflight.resolve(
                    Reply(pending.request_id, value, pending.request.dtype, cached=True)
                )
        self.cache_hits += len(hits)
        return [p for p in batch if p.request_id not in hits]
