"""`RequestStream`: one worker's view of its model's request stream and consumer group.

Every worker of a model reads the same stream through the consumer group ``workers`` under a
stable consumer name, so a restarted worker finds its own unacknowledged entries and a
janitor can hand a dead worker's entries to a live one. Entries are deleted once acknowledged
(XACK + XDEL): the stream is never capped with MAXLEN, which would drop pending work.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from lmqueue.shared.connections import execute_pipeline
from lmqueue.shared.errors import MalformedMessage
from lmqueue.shared.keys import WORKER_GROUP
from lmqueue.shared.wire import Request, decode_request

__all__ = ["Entry", "PendingInfo", "RequestStream"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    """One stream entry as read: its id and raw fields (a value, not declared frozen for the
    same reason as `lmqueue.shared.wire.Request`)."""

    entry_id: str
    fields: dict[bytes, bytes]
    _decoded: Request | MalformedMessage | None = field(default=None, compare=False, repr=False)

    def request(self) -> Request:
        """The entry's request, decoded once (`decode_request`; raises its `MalformedMessage`).

        A worker decodes what it reads when it reads it (`Worker._read_into_scheduler`): most
        of a batch is read during the forward before, so decoding it then takes it off the
        way from the pick to the next forward, where the backend idles.
        """
        decoded = self._decoded
        if decoded is None:
            try:
                decoded = decode_request(self.fields)
            except MalformedMessage as exc:
                decoded = exc
            self._decoded = decoded  # a cache: not part of its value
        if isinstance(decoded, MalformedMessage):
            raise decoded
        return decoded


@dataclass(frozen=True, slots=True)
class PendingInfo:
    """What XPENDING says about one entry."""

    entry_id: str
    consumer: str
    idle_ms: int
    deliveries: int


def _stream_vanished(error: ResponseError) -> bool:
    """Whether the stream or its group was deleted under us (flush, or restart without data)."""
    text = str(error)
    return text.startswith(("NOGROUP", "UNBLOCKED"))


_DELETE_IF_IDLE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then
  return 0
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(raw: Any) -> list[Entry]:
    """Entries from an XREADGROUP/XCLAIM reply, skipping ids whose fields were deleted."""
    entries = []
    for entry_id, fields in raw or []:
        if fields is None:  # the id is pending but the entry was deleted
            continue
        key = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        entries.append(Entry(key, fields))
    return entries


class RequestStream:
    """Consumer-group operations on one request stream, as consumer `consumer`."""

    def __init__(self, redis: Any, stream: str, consumer: str, group: str = WORKER_GROUP) -> None:
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self.group = group
        self._delete_if_idle = redis.register_script(_DELETE_IF_IDLE)

    async def ensure_group(self) -> None:
        """Create the stream and group if missing (first start, or after a Redis restart)."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            logger.info("created consumer group %s on %s", self.group, self.stream)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` never-delivered entries, blocking up to `block_ms` (None: no block)."""
        return _entries(await self._read(">", count, block_ms))

    async def read_own_pending(
        self, count: int, after: str = "0"
    ) -> tuple[str | None, list[Entry]]:
        """Up to `count` entries delivered to this consumer earlier and never acknowledged.

        Each entry returned counts as one more delivery (Redis increments its counter).

        Returns:
            The id to continue after (None when nothing is left after `after`), and the
            entries; pending ids whose entries were deleted are skipped.
        """
        rows = await self._read(after, count, None)
        if not rows:
            return None, []
        return _text(rows[-1][0]), _entries(rows)

    async def _read(self, start: str, count: int, block_ms: int | None) -> list[Any]:
        try:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: start}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if not _stream_vanished(exc):
                raise
            logger.warning("request stream or group vanished (Redis restarted?); recreating it")
            await self.ensure_group()
            return []
        if not reply:
            return []
        return list(reply[0][1])

    def ack(self, pipe: Any, entry_ids: Sequence[str]) -> None:
        """Queue XACK and XDEL of `entry_ids` on a pipeline: done, and gone from the stream."""
        if entry_ids:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)

    async def touch(self, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries this worker still works on, so none reclaims them.

        JUSTID keeps the delivery counters as they are.
        """
        if entry_ids:
            await self.redis.xclaim(
                self.stream, self.group, self.consumer, 0, list(entry_ids), justid=True
            )

    async def autoclaim(
        self, min_idle_ms: int, count: int, start: str = "0-0"
    ) -> tuple[str, list[Entry]]:
        """Take over up to `count` entries idle for `min_idle_ms` from any consumer.

        Each claimed entry counts as one more delivery. Redis scans at most ``10 * count``
        pending entries per call, so callers follow the returned cursor until it is ``0-0``.

        Returns:
            The cursor to continue from, and the claimed entries.
        """
        try:
            reply = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_ms, start, count=count
            )
        except ResponseError as exc:
            if not _stream_vanished(exc):
                raise
            await self.ensure_group()
            return "0-0", []
        cursor = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        return cursor, _entries(reply[1])

    async def pending_info(self, entry_ids: Sequence[str]) -> dict[str, PendingInfo]:
        """Delivery counts and owners of `entry_ids` (absent ids are not pending)."""
        if not entry_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
            replies = await execute_pipeline(pipe)
        info = {}
        for rows in replies:
            for row in rows:
                entry_id = row["message_id"]
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                consumer = row["consumer"]
                consumer = consumer.decode() if isinstance(consumer, bytes) else consumer
                info[entry_id] = PendingInfo(
                    entry_id,
                    consumer,
                    int(row["time_since_delivered"]),
                    int(row["times_delivered"]),
                )
        return info

    async def consumers(self) -> list[tuple[str, int, int]]:
        """Every consumer of the group as (name, pending entries, idle ms)."""
        try:
            rows = await self.redis.xinfo_consumers(self.stream, self.group)
        except ResponseError as exc:
            if not _stream_vanished(exc):
                raise
            return []
        return [(_text(row["name"]), int(row["pending"]), int(row["idle"])) for row in rows]

    async def delete_consumer_if_idle(self, consumer: str) -> bool:
        """Delete `consumer` from the group if it has nothing pending, atomically.

        XGROUP DELCONSUMER drops the consumer's pending entries with it, so the check and the
        delete run as one script: a consumer that took work meanwhile is kept.
        """
        deleted = await self._delete_if_idle(keys=[self.stream], args=[self.group, consumer])
        return bool(deleted)

    async def backlog(self) -> int:
        """Entries in the stream: pending plus not yet delivered (acked ones are deleted)."""
        return int(await self.redis.xlen(self.stream))
