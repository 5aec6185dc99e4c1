"""`ReplyReader`: the one task per client that turns its reply stream into settled futures.

It blocks on XREAD of the client's own reply stream (no consumer group: the stream has one
reader), settles each reply's request, and trims what it has read in the same round trip as
the next read. A broken or silent connection is retried with backoff; replies written
meanwhile wait in the stream.

A Redis that restarted without persistence has lost every queued request, and the connection
pool reconnects to it silently, so no error need ever reach this task. The reader therefore
watches the server's identity (``INFO server`` ``run_id``, checked in the read pipeline about
once a second and after every connection error) and, when it changes, asks for every
in-flight request to be submitted again. A request answered twice is settled once; a mere
reconnect to the same server resubmits nothing, so a network blip does not double the backlog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from shared.connections import bounded
from shared.errors import MalformedMessage
from shared.wire import decode_reply

from .inflight import InflightTable
from .submitter import REDIS_DOWN

__all__ = ["ReplyReader", "server_run_id"]

logger = logging.getLogger(__name__)

_BLOCK_MS = 1000
#: How often the server's identity is checked while all is well.
_IDENTITY_CHECK_S = 1.0


def _after(entry_id: bytes | str) -> str:
    """The smallest stream id greater than `entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return f"{ms}-{int(seq) + 1}"


async def server_run_id(redis: Any) -> str:
    """The identity of the Redis process behind `redis`; it changes on every restart."""
    return str((await redis.info("server"))["run_id"])


class ReplyReader:
    """Reads one reply stream and settles the requests of an `InflightTable`.

    Args:
        on_restart: called when the server turns out to be a new process (restarted).
        run_id: the server's identity when the client connected.
        stall_timeout_s: a read unanswered this long past its block time is abandoned and
            retried on a new connection (the server or the path to it went silent).
    """

    def __init__(
        self,
        redis: Any,
        stream: str,
        inflight: InflightTable,
        on_restart: Callable[[], None],
        read_count: int = 256,
        run_id: str | None = None,
        stall_timeout_s: float = 10.0,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.inflight = inflight
        self.on_restart = on_restart
        self.read_count = read_count
        self.run_id = run_id
        self.stall_timeout_s = stall_timeout_s
        self.replies_read = 0
        self.reconnects = 0
        self.restarts_seen = 0
        self._last_id = "0-0"
        self._next_check_s = 0.0

    async def run(self) -> None:
        """Read forever (cancel to stop)."""
        backoff_s = 0.05
        broken = False
        while True:
            try:
                entries = await bounded(
                    self._read(), _BLOCK_MS / 1000 + self.stall_timeout_s, "reply stream read"
                )
            except REDIS_DOWN as exc:
                if not broken:
                    logger.warning("reply stream read failed (%s); reconnecting", exc)
                broken = True
                self._next_check_s = 0.0  # who answers next may be a new server
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            except Exception:  # never let the only reader die; deadlines bound the damage
                logger.exception("reading replies failed; retrying")
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            if broken:
                broken, backoff_s = False, 0.05
                self.reconnects += 1
                logger.info("reply stream reconnected")
            self._settle(entries)

    async def _read(self) -> list[tuple[Any, dict[bytes, bytes]]]:
        """Trim what was read, check the server when due, block for new replies: one trip."""
        check = time.monotonic() >= self._next_check_s
        async with self.redis.pipeline(transaction=False) as pipe:
            if self._last_id != "0-0":
                pipe.xtrim(self.stream, minid=_after(self._last_id), approximate=False)
            if check:
                pipe.info("server")
            pipe.xread({self.stream: self._last_id}, count=self.read_count, block=_BLOCK_MS)
            results = await pipe.execute()
        if check:
            self._next_check_s = time.monotonic() + _IDENTITY_CHECK_S
            self._observe(str(results[-2]["run_id"]))
        reply = results[-1]
        if not reply:
            return []
        return list(reply[0][1])

    def _observe(self, run_id: str) -> None:
        """Note the server's identity; a new one means Redis restarted."""
        if self.run_id is not None and run_id != self.run_id:
            self.restarts_seen += 1
            logger.warning(
                "Redis restarted (run_id %s -> %s); resubmitting %d in-flight requests",
                self.run_id[:8], run_id[:8], len(self.inflight),
            )  # fmt: skip
            self.on_restart()
        self.run_id = run_id

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
