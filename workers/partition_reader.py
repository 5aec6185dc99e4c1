"""`PartitionReader`: reads a worker's own partitions first, and others' only when idle.

A model with N > 1 partitions (shared/partitions.py) has one request stream per tenant and
partition. Every worker computes the same ownership table from the live workers' heartbeats
(`refresh_owners`, every few seconds, so a joining or dead worker is rebalanced within
seconds) and reads:

1. its own partitions, every tenant's streams of a partition in one XREADGROUP (they share the
   ``{<model>:<p>}`` slot; on a single instance all of them in one);
2. when those stayed empty for `steal_after_ms` while the worker was idle (no batch in the
   backend or waiting in its scheduler), the other partitions, one at a time in rotating
   order until one yields (work stealing). Waiting first keeps a lineage on its owner while
   the owner keeps up: in a steady SMC workload the owner's next calls arrive within
   milliseconds of its replies, so a worker that is merely between batches, or reading ahead
   during a forward, steals nothing; a dead owner's partitions, a hot partition and the tail
   of a run are shared.

The consumer group still delivers each entry once, whoever reads it, so two workers briefly
disagreeing about ownership (heartbeats seen at different times) costs affinity, never
correctness. A model with one stream is read exactly as before: one XREADGROUP, blocking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.connections import is_cluster
from shared.errors import SettingsError
from shared.keys import WORKER_GROUP
from shared.partitions import owned_partitions
from shared.registry import ModelRegistry
from shared.settings import WorkerSettings

from .request_stream import Entry

if TYPE_CHECKING:
    from .tenant_lanes import Lane

__all__ = ["PartitionReader"]

logger = logging.getLogger(__name__)

#: While blocking on partitions in several cluster slots (no one XREADGROUP can block on
#: them all), they are polled this often.
_POLL_MS = 10


class PartitionReader:
    """The read side of one worker over its model's partitions."""

    def __init__(self, redis: Any, settings: WorkerSettings, count: int) -> None:
        self.redis = redis
        self.settings = settings
        self.count = count
        self.registry = ModelRegistry(redis, settings.redis.keyspace())
        #: Until the first refresh a worker owns everything (it may be alone).
        self.owned: frozenset[int] = frozenset(range(count))
        self.steal_after_ms = settings.steal_after_ms
        #: Entries taken from partitions this worker does not own.
        self.stolen = 0
        self._cluster = is_cluster(redis)
        self._own_empty_since: float | None = None
        self._rotation = 0

    async def refresh_owners(self) -> None:
        """Recompute the partitions this worker owns from the live workers' heartbeats."""
        if self.count <= 1:
            return
        within_s = max(3 * self.settings.heartbeat_s, 1.0)
        live = await self.registry.live_workers(self.settings.model, within_s)
        owned = owned_partitions(self.settings.name, live, self.count)
        if owned != self.owned:
            logger.info("owning partitions %s of %d (%d live workers)", sorted(owned),
                        self.count, len(set(live) | {self.settings.name}))  # fmt: skip
        self.owned = owned

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
        within_s = max(3 * self.settings.heartbeat_s, 1.0)
        others = sorted(set(await self.registry.live_workers(name, within_s)) - {me})
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

        Others' partitions are read only once the owned ones stayed empty for
        `steal_after_ms` while the worker was `idle` (nothing picked or waiting): a worker
        reading ahead during a forward steals nothing. Returns within about `block_ms` (None:
        without blocking).
        """
        if not lanes:
            return []
        if self.count <= 1:
            return await self._read(lanes, count, block_ms)
        own = [lane for lane in lanes if lane.partition in self.owned]
        others = [lane for lane in lanes if lane.partition not in self.owned]
        if not idle:
            self._own_empty_since = None
            return await self._read(own, count, block_ms) if own else []
        if own and (read := await self._read(own, count, None)):
            self._own_empty_since = None
            return read
        now = time.monotonic()
        since = self._own_empty_since = self._own_empty_since or now
        waited_ms = (now - since) * 1000
        if waited_ms < self.steal_after_ms:
            if block_ms is None:
                return []
            wait_ms = max(int(min(block_ms, self.steal_after_ms - waited_ms)), 1)
            if not own:
                await asyncio.sleep(wait_ms / 1000)
            elif read := await self._read(own, count, wait_ms):
                self._own_empty_since = None
                return read
            if (time.monotonic() - since) * 1000 < self.steal_after_ms:
                return []
        stolen = await self._steal(others, count)
        self.stolen += len(stolen)
        return stolen

    async def _steal(self, others: Sequence[Lane], count: int) -> list[tuple[Lane, Entry]]:
        """Entries of the first other partition holding any, starting from a rotating one."""
        groups = _by_partition(others)
        if not groups:
            return []
        self._rotation = (self._rotation + 1) % len(groups)
        for group in groups[self._rotation :] + groups[: self._rotation]:
            if read := await self._read(group, count, None):
                return read
        return []

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


def _by_partition(lanes: Sequence[Lane]) -> list[list[Lane]]:
    """`lanes` grouped by partition (each group one hash slot), in partition order."""
    groups: dict[int, list[Lane]] = {}
    for lane in lanes:
        groups.setdefault(lane.partition or 0, []).append(lane)
    return [groups[p] for p in sorted(groups)]
