"""`TenantLanes`: the request streams of every tenant of one model, as one worker serves them.

A lane is one tenant's share of the worker: its request stream (in the consumer group every
worker joins), and the reply writer, cache and janitor bound to that tenant's keys. Replies go
to the reply stream of the *lane an entry was read from* (``lmq:<tenant>:client:{<id>}``),
never to a tenant named in the entry, so a request in tenant A's stream can put nothing into
tenant B's keys; cached vectors are read and written in the lane's cache namespace.

Tenants come from the operator's ``lmq:tenants`` hash plus the worker's own settings tenant
(``default``); `refresh` picks up new ones while the worker runs (every few seconds), mirrors
each tenant's limits into its ``:quota`` hash of this model, and loads the admission script,
which tenants may run but not load. A tenant gone from the hash (``lmq tenant remove``) loses
its lane: its stream is read no more, entries not yet read stay in it (answered if the tenant
comes back), and entries already read are still answered, by the lane each carries with it.
All request streams of a model share the ``{<model>}`` hash slot, so one XREADGROUP reads them
all (`read`).

A tenant's ``max_inflight`` binds clients through the admission script, which a client could
skip by writing its stream directly; `over_cap` is the authoritative check: while a tenant's
stream holds more entries than its cap, entries read from it beyond the cap are answered with
`QuotaExceeded` instead of being run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from lmqueue.shared.admission_script import ADMISSION_LUA
from lmqueue.shared.connections import execute_pipeline
from lmqueue.shared.errors import InvalidName, MalformedMessage, QuotaExceeded
from lmqueue.shared.keys import KeySpace, validate_client_id
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.partitions import stream_partitions
from lmqueue.shared.registry import ModelInfo
from lmqueue.shared.settings import WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.tenants import TenantConfig, quota_fields

from .adapter_set import AdapterSet
from .janitor import Janitor
from .metrics import WorkerMetrics
from .outcome import Outcome
from .partition_reader import PartitionReader
from .processor import BatchProcessor, ForwardGate, MassComputer
from .recent_writes import RecentWrites
from .reply_writer import ReplyWriter
from .request_stream import Entry, RequestStream
from .writer_thread import WriterThread

__all__ = ["Lane", "TenantLanes"]

logger = logging.getLogger(__name__)


@dataclass
class Lane:
    """One tenant's stream and the objects that answer it."""

    tenant: str
    keys: KeySpace
    stream: RequestStream
    processor: BatchProcessor
    writer: ReplyWriter
    janitor: Janitor
    config: TenantConfig | None = None
    #: The partition of the model's streams this lane reads (None: the model has one stream).
    partition: int | None = None

    @property
    def weight(self) -> float:
        """The tenant's fair-share weight (1 without a config)."""
        return self.config.weight if self.config else 1.0

    @property
    def max_inflight(self) -> int:
        """The tenant's in-flight cap (0: none)."""
        return self.config.max_inflight if self.config else 0


class TenantLanes:
    """Every tenant's lane of one worker's model, kept up to date by `refresh`."""

    def __init__(
        self,
        redis: Any,
        cache_redis: Any,
        settings: WorkerSettings,
        info: ModelInfo,
        backend: AsyncLM,
        masses: MassComputer | None = None,
        metrics: WorkerMetrics | None = None,
        adapters: AdapterSet | None = None,
        writer_thread: WriterThread | None = None,
    ) -> None:
        self.redis = redis
        self.adapters = adapters
        #: Where every lane's replies are written (`ReplyWriter`), if given.
        self.writer_thread = writer_thread
        self.cache_redis = cache_redis
        self.settings = settings
        self.info = info
        self.backend = backend
        self.masses = masses
        self.metrics = metrics
        self.keys = settings.redis.keyspace()
        #: One gate for all lanes: a batch isolating a failure has the backend to itself.
        self.gate = ForwardGate()
        #: The shared-cache keys this worker wrote lately, for every lane's lookups.
        self.recent = RecentWrites()
        self.partitions = stream_partitions(info.partitions)
        self.reader: PartitionReader[Lane] = PartitionReader(
            redis, settings, info.partitions, metrics
        )
        self._lanes: dict[str, list[Lane]] = {}
        self._by_stream: dict[str, Lane] = {}
        self.default = self.of_tenant(self.keys.tenant)[0]

    def __iter__(self) -> Iterator[Lane]:
        return iter([lane for lanes in list(self._lanes.values()) for lane in lanes])

    def __len__(self) -> int:
        return sum(len(lanes) for lanes in self._lanes.values())

    def tenants(self) -> list[str]:
        """The tenants served."""
        return list(self._lanes)

    def of_tenant(self, tenant: str, config: TenantConfig | None = None) -> list[Lane]:
        """The tenant's lanes (one per partition), made on first use; a new `config` replaces
        the old one."""
        lanes = self._lanes.get(tenant)
        namespace = config.cache_namespace if config and config.shares_cache else ""
        if lanes is None or lanes[0].keys.cache_namespace != namespace:
            lanes = [self._make(tenant, namespace, partition) for partition in self.partitions]
            self._register(tenant, lanes)
        if config is not None:
            for lane in lanes:
                lane.config = config
        return lanes

    def _register(self, tenant: str, lanes: list[Lane]) -> None:
        self._lanes[tenant] = lanes
        self._by_stream.update((lane.stream.stream, lane) for lane in lanes)

    def _make(self, tenant: str, namespace: str, partition: int | None) -> Lane:
        settings, info = self.settings, self.info
        keys = self.keys.for_tenant(tenant, namespace)
        stream = RequestStream(self.redis, keys.requests(info.name, partition), settings.name)
        cache = None
        if settings.cache_writes:
            cache = SharedCache(
                self.cache_redis, keys, info.name, info.revision,
                settings.redis.stall_timeout_s, info.vector_size,
                self.adapters.served if self.adapters is not None else None,
            )  # fmt: skip
        processor = BatchProcessor(
            self.backend, cache, info.max_prompt_tokens, settings.max_request_bytes, self.masses,
            self.metrics, self.adapters, tenant, self.gate, self.recent,
        )  # fmt: skip
        writer = ReplyWriter(
            self.redis, stream, keys, settings, cache, self.metrics, self.writer_thread
        )
        janitor = Janitor(stream, keys, settings)
        return Lane(tenant, keys, stream, processor, writer, janitor, partition=partition)

    def by_stream(self, stream: str) -> Lane | None:
        """The lane whose request stream is `stream`."""
        return self._by_stream.get(stream)

    # -- the operator's tenants ------------------------------------------------------------------
    async def refresh(self) -> list[str]:
        """Read the tenants, mirror their quotas, create missing groups, see which partitions
        this worker owns now; returns new tenants.

        A tenant no longer listed loses its lanes (their streams' mapping stays until the next
        refresh, for a read already under way).
        """
        records = await self.redis.hgetall(self.keys.tenants())
        self._by_stream = {lane.stream.stream: lane for lane in self}
        new = []
        for raw_name, raw in records.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            try:
                config = TenantConfig.from_json(name, raw)
            except ValueError as exc:
                logger.warning("ignoring tenant %r: %s", name, exc)
                continue
            if name not in self._lanes:  # groups first: the read loop reads what is listed
                new.append(name)
                namespace = config.cache_namespace if config.shares_cache else ""
                made = [self._make(name, namespace, p) for p in self.partitions]
                for lane in made:
                    await lane.stream.ensure_group()
                self._register(name, made)
            lanes = self.of_tenant(name, config)
            await self._mirror_quota(lanes[0].keys, config)
        for name in new:
            logger.info("serving tenant %s", name)
        listed = {name.decode() if isinstance(name, bytes) else str(name) for name in records}
        for name in [name for name in self._lanes if name not in listed]:
            if name != self.default.tenant:
                del self._lanes[name]
                logger.info("tenant %s removed: no longer reading its stream", name)
        await self.redis.script_load(ADMISSION_LUA)
        await self.reader.refresh_owners()
        return new

    async def _mirror_quota(self, keys: KeySpace, config: TenantConfig) -> None:
        """Copy the tenant's limits into its quota hash, and each partition's copy (the
        admission script of a partition reads the copy in its own slot)."""
        fields = quota_fields(config)
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in keys.quota_copies(self.info.name, self.info.partitions):
                pipe.hset(name, mapping=fields)
            await execute_pipeline(pipe)

    async def ensure_groups(self) -> None:
        """Create every lane's stream and group if missing (first start, after a restart)."""
        for lane in self:
            await lane.stream.ensure_group()

    # -- reading -----------------------------------------------------------------------------------
    async def read(
        self, lanes: Sequence[Lane], count: int, block_ms: int | None, idle: bool = True
    ) -> list[tuple[Lane, Entry]]:
        """Up to `count` new entries from each of `lanes`: the owned partitions' first, others'
        only when those stayed empty while the worker was `idle` (`PartitionReader`); one
        XREADGROUP per hash slot."""
        try:
            return await self.reader.read(lanes, count, block_ms, idle)
        except ResponseError as exc:
            if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                raise
            logger.warning("a request stream or its group vanished; recreating them")
            await self.ensure_groups()
            return []

    async def _backlog(self, tenant: str) -> int:
        """The tenant's entries in the model's streams, every partition's summed."""
        lanes = self._lanes[tenant]
        if len(lanes) == 1:
            return await lanes[0].stream.backlog()
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in lanes:
                pipe.xlen(lane.stream.stream)
            return sum(int(n) for n in await execute_pipeline(pipe))

    async def over_cap(self, lane: Lane, entries: list[Entry]) -> tuple[list[Entry], Outcome]:
        """Split `entries` of `lane` into those to run and an outcome refusing the rest.

        While the tenant's streams (every partition's) hold more than its cap, the newest
        entries read, as many as the excess, are answered with `QuotaExceeded` (acknowledged).
        """
        cap = lane.max_inflight
        refused = Outcome()
        if not cap or not entries:
            return entries, refused
        excess = await self._backlog(lane.tenant) - cap
        if excess <= 0:
            return entries, refused
        keep = entries[: max(len(entries) - excess, 0)]
        for entry in entries[len(keep) :]:
            refused.acks.append(entry.entry_id)
            error = QuotaExceeded(
                f"tenant {lane.tenant} is over its in-flight quota of {cap} requests",
                quota="max_inflight", limit=float(cap), admitted=0,
            )  # fmt: skip
            try:
                request = entry.request()
                validate_client_id(request.client_id)
            except (MalformedMessage, InvalidName) as exc:
                refused.dead_letter(entry, MalformedMessage(str(exc)))
                continue
            refused.error(request.client_id, request.request_id, error)
        logger.info("tenant %s over its cap: %d entries refused", lane.tenant, len(refused.acks))
        return keep, refused
