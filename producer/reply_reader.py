"""`ReplyReader`: the one task per client that turns its reply stream into settled futures.

It blocks on XREAD of the client's own reply stream (no consumer group: the stream has one
reader), settles each reply's request, and trims what it has read in the same round trip as
the next read. When the connection breaks it reconnects with backoff and asks for every
in-flight request to be submitted again: Redis may have restarted empty, and a request
answered twice is settled once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from shared.errors import MalformedMessage
from shared.wire import decode_reply

from .inflight import InflightTable
from .submitter import REDIS_DOWN

__all__ = ["ReplyReader"]

logger = logging.getLogger(__name__)

_BLOCK_MS = 1000


def _after(entry_id: bytes | str) -> str:
    """The smallest stream id greater than `entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return f"{ms}-{int(seq) + 1}"


class ReplyReader:
    """Reads one reply stream and settles the requests of an `InflightTable`."""

    def __init__(
        self,
        redis: Any,
        stream: str,
        inflight: InflightTable,
        on_reconnect: Callable[[], None],
        read_count: int = 256,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.inflight = inflight
        self.on_reconnect = on_reconnect
        self.read_count = read_count
        self.replies_read = 0
        self.reconnects = 0
        self._last_id = "0-0"

    async def run(self) -> None:
        """Read forever (cancel to stop)."""
        backoff_s = 0.05
        broken = False
        while True:
            try:
                entries = await self._read()
            except REDIS_DOWN as exc:
                if not broken:
                    logger.warning("reply stream read failed (%s); reconnecting", exc)
                broken = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            if broken:
                broken, backoff_s = False, 0.05
                self.reconnects += 1
                logger.info("reconnected; resubmitting %d in-flight requests", len(self.inflight))
                self.on_reconnect()
            self._settle(entries)

    async def _read(self) -> list[tuple[Any, dict[bytes, bytes]]]:
        """Trim what was read, then block for new replies: one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            if self._last_id != "0-0":
                pipe.xtrim(self.stream, minid=_after(self._last_id), approximate=False)
            pipe.xread({self.stream: self._last_id}, count=self.read_count, block=_BLOCK_MS)
            results = await pipe.execute()
        reply = results[-1]
        if not reply:
            return []
        return list(reply[0][1])

    def _settle(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self.replies_read += 1
            try:
                reply = decode_reply(fields)
            except MalformedMessage as exc:
                request_id = exc.data.get("request_id")
                logger.warning("undecodable reply %s: %s", self._last_id, exc.message)
                if isinstance(request_id, str):
                    self.inflight.fail(request_id, exc)
                continue
            self.inflight.resolve(reply)
