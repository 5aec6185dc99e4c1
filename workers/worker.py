"""`Worker`: one model's request streams -> fair batches -> backend -> replies, on one loop.

A worker serves every tenant of its model (`TenantLanes`: one request stream per tenant, all
read by one XREADGROUP). What it reads goes to a `FairShare` scheduler, which picks each batch
by weighted virtual token counters, so a tenant flooding its stream cannot delay the others
and an idle tenant's share goes to the rest. A batch is split by tenant and each part runs
with its tenant's keys (replies, cache namespace, acknowledgements), concurrently: the backend
batches concurrent calls into one forward.

The loop hands each batch to a task, keeping at most `prefetch` batches in flight: while the
backend computes one batch (off the loop, on its own thread or device), the next is already
read, decoded and looked up in the cache. Beside the read loop run a heartbeat (which also
re-publishes the model after a Redis restart), a tenant refresh (new tenants are served within
a few seconds) and a janitor that reclaims entries abandoned by dead workers, on every lane.

Delivery is at least once: entries are acknowledged only after their replies are written, so
a worker killed mid-batch leaves them pending for another worker (or itself, restarted under
the same name) to answer. Clients resolve each request id once, so a second answer is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from redis.exceptions import ResponseError

from shared.connections import bounded
from shared.errors import SettingsError
from shared.lm.interface import AsyncLM
from shared.redis_errors import REDIS_DOWN, REDIS_TROUBLE
from shared.registry import ModelInfo, ModelRegistry, tokenizer_to_files
from shared.settings import WorkerSettings
from shared.worker_stats import WorkerStats, write_worker_stats

from .fair_share import FairShare, Pick
from .health import HealthState
from .janitor import Janitor
from .metrics import WorkerMetrics
from .processor import BatchProcessor, MassComputer
from .reply_writer import ReplyWriter
from .request_stream import Entry, RequestStream
from .tenant_lanes import Lane, TenantLanes

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

_IDLE_BLOCK_MS = 500
#: Fair-share cost of one request beyond its prompt tokens (a row's reply and bookkeeping).
CALL_COST_TOKENS = 8
#: How often the operator's tenant list is read again.
TENANT_REFRESH_S = 2.0


class Worker:
    """Serves one model for every tenant until told to stop."""

    def __init__(
        self,
        settings: WorkerSettings,
        backend: AsyncLM,
        redis: Any,
        cache_redis: Any | None = None,
        masses: MassComputer | None = None,
        prefetch: int = 2,
        metrics: WorkerMetrics | None = None,
        health: HealthState | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.redis = redis
        self.keys = settings.redis.keyspace()
        self.registry = ModelRegistry(redis, self.keys)
        self.info = self._model_info()
        self.metrics = metrics or WorkerMetrics(settings.model)
        self.metrics.watch_backend(backend)
        self.health = health or health_state(settings)
        self.lanes = TenantLanes(
            redis, cache_redis or redis, settings, self.info, backend, masses, self.metrics
        )
        self.scheduler: FairShare[tuple[Lane, Entry]] = FairShare(CALL_COST_TOKENS)
        self.prefetch = prefetch
        self.answered = 0
        self._tokenizer_files: dict[str, bytes] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._started_ms = int(time.time() * 1000)
        self._stats_refused = False

    # the settings' tenant: what a single-tenant deployment uses
    @property
    def stream(self) -> RequestStream:
        """The request stream of the settings' tenant."""
        return self.lanes.default.stream

    @property
    def processor(self) -> BatchProcessor:
        """The batch processor of the settings' tenant."""
        return self.lanes.default.processor

    @property
    def writer(self) -> ReplyWriter:
        """The reply writer of the settings' tenant."""
        return self.lanes.default.writer

    @property
    def janitor(self) -> Janitor:
        """The janitor of the settings' tenant's stream."""
        return self.lanes.default.janitor

    def _model_info(self) -> ModelInfo:
        backend, settings = self.backend, self.settings
        limits = [n for n in (settings.max_prompt_tokens, backend.max_prompt_tokens) if n]
        eos = getattr(backend.tokenizer, "eos_token_id", None)
        return ModelInfo(
            name=settings.model,
            revision=backend.revision,
            backend=settings.backend,
            vocab_size=backend.vocab_size,
            vector_size=backend.vector_size,
            max_prompt_tokens=min(limits) if limits else 0,
            eos_token_ids=[eos] if isinstance(eos, int) else [],
            max_backlog=settings.max_backlog,
            partitions=settings.partitions,
            partition_block_tokens=settings.partition_block_tokens,
        )

    # -- lifecycle -----------------------------------------------------------------------------
    async def publish(self) -> None:
        """Create the streams and groups, load the admission script, publish the model."""
        if self._tokenizer_files is None:
            self._tokenizer_files = await asyncio.to_thread(
                tokenizer_to_files, self.backend.tokenizer
            )
        await self._check_partitions()
        await self._refresh_tenants()
        await self.lanes.ensure_groups()
        vocab = [bytes(token) for token in self.backend.byte_vocab]
        await self.registry.publish(self.info, self._tokenizer_files, vocab)
        await self._beat()
        self.health.mark_published()
        logger.info("serving %s (revision %s) as %s", self.info.name, self.info.revision,
                    self.settings.name)  # fmt: skip

    async def _check_partitions(self) -> None:
        """Refuse to serve with another partition count than the model's live workers: clients
        would send requests to streams that some workers never read."""
        name, me = self.info.name, self.settings.name
        if not await self.registry.is_published(name):
            return
        published = (await self.registry.info(name)).partitions
        if published == self.info.partitions:
            return
        within_s = max(3 * self.settings.heartbeat_s, 1.0)
        others = sorted(set(await self.registry.live_workers(name, within_s)) - {me})
        if others:
            raise SettingsError(
                f"partitions={self.info.partitions}, but live workers of {name} "
                f"({', '.join(others[:3])}) serve it with {published}: start every worker of a "
                "model with the same LMQ_PARTITIONS"
            )

    @contextlib.asynccontextmanager
    async def _computing(self) -> AsyncIterator[None]:
        """What computing needs while serving: the mass computer's batcher, if any."""
        masses = self.lanes.masses
        if masses is None:
            yield
            return
        async with masses:
            yield

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then finish in-flight batches within the grace period."""
        async with self._computing():
            await self._serve(stop)

    async def _serve(self, stop: asyncio.Event) -> None:
        await self._retry_until_up(self.publish, stop)
        background = [
            asyncio.create_task(self._heartbeat(stop), name="heartbeat"),
            asyncio.create_task(self._tenant_loop(stop), name="tenants"),
            asyncio.create_task(self._not_ready_once(stop), name="readiness"),
        ]
        self.health.mark_serving()
        try:
            await self._retry_until_up(self._drain_own_pending, stop)
            # Only now: the janitor also claims this consumer's idle entries, and two claims of
            # one entry at once would charge it two deliveries for one attempt.
            background.append(asyncio.create_task(self._janitor_loop(stop), name="janitor"))
            await self._read_loop(stop)
        finally:
            self.health.mark_stopping()
            await self._finish_inflight()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(*REDIS_DOWN):
                await self.registry.leave(self.info.name, self.settings.name)
                await self.redis.delete(self.keys.worker_stats(self.info.name, self.settings.name))

    async def run_until_idle(self) -> int:
        """Burst mode for tests and batch jobs: answer everything queued now, then return.

        Returns:
            The number of entries answered.
        """
        await self.publish()
        before = self.answered
        reader = self.lanes.reader
        steal_after_ms, reader.steal_after_ms = reader.steal_after_ms, 0  # drain every partition
        try:
            async with self._computing():
                await self._drain_own_pending()
                while picks := await self._read_batch(block_ms=None):
                    await self._handle(picks)
        finally:
            reader.steal_after_ms = steal_after_ms
        return self.answered - before

    # -- reading ---------------------------------------------------------------------------------
    async def _drain_own_pending(self) -> None:
        """Answer entries this consumer took before a crash or restart, before new work."""
        for lane in self.lanes:
            await self._recover(lane, lane.janitor.own_pending())

    async def _recover(
        self, lane: Lane, entries: AsyncGenerator[Entry, None], stop: asyncio.Event | None = None
    ) -> None:
        """Answer entries delivered before, each alone (see `Janitor`); park exhausted ones."""
        async with contextlib.aclosing(entries):
            async for entry in entries:
                self.health.tick()
                parked = await lane.janitor.park_if_exhausted(entry)
                if parked is not None:
                    await lane.writer.flush(parked)
                else:
                    await self._handle_lane(lane, [entry])
                if stop is not None and stop.is_set():
                    return

    async def _read_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.health.tick()
            if len(self._inflight) >= self.prefetch:
                await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                entries = await bounded(
                    self._read_batch(block_ms=_IDLE_BLOCK_MS),
                    _IDLE_BLOCK_MS / 1000 + self.settings.redis.stall_timeout_s,
                    "request read",
                )
            except REDIS_TROUBLE as exc:
                logger.warning("reading requests failed (%s); retrying", exc)
                await _sleep_unless(stop, 0.5)
                continue
            if entries:
                task = asyncio.create_task(self._handle(entries))
                self._inflight.add(task)
                task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        """Forget a finished batch task; a failure leaves its entries pending for the janitor."""
        self._inflight.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("a batch failed; its entries stay pending", exc_info=exc)

    async def _read_batch(self, block_ms: int | None) -> list[Pick[tuple[Lane, Entry]]]:
        """The next fair batch: read what the scheduler lacks, then let it pick.

        Blocks for the first entry only when nothing is queued; waits max_wait_ms for more
        when the batch would not be full.
        """
        size = self.settings.batch_size
        if not self.scheduler.backlog():
            await self._read_into_scheduler(block_ms)
        if 0 < self.scheduler.backlog() < size and self.settings.max_wait_ms:
            await asyncio.sleep(self.settings.max_wait_ms / 1000)
        await self._read_into_scheduler(None)
        return self.scheduler.pick(size, self.settings.max_batch_tokens)

    async def _read_into_scheduler(self, block_ms: int | None) -> None:
        """Read new entries of every lane holding less than a batch in the scheduler."""
        size = self.settings.batch_size
        wanting = [lane for lane in self.lanes if self.scheduler.backlog(lane.tenant) < size]
        by_lane: dict[str, tuple[Lane, list[Entry]]] = {}
        for lane, entry in await self.lanes.read(wanting, size, block_ms):
            by_lane.setdefault(lane.stream.stream, (lane, []))[1].append(entry)
        for lane, entries in by_lane.values():
            entries, refused = await self.lanes.over_cap(lane, entries)
            if refused.acks:
                await lane.writer.flush(refused)
                self.answered += len(refused.acks)
            self.scheduler.set_weight(lane.tenant, lane.weight)
            for entry in entries:
                self.scheduler.add(lane.tenant, (lane, entry), _estimated_tokens(entry))

    # -- answering -------------------------------------------------------------------------------
    async def _handle(self, picks: Sequence[Pick[tuple[Lane, Entry]]]) -> None:
        """Answer one fair batch: each tenant's part with its own keys, all at once."""
        parts: dict[str, tuple[Lane, list[Entry]]] = {}
        charged: dict[str, float] = {}
        for pick in picks:
            lane, entry = pick.item
            stream = lane.stream.stream
            parts.setdefault(stream, (lane, []))[1].append(entry)
            charged[stream] = charged.get(stream, 0.0) + pick.charged
        results = await asyncio.gather(
            *(
                self._handle_lane(lane, entries, charged[stream])
                for stream, (lane, entries) in parts.items()
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _handle_lane(
        self, lane: Lane, entries: Sequence[Entry], charged: float = 0.0
    ) -> None:
        """Process one tenant's entries and write their outcome; keep their claims fresh.

        The tenant's fair-share charge becomes what the forward cost (distinct prompts
        computed and their tokens; cache hits cost nothing) instead of the `charged` estimate.
        """
        self.metrics.observe_queue_wait(lane.tenant, [e.entry_id for e in entries])
        keepalive = asyncio.create_task(self._keep_claims(lane, [e.entry_id for e in entries]))
        try:
            outcome = await lane.processor.process(entries)
        finally:
            keepalive.cancel()
            await asyncio.gather(keepalive, return_exceptions=True)
        cost = self.scheduler.cost_of(outcome.computed_prompts, outcome.computed_tokens)
        self.scheduler.adjust(lane.tenant, cost - charged)
        await lane.writer.flush(outcome)
        self.answered += len(outcome.acks)

    async def _keep_claims(self, lane: Lane, entry_ids: list[str]) -> None:
        """Reset the entries' idle time while a long batch runs, so no janitor steals them."""
        interval_s = self.settings.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(interval_s)
            try:
                await lane.stream.touch(entry_ids)
            except REDIS_TROUBLE as exc:  # e.g. NOGROUP after a restart
                logger.info("keeping claims fresh failed: %s", exc)

    async def _finish_inflight(self) -> None:
        """Give in-flight batches the grace period, then cancel them (they stay pending)."""
        if not self._inflight:
            return
        done, pending = await asyncio.wait(self._inflight, timeout=self.settings.shutdown_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*done, *pending, return_exceptions=True)
        if pending:
            logger.warning("cancelled %d batches at shutdown; they stay pending", len(pending))

    # -- background ------------------------------------------------------------------------------
    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if not await self.registry.is_published(self.info.name):
                    logger.warning("model registry entry missing (Redis restarted?); re-publishing")
                    await self.publish()
                await self._beat()
            except REDIS_DOWN as exc:
                logger.warning("heartbeat failed: %s", exc)
                self.health.heartbeat(reached_redis=False)
            await _sleep_unless(stop, self.settings.heartbeat_s)

    async def _beat(self) -> None:
        """Write the heartbeat and the stats hash (`lmq status`)."""
        await self.registry.heartbeat(self.info.name, self.settings.name)
        self.health.heartbeat(reached_redis=True)
        self.metrics.mark_heartbeat()
        batches_per_s, requests_per_s = self.metrics.rates()
        hits, misses = self.metrics.shared_cache_counts()
        stats = WorkerStats(
            self.info.name, self.settings.backend, self.info.revision,
            tuple(lane.tenant for lane in self.lanes), self.settings.batch_size,
            self._started_ms, int(time.time() * 1000), self.metrics.batches_total,
            self.metrics.requests_total, batches_per_s, requests_per_s, hits, misses,
        )  # fmt: skip
        ttl_s = max(10, int(5 * self.settings.heartbeat_s))
        try:
            await write_worker_stats(self.redis, self.keys, self.settings.name, stats, ttl_s)
        except ResponseError as exc:  # e.g. an ACL without the stats key: lmq status shows less
            if not self._stats_refused:
                logger.warning("writing the stats hash failed: %s", exc)
            self._stats_refused = True

    async def _not_ready_once(self, stop: asyncio.Event) -> None:
        """Fail readiness the moment the worker is told to stop, not when its loop notices."""
        await stop.wait()
        self.health.mark_stopping()

    async def _tenant_loop(self, stop: asyncio.Event) -> None:
        """Pick up new tenants and changed settings every few seconds, without a restart."""
        while not stop.is_set():
            await _sleep_unless(stop, TENANT_REFRESH_S)
            try:
                await self._refresh_tenants()
            except REDIS_TROUBLE as exc:
                logger.warning("reading tenants failed: %s", exc)

    async def _refresh_tenants(self) -> None:
        await self.lanes.refresh()
        for lane in self.lanes:
            self.scheduler.set_weight(lane.tenant, lane.weight)

    async def _janitor_loop(self, stop: asyncio.Event) -> None:
        """Recover idle entries of dead workers on every lane, and prune; nothing ends it."""
        interval_s = max(self.settings.claim_idle_ms / 2000, 0.05)
        while not stop.is_set():
            await _sleep_unless(stop, interval_s)
            if stop.is_set():
                return
            for lane in self.lanes:
                try:
                    await self._recover(lane, lane.janitor.idle_entries(), stop)
                    await lane.janitor.prune_if_due()
                except REDIS_TROUBLE as exc:
                    logger.warning("janitor sweep of %s failed: %s", lane.tenant, exc)
                except Exception:
                    logger.exception("janitor sweep of %s failed", lane.tenant)

    async def _retry_until_up(self, action: Any, stop: asyncio.Event) -> None:
        delay_s = 0.1
        while True:
            try:
                await action()
                return
            except REDIS_DOWN as exc:
                if stop.is_set():
                    raise
                logger.warning("Redis unavailable (%s); retrying in %.1f s", exc, delay_s)
                await _sleep_unless(stop, delay_s)
                delay_s = min(delay_s * 2, 5.0)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, waking early when `stop` is set."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


def _estimated_tokens(entry: Entry) -> int:
    """A request's prompt tokens, from its envelope's size (4 bytes a token, ~64 of header)."""
    return max((len(entry.fields.get(b"m", b"")) - 64) // 4, 1)


def health_state(settings: WorkerSettings) -> HealthState:
    """Probe thresholds for a worker: its read loop turns at least every stall timeout plus
    half a second, its heartbeat loop every `heartbeat_s`; allow several of each."""
    return HealthState(
        loop_stale_s=max(60.0, 3 * settings.redis.stall_timeout_s),
        heartbeat_stale_s=max(30.0, 5 * settings.heartbeat_s),
    )
