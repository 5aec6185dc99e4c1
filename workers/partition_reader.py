"""`PartitionReader`: reads a worker's own partitions first, and others' only when idle.

A model with N > 1 partitions (shared/partitions.py) has one request stream per tenant and
partition. Every worker computes the same ownership table from the live workers' heartbeats
(`refresh_owners`, every few seconds, so a joining or dead worker is rebalanced within
seconds) and reads:

1. its own partitions, every tenant's streams of a partition in one XREADGROUP (they share the
   ``{<model>:<p>}`` slot; on a single instance all of them in one);
2. when those are empty and the worker is idle (no batch in the backend or waiting in its
   scheduler), the partition of another owner whose oldest waiting entry has waited at least
   `steal_after_ms` (work stealing; the age is the entry id's clock against this host's, as
   in the queue-wait metric). Stealing by age, not by the thief's idleness, keeps a lineage
   on its owner while the owner keeps up: an owner that is busy but serving its partitions
   within `steal_after_ms` loses nothing to a worker that happens to be idle (a stolen
   particle recomputes its whole prompt on the thief), while a dead owner's partitions
   (until the heartbeats rebalance them) and a hot partition, whose entries wait longer, are
   shared. An idle worker looks at the others' ages at most every quarter of
   `steal_after_ms` (one pipeline of XINFO GROUPS, one of XRANGE).

The consumer group still delivers each entry once, whoever reads it, so two workers briefly
disagreeing about ownership (heartbeats seen at different times) costs affinity, never
correctness. A model with one stream is read exactly as before: one XREADGROUP, blocking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from lmqueue.shared.connections import execute_pipeline, is_cluster
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.keys import WORKER_GROUP
from lmqueue.shared.partitions import owned_partitions
from lmqueue.shared.registry import ModelRegistry
from lmqueue.shared.settings import WorkerSettings

from .metrics import WorkerMetrics
from .read_connection import ReadConnection
from .request_stream import Entry, RequestStream

__all__ = ["PartitionReader", "StreamLane"]


class StreamLane(Protocol):
    """What the reader needs of a lane: its stream and the partition that stream belongs to.

    `tenant_lanes.Lane` is one; the reader does not import it, so the lanes depend on the
    reader and not the other way round.
    """

    @property
    def stream(self) -> RequestStream: ...

    @property
    def partition(self) -> int | None: ...


Lane = TypeVar("Lane", bound=StreamLane)

logger = logging.getLogger(__name__)

#: While blocking on partitions in several cluster slots (no one XREADGROUP can block on
#: them all), they are polled this often.
_POLL_MS = 10


class PartitionReader(Generic[Lane]):
    """The read side of one worker over its model's partitions."""

    def __init__(
        self, redis: Any, settings: WorkerSettings, count: int,
        metrics: WorkerMetrics | None = None,
    ) -> None:  # fmt: skip
        self.redis = redis
        self.metrics = metrics
        self.settings = settings
        self.count = count
        self.registry = ModelRegistry(redis, settings.redis.keyspace())
        #: Until the first refresh a worker owns everything (it may be alone).
        self.owned: frozenset[int] = frozenset(range(count))
        self.steal_after_ms = settings.steal_after_ms
        #: Entries taken from partitions this worker does not own.
        self.stolen = 0
        self._cluster = is_cluster(redis)
        #: On a single instance, reads go out on a connection of their own (`ReadConnection`).
        self._reads = None if self._cluster else ReadConnection(redis)
        self._next_look = 0.0

    async def aclose(self) -> None:
        """Close the reads' own connection (a later read opens another)."""
        if self._reads is not None:
            await self._reads.aclose()

    @property
    def _live_within_s(self) -> float:
        """A worker is live while its last heartbeat is younger than three heartbeats."""
        return max(3 * self.settings.heartbeat_s, 1.0)

    async def refresh_owners(self) -> None:
        """Recompute the partitions this worker owns from the live workers' heartbeats."""
        if self.count <= 1:
            return
        live = await self.registry.live_workers(self.settings.model, self._live_within_s)
        owned = owned_partitions(self.settings.name, live, self.count)
        if owned != self.owned:
            logger.info("owning partitions %s of %d (%d live workers)", sorted(owned),
                        self.count, len(set(live) | {self.settings.name}))  # fmt: skip
        self.owned = owned
        if self.metrics is not None:
            self.metrics.observe_partitions(len(owned))

    async def check_peers(self) -> None:
        """Refuse to serve with another partition count than the model's live workers: clients
        would send requests to streams that some workers never read.

        Raises:
            SettingsError: naming the live workers and their count.
        """
        name, me = self.settings.model, self.settings.name
        if not await self.registry.is_published(name):
            return
        published = (await self.registry.info(name)).partitions
        if published == self.count:
            return
        others = sorted(set(await self.registry.live_workers(name, self._live_within_s)) - {me})
        if others:
            raise SettingsError(
                f"partitions={self.count}, but live workers of {name} ({', '.join(others[:3])}) "
                f"serve it with {published}: start every worker of a model with the same "
                "LMQ_PARTITIONS"
            )

    async def read(
        self, lanes: Sequence[Lane], count: int, block_ms: int | None, idle: bool = True
    ) -> list[tuple[Lane, Entry]]:
        """Up to `count` new entries from each of `lanes`, owned partitions first.

        While the worker is `idle` (nothing picked or waiting) and its own partitions are
        empty, it takes from another partition whose oldest waiting entry has waited
        `steal_after_ms` (`_steal`); a worker reading ahead during a forward steals nothing.
        Returns within about `block_ms` (None: without blocking).
        """
        if not lanes:
            return []
        if self.count <= 1:
            return await self._read(lanes, count, block_ms)
        own = [lane for lane in lanes if lane.partition in self.owned]
        others = [lane for lane in lanes if lane.partition not in self.owned]
        if not idle:
            return await self._read(own, count, block_ms) if own else []
        if own and (read := await self._read(own, count, None)):
            return read
        if stolen := await self._steal(others, count):
            self.stolen += len(stolen)
            if self.metrics is not None:
                self.metrics.observe_partitions(len(self.owned), len(stolen))
            return stolen
        if block_ms is None:
            return []
        wait_ms = max(min(block_ms, self._check_every_ms()), 1)  # then look at others again
        if own:
            return await self._read(own, count, wait_ms)
        await asyncio.sleep(wait_ms / 1000)
        return []

    def _check_every_ms(self) -> int:
        """How often an idle worker looks at the other partitions' waiting entries."""
        return max(self.steal_after_ms // 4, _POLL_MS)

    async def _steal(self, others: Sequence[Lane], count: int) -> list[tuple[Lane, Entry]]:
        """Entries of the other partition whose oldest waiting entry waited longest, if that
        is at least `steal_after_ms` (at most one look every `_check_every_ms`; with 0, any
        waiting entry qualifies and every call looks: burst mode drains every partition)."""
        now = time.monotonic()
        if not others or (self.steal_after_ms and now < self._next_look):
            return []
        self._next_look = now + self._check_every_ms() / 1000
        waiting = await _oldest_waiting_ms(self.redis, others)
        if not waiting:
            return []
        oldest_ms, partition = min((ms, lane.partition or 0) for lane, ms in waiting)
        if time.time() * 1000 - oldest_ms < self.steal_after_ms:
            return []
        victims = [lane for lane in others if lane.partition == partition]
        return await self._read(victims, count, None)

    async def _read(
        self, lanes: Sequence[Lane], count: int, block_ms: int | None
    ) -> list[tuple[Lane, Entry]]:
        """One XREADGROUP over `lanes` if they share a slot (or Redis has one), else one per
        partition, blocking by polling."""
        groups = _by_partition(lanes) if self._cluster else [list(lanes)]
        if len(groups) == 1:
            return await self._xreadgroup(groups[0], count, block_ms)
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            replies = await asyncio.gather(
                *(self._xreadgroup(g, count, None) for g in groups), return_exceptions=True
            )
            read = [item for reply in replies if isinstance(reply, list) for item in reply]
            failed = [reply for reply in replies if isinstance(reply, BaseException)]
            if failed and not read:
                raise failed[0]
            if failed:  # what the others delivered is this consumer's now: never drop it
                logger.warning("reading %d of %d partitions failed: %s", len(failed),
                               len(groups), failed[0])  # fmt: skip
            if read or time.monotonic() >= deadline:
                return read
            await asyncio.sleep(_POLL_MS / 1000)

    async def _xreadgroup(
        self, lanes: Sequence[Lane], count: int, block_ms: int | None
    ) -> list[tuple[Lane, Entry]]:
        by_stream = {lane.stream.stream: lane for lane in lanes}
        if self._reads is not None:
            rows_by_stream = await self._reads.xreadgroup(
                WORKER_GROUP, self.settings.name, list(by_stream), count, block_ms
            )
            return [(by_stream[name], Entry(entry_id, fields))
                    for name, rows in rows_by_stream
                    for entry_id, fields in rows if fields is not None]  # fmt: skip
        reply = await self.redis.xreadgroup(
            WORKER_GROUP, self.settings.name, dict.fromkeys(by_stream, ">"),
            count=count, block=block_ms,
        )  # fmt: skip
        read = []
        for raw_stream, rows in reply or []:
            name = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            lane = by_stream[name]
            for entry_id, fields in rows:
                if fields is not None:
                    key = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    read.append((lane, Entry(key, fields)))
        return read


async def _oldest_waiting_ms(redis: Any, lanes: Sequence[Lane]) -> list[tuple[Lane, int]]:
    """For each of `lanes` with entries not yet delivered, when its oldest one was added (the
    ms part of its id, Redis's clock): the group's last-delivered id, then the entry after it."""
    async with redis.pipeline(transaction=False) as pipe:
        for lane in lanes:
            pipe.xinfo_groups(lane.stream.stream)
        infos = await execute_pipeline(pipe, raise_on_error=False)
    behind: list[tuple[Lane, str]] = []
    for lane, groups in zip(lanes, infos, strict=True):
        for group in groups if isinstance(groups, list) else []:
            if _text(group["name"]) == WORKER_GROUP and group.get("lag") != 0:  # None: unknown
                behind.append((lane, _text(group["last-delivered-id"])))
    if not behind:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for lane, last_id in behind:
            pipe.xrange(lane.stream.stream, min=f"({last_id}", max="+", count=1)
        firsts = await execute_pipeline(pipe, raise_on_error=False)
    return [
        (lane, int(_text(first[0][0]).partition("-")[0]))
        for (lane, _), first in zip(behind, firsts, strict=True)
        if isinstance(first, list) and first
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _by_partition(lanes: Sequence[Lane]) -> list[list[Lane]]:
    """`lanes` grouped by partition (each group one hash slot), in partition order."""
    groups: dict[int, list[Lane]] = {}
    for lane in lanes:
        groups.setdefault(lane.partition or 0, []).append(lane)
    return [groups[p] for p in sorted(groups)]
