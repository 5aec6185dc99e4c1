"""`Worker`: one model's request streams -> fair batches -> backend -> replies, on one loop.

A worker serves every tenant of its model (`TenantLanes`: one request stream per tenant, all
read by one XREADGROUP). What it reads goes to a `FairShare` scheduler, which picks each batch
by weighted virtual token counters, so a tenant flooding its stream cannot delay the others
and an idle tenant's share goes to the rest. A batch is split by tenant and each part runs
with its tenant's keys (replies, cache namespace, acknowledgements), concurrently: the backend
batches concurrent calls into one forward.

The loop hands each batch to a task, keeping at most `prefetch` batches in flight. While the
backend computes one batch (off the loop, on its own thread or device), the loop waits; it
reads and picks the next batch only when the backend is about to be done with the current one
(`late_binding`), so requests arriving meanwhile can still join it, and holds it a moment
for a tenant whose calls the ending forward answered and whose next calls are on their way
(`anticipation`: a closed loop's next step; the backend idles for it at most a share of a
forward, and its replies are written before the batch's others). A batch is decoded
and looked up in the cache while the forward ends, and replying to one batch overlaps the
next one's forward. Entries are read only just before they are picked: read and left waiting
in the scheduler through a long forward, they would pass the claim timeout unattended. Beside
the read loop run the `Upkeep` loops: a heartbeat, a tenant refresh and a janitor that
reclaims entries abandoned by dead workers.

Delivery is at least once: entries are acknowledged only after their replies are written, so
a worker killed mid-batch leaves them pending for another worker (or itself, restarted under
the same name) to answer. Clients resolve each request id once, so a second answer is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from lmqueue.shared import stage_trace
from lmqueue.shared.cluster_client import cluster_rebuilds
from lmqueue.shared.connections import bounded
from lmqueue.shared.errors import MalformedMessage
from lmqueue.shared.heap_freeze import freeze_heap
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.redis_errors import REDIS_DOWN, REDIS_TROUBLE
from lmqueue.shared.registry import ModelInfo, ModelRegistry, tokenizer_to_files
from lmqueue.shared.serial_torch import serial_torch
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.wire import envelope_token_count

from .adapter_set import AdapterSet
from .anticipation import AwaitedFirst, ReturningTenants
from .claim_keeper import ClaimKeeper
from .fair_share import FairShare, Pick
from .health import HealthState
from .janitor import Janitor
from .late_binding import BackendOccupancy, BatchForward, ForwardPart, ForwardStart
from .metrics import WorkerMetrics
from .processor import BatchProcessor, MassComputer
from .reply_writer import ReplyWriter
from .request_stream import Entry, RequestStream
from .tenant_lanes import Lane, TenantLanes
from .upkeep import Upkeep, UpkeepParts, health_state, sleep_unless
from .writer_thread import WriterThread

__all__ = ["Worker"]

logger = logging.getLogger(__name__)

_IDLE_BLOCK_MS = 500
#: Fair-share cost of one request beyond its prompt tokens (a row's reply and bookkeeping).
CALL_COST_TOKENS = 8


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
        self.metrics.watch_cluster(self.cluster_rebuilds)
        self.health.watch_cluster(self.cluster_rebuilds)
        self.adapters = AdapterSet(backend, redis, self.keys, settings.model, settings.adapters)
        #: Writes every lane's replies off the event loop (where connections are plain).
        self.writer_thread = WriterThread(
            settings.redis.connect_timeout_s, settings.redis.stall_timeout_s
        )
        self.lanes = TenantLanes(
            redis, cache_redis or redis, settings, self.info, backend, masses, self.metrics,
            self.adapters, self.writer_thread,
        )  # fmt: skip
        self.scheduler: FairShare[tuple[Lane, Entry]] = FairShare(CALL_COST_TOKENS)
        forwards = backend.parallel_forwards
        self.prefetch = max(prefetch, forwards + 1)  # one batch beyond those computing
        self.answered = 0
        self._tokenizer_files: dict[str, bytes] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.occupancy = BackendOccupancy(forwards=forwards)
        self.returning = ReturningTenants(settings.anticipate_ms / 1000)
        #: Whether the streams were read just now, by a wait for returning tenants that ended.
        self._just_read = False
        #: Set when the next batch picked goes to the backend (a fresh one for each batch).
        self._next_forward = asyncio.Event()
        parts = UpkeepParts(
            settings, self.info, redis, self.keys, self.registry, self.health, self.metrics,
            self.lanes, self.scheduler, self.adapters,
        )  # fmt: skip
        self.upkeep = Upkeep(parts, self.publish, self.recover)

    def cluster_rebuilds(self) -> tuple[int, bool]:
        """Rebuilds of this worker's Redis Cluster clients so far, and whether one runs now."""
        return cluster_rebuilds(self.lanes.redis, self.lanes.cache_redis)

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
            cache_address=settings.redis.published_cache_address,
        )

    # -- lifecycle -----------------------------------------------------------------------------
    async def publish(self) -> None:
        """Create the streams and groups, load the admission script, publish the model."""
        if self._tokenizer_files is None:
            self._tokenizer_files = await asyncio.to_thread(
                tokenizer_to_files, self.backend.tokenizer
            )
        await self.lanes.reader.check_peers()
        await self.adapters.publish_own()
        await self.upkeep.refresh_tenants()
        await self.lanes.ensure_groups()
        vocab = [bytes(token) for token in self.backend.byte_vocab]
        await self.registry.publish(self.info, self._tokenizer_files, vocab)
        await self.upkeep.beat()
        self.health.mark_published()
        logger.info("serving %s (revision %s) as %s", self.info.name, self.info.revision,
                    self.settings.name)  # fmt: skip

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
        """Serve until `stop` is set, then finish in-flight batches within the grace period.

        The loop's thread runs its torch ops (dtype conversions of replies) serially meanwhile:
        heavy compute never runs there, and a team of threads would spin after every op.
        """
        with serial_torch():
            async with self._computing():
                await self._serve(stop)

    async def _serve(self, stop: asyncio.Event) -> None:
        # Everything alive once started (torch, the model, the tokenizer, the imports) leaves the
        # full collections, which otherwise stalled every tenant's next batch (shared/heap_freeze).
        # Before publishing: clients may send once it is published; per `serve`, as a test process
        # serving several workers sets up each.
        freeze_heap()
        await self._retry_until_up(self.publish, stop)
        background = self.upkeep.start(stop)
        self.health.mark_serving()
        try:
            await self._retry_until_up(self._drain_own_pending, stop)
            # Only now: the janitor also claims this consumer's idle entries, and two claims of
            # one entry at once would charge it two deliveries for one attempt.
            background.append(self.upkeep.start_janitor(stop))
            await self._read_loop(stop)
        finally:
            self.health.mark_stopping()
            await self._finish_inflight()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(*REDIS_DOWN):
                await self.lanes.reader.aclose()
            await self.writer_thread.aclose()  # last: the janitor writes through it too
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
            with serial_torch():
                async with self._computing():
                    await self._drain_own_pending()
                    while picks := await self._read_batch(block_ms=None):
                        await self._handle(picks)
        finally:
            reader.steal_after_ms = steal_after_ms
            with contextlib.suppress(*REDIS_DOWN):
                await reader.aclose()
            await self.writer_thread.aclose()
        return self.answered - before

    # -- reading ---------------------------------------------------------------------------------
    async def _drain_own_pending(self) -> None:
        """Answer entries this consumer took before a crash or restart, before new work."""
        for lane in self.lanes:
            await self.recover(lane, lane.janitor.own_pending())

    async def recover(
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
                if self.occupancy.pick_in_s() != 0.0:  # pick when the backend is about to be done
                    self._just_read = False
                    await self.occupancy.wait_to_pick(_IDLE_BLOCK_MS / 1000)
                    continue
                if await self._await_returning():  # a returning tenant's calls may join it
                    continue
                picks = await bounded(
                    self._read_batch(block_ms=_IDLE_BLOCK_MS),
                    _IDLE_BLOCK_MS / 1000 + self.settings.redis.stall_timeout_s,
                    "request read",
                )
            except REDIS_TROUBLE as exc:
                logger.warning("reading requests failed (%s); retrying", exc)
                await sleep_unless(stop, 0.5)
                continue
            if picks:
                self._start(picks)

    async def _await_returning(self) -> bool:
        """Hold the next pick a moment for tenants whose calls the last batch answered
        (`anticipation`), reading their streams meanwhile; whether it was held."""
        backend = self.occupancy
        hold, wait_s = self.returning.waiting(
            self.scheduler.backlog, backend.idle_since, backend.compute_s, self.scheduler.backlog()
        )
        if not hold:
            return False
        if wait_s is None and not self._inflight:  # a batch failed before replying
            self.returning.forget_unreplied()
            return True
        # Reading meanwhile: calls of theirs queued already (or arriving) end the wait at once.
        block_ms = max(round((wait_s or self.returning.wait_s) * 1000), 1)
        await bounded(
            self._read_into_scheduler(block_ms),
            block_ms / 1000 + self.settings.redis.stall_timeout_s,
            "request read",
        )
        # If that fills a batch, the pick that ends the wait takes it without another read:
        # that round trip, behind the other tenants' replies on a busy Redis, was ~0.8 ms of
        # idle backend per forward (BENCHMARKS.md, fairness). A read that woke on the first of
        # several requests added one by one fills none: the next read gets the rest.
        self._just_read = True
        return True

    def _start(self, picks: list[Pick[tuple[Lane, Entry]]]) -> None:
        """Answer a batch in a task; it holds the backend slot until its forward is done."""
        calls: dict[str, tuple[int, float]] = {}
        for pick in picks:
            n, cost = calls.get(pick.tenant, (0, 0.0))
            calls[pick.tenant] = (n + 1, cost + pick.charged)
        for tenant, (n, cost) in calls.items():
            self.returning.sent(tenant, n, cost, self.scheduler.backlog(tenant))
        if stage_trace.enabled():
            stage_trace.mark("pick", _tenant_counts((t, n) for t, (n, _) in calls.items()))
        started, self._next_forward = self._next_forward, asyncio.Event()
        start = ForwardStart()
        release = self.occupancy.hold(placed=start.placed)
        task = asyncio.create_task(
            self._handle(picks, computed=release, started=started.set, start=start)
        )
        self._inflight.add(task)
        task.add_done_callback(lambda _: release())  # a failed batch releases it too
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        """Forget a finished batch task; a failure leaves its entries pending for the janitor."""
        self._inflight.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("a batch failed; its entries stay pending", exc_info=exc)

    async def _read_batch(self, block_ms: int | None) -> list[Pick[tuple[Lane, Entry]]]:
        """The next fair batch: read what the scheduler lacks, then let it pick.

        Blocks for the first entry only when nothing is queued, and then waits max_wait_ms for
        more when the batch would not be full; entries queued already (read ahead during the
        last forward) had their wait, and the backend is idle now.
        """
        size = self.settings.batch_size
        just_read, self._just_read = self._just_read, False
        if not self.scheduler.backlog():
            await self._read_into_scheduler(block_ms)
            if 0 < self.scheduler.backlog() < size and self.settings.max_wait_ms:
                await asyncio.sleep(self.settings.max_wait_ms / 1000)
        elif just_read and self.scheduler.backlog() >= size:  # a full batch read just now
            return self.scheduler.pick(size, self.settings.max_batch_tokens)
        await self._read_into_scheduler(None)
        return self.scheduler.pick(size, self.settings.max_batch_tokens)

    async def _read_into_scheduler(self, block_ms: int | None) -> None:
        """Read new entries of every lane holding less than a batch in the scheduler."""
        size = self.settings.batch_size
        wanting = [lane for lane in self.lanes if self.scheduler.backlog(lane.tenant) < size]
        idle = not self.occupancy.busy and not self.scheduler.backlog()  # else: no stealing
        by_lane: dict[str, tuple[Lane, list[Entry]]] = {}
        for lane, entry in await self.lanes.read(wanting, size, block_ms, idle):
            by_lane.setdefault(lane.stream.stream, (lane, []))[1].append(entry)
        for lane, entries in by_lane.values():  # a lane removed meanwhile: answered
            entries, refused = await self.lanes.over_cap(lane, entries)
            if refused.acks:
                await lane.writer.flush(refused)
                self.answered += len(refused.acks)
            self.scheduler.set_weight(lane.tenant, lane.weight)
            credit = self.returning.credit(lane.tenant)
            for entry in entries:  # each decoded as read (`_estimated_tokens`)
                self.scheduler.add(lane.tenant, (lane, entry), _estimated_tokens(entry), credit)
        if stage_trace.enabled():
            queued = ((t, self.scheduler.backlog(t)) for t in self.lanes.tenants())
            stage_trace.mark("read", _tenant_counts(queued))

    # -- answering -------------------------------------------------------------------------------
    async def _handle(
        self,
        picks: Sequence[Pick[tuple[Lane, Entry]]],
        computed: Callable[[], None] | None = None,
        started: Callable[[], None] | None = None,
        start: ForwardStart | None = None,
    ) -> None:
        """Answer one fair batch: each tenant's part with its own keys, all at once.

        The parts call the backend together; `computed` is called once it is done with all,
        `started` once they go to it (the previous batch's held replies go out then, not
        earlier: their writing delayed this forward's start; called on every path); `start`
        tells when the forward starts (`ForwardStart`: the backend may still run the batch
        ahead when the parts call it). Awaited tenants' parts go first: after the forward
        theirs are processed and written first, since the backend idles until their next
        calls are back.
        """
        parts: dict[tuple[str, str], _Part] = {}  # by tenant and cache namespace
        for pick in picks:
            lane, entry = pick.item
            name = (lane.tenant, lane.keys.cache_namespace)
            part = parts.get(name)
            if part is None:
                part = parts[name] = _Part(lane)
            part.add(lane, entry, pick.charged, pick.tokens)
        forward = BatchForward(
            len(parts), computed, self.occupancy.computed, started=started, start=start
        )
        awaited = {name for name, part in parts.items() if self.returning.awaits(name[0])}
        first = None
        if 0 < len(awaited) < len(parts):  # the others' replies wait for this batch's successor
            first = AwaitedFirst(len(awaited), self._next_forward, self.returning.wait_s)
        order = sorted(
            parts.items(), key=lambda item: (item[0] not in awaited, len(item[1].entries))
        )
        lanes = [
            self._handle_lane(
                part.lane,
                part.entries,
                part.charged,
                forward.part(),
                first,
                name in awaited,
                part.named_tokens,
                part.streams if len(part.streams) > 1 else None,
            )
            for name, part in order
        ]
        try:
            if len(lanes) == 1:  # the usual batch: awaited here, not in a task of its own
                await lanes[0]
                return
            results = await asyncio.gather(*lanes, return_exceptions=True)
        finally:
            if started is not None:
                started()
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _handle_lane(
        self,
        lane: Lane,
        entries: Sequence[Entry],
        charged: float = 0.0,
        forward: ForwardPart | None = None,
        first: AwaitedFirst | None = None,
        awaited: bool = False,
        named_tokens: int = 0,
        streams: dict[RequestStream, list[str]] | None = None,
    ) -> None:
        """Process one tenant's entries and write their outcome; keep their claims fresh.

        `streams`: the entries' ids by the request stream each was read from, when several
        (the tenant's partitions on a cluster): one part, processed and written as one, each
        entry acknowledged on its own stream. Else all are `lane`'s.

        The tenant's fair-share charge becomes what the forward cost (distinct prompts
        computed and their tokens the backend's prefix cache did not hold; cache hits cost
        nothing) instead of the `charged` estimate, and what it computed of the
        `named_tokens` (the tokens its envelopes named) estimates its next requests
        (`FairShare.observe`).
        With `first`, the batch has an `awaited` tenant, whose replies are written before
        the others' (`AwaitedFirst`), and those once the next batch goes to the backend.
        """
        ids = [e.entry_id for e in entries]
        self.metrics.observe_queue_wait(lane.tenant, ids)
        claims = ClaimKeeper(
            functools.partial(self._touch_claims, streams or {lane.stream: ids}),
            self.settings.claim_idle_ms / 3000,
        )
        try:
            try:
                outcome = await lane.processor.process(entries, forward)
            finally:
                await claims.stop()
            if streams is not None:
                outcome.acks_by_stream = {s.stream: read for s, read in streams.items()}
            cost = self.scheduler.cost_of(outcome.computed_prompts, outcome.computed_tokens)
            self.scheduler.adjust(lane.tenant, cost - charged)
            self.scheduler.observe(lane.tenant, named_tokens, outcome.computed_tokens)
            if first is not None and not awaited:
                await first.wait(self.settings.redis.stall_timeout_s)
            stage_trace.mark("write_start", lane.tenant)
            await lane.writer.flush(outcome)
            stage_trace.mark("written", lane.tenant)
        finally:  # replied, or never will be: either way its wait for the tenant may start,
            # once the backend is done with the whole batch: a tenant answered while the others'
            # rows still compute (a split batch, `shape_split`) holds up no one until then, and
            # its wait counted from its replies ran out before the next pick (BENCHMARKS.md,
            # fairness, real model)
            replied = functools.partial(self.returning.replied, lane.tenant)
            if forward is not None:
                forward.after_batch(replied)
            else:
                replied()
            if first is not None and awaited:
                first.written()
        self.answered += len(outcome.acks)

    @staticmethod
    async def _touch_claims(streams: dict[RequestStream, list[str]]) -> None:
        """Reset the entries' idle time (ids by their stream), so no janitor steals them."""
        for stream, entry_ids in streams.items():
            try:
                await stream.touch(entry_ids)
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
                await sleep_unless(stop, delay_s)
                delay_s = min(delay_s * 2, 5.0)


class _Part:
    """One tenant's entries of a fair batch, answered as one (`Worker._handle`): its lanes of
    several partitions share the keys, so one processor and one writer serve them all."""

    __slots__ = ("lane", "entries", "streams", "charged", "named_tokens")

    def __init__(self, lane: Lane) -> None:
        #: The lane whose processor and writer answer the part (the first one picked).
        self.lane = lane
        self.entries: list[Entry] = []
        #: The entries' ids by the stream each was read from.
        self.streams: dict[RequestStream, list[str]] = {}
        #: The fair-share estimate charged for them, and the tokens their envelopes named.
        self.charged = 0.0
        self.named_tokens = 0

    def add(self, lane: Lane, entry: Entry, charged: float, tokens: int) -> None:
        """One more entry, read from `lane`'s stream."""
        self.entries.append(entry)
        self.streams.setdefault(lane.stream, []).append(entry.entry_id)
        self.charged += charged
        self.named_tokens += tokens


def _tenant_counts(counts: Iterable[tuple[str, int]]) -> str:
    """``tenant:count,...`` of the non-zero counts, as a stage mark's detail."""
    return ",".join(f"{tenant}:{n}" for tenant, n in counts if n) or "-"


def _estimated_tokens(entry: Entry) -> int:
    """A request's prompt tokens: decoded as read (`Entry.request`, mostly during a forward,
    off the way from the pick to the next one), its token bytes; an entry that does not decode
    (answered with its error when picked) is charged what its envelope names
    (`shared.wire.envelope_token_count`; from the envelope's size if that is not found).

    The size alone counted the header's optional fields as tokens (an 8-token prompt's
    envelope is ~150 bytes): one more flag on every request shifted what each was charged,
    and with it which of a light tenant's calls shared a batch (BENCHMARKS.md, fairness).
    The envelope is untrusted: a wrong count only misplaces the sender's own requests until
    the forward reports what they cost (`FairShare.adjust`).
    """
    try:  # not contextlib.suppress: an object and two calls an entry
        return max(len(entry.request().token_bytes) // 4, 1)
    except MalformedMessage:
        pass
    raw = entry.fields.get(b"m", b"")
    count = envelope_token_count(raw)
    return max(count if count is not None else (len(raw) - 64) // 4, 1)
