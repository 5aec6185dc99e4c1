"""`RespPipe`: a minimal Redis connection whose large values land in buffers of their own.

The client's hot path is receiving 100-200 KB vectors. Through redis-py each one is copied
five times in Python before it becomes a tensor (asyncio's stream buffer, a slice of it,
hiredis's buffer, the bytes object, the float32 copy); here the kernel writes it straight
into the array it is handed out as (``asyncio.BufferedProtocol``), and small replies are
parsed from one reusable buffer. It speaks just what the reply reader and claim-check
resolver need: RESP2 pipelines of plain commands, over TCP or a Unix socket (``rediss://``
URLs keep redis-py: `RespPipe.supports`).

One pipeline at a time. Any failure or cancellation closes the connection (a half-read reply
cannot be resumed); the next `execute` reconnects. Errors are redis-py's types, so callers
treat both paths alike: `ConnectionError` for a lost or refused connection, `ResponseError`
for an error reply.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError

from lmqueue.shared.connections import bounded, tune_socket
from lmqueue.shared.redis_errors import reply_error

__all__ = ["RespPipe"]

#: Bulk strings at least this long get a buffer of their own (a vector), smaller ones are
#: copied out of the shared read buffer.
BIG_BULK_BYTES = 16 * 1024
_READ_BUFFER_BYTES = 256 * 1024
#: The most read into the shared buffer at once. What arrives with a big bulk's first line is
#: copied into its buffer, so reads stay small: a vector follows ~130 bytes of entry id and
#: header, and the kernel writes the rest of it in place.
_READ_WINDOW_BYTES = 16 * 1024


class RespPipe:
    """One connection to the Redis at a ``redis://`` or ``unix://`` URL, connected lazily."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self.options = parse_url(url)
        if not self.supports(url):
            raise ValueError(f"RespPipe does not speak TLS: {url!r}")
        self.connect_timeout_s = connect_timeout_s
        self._protocol: _Protocol | None = None

    @staticmethod
    def supports(url: str) -> bool:
        """Whether `url` is one this class can connect to (not TLS)."""
        return "connection_class" not in parse_url(url) or url.startswith("unix://")

    async def execute(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send `commands` as one pipeline; their replies, error replies as exceptions.

        Bulk strings come back as bytes, or, from `BIG_BULK_BYTES` on, as writable
        ``memoryview``s of buffers nobody else holds.

        Raises:
            redis.exceptions.ConnectionError: if the connection failed or was lost.
        """
        try:
            if self._protocol is None or self._protocol.closed:
                self._protocol = await self._connect()
            return await self._protocol.execute(commands)
        except BaseException:
            self.close()
            raise

    def retarget(self, host: str, port: int) -> None:
        """Speak to the node at `host`:`port` from the next call on (a cluster's other node)."""
        if (self.options.get("host"), self.options.get("port")) != (host, port):
            self.close()
            self.options = {**self.options, "host": host, "port": port}

    def close(self) -> None:
        """Drop the connection (idempotent)."""
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        options = self.options
        try:
            if "path" in options:
                connecting = loop.create_unix_connection(_Protocol, options["path"])
            else:
                host, port = options.get("host", "localhost"), options.get("port", 6379)
                connecting = loop.create_connection(_Protocol, host, port)
            transport, protocol = await bounded(connecting, self.connect_timeout_s, "connecting")
        except OSError as exc:
            raise RedisConnectionError(f"connecting to Redis failed: {exc}") from exc
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            tune_socket(sock)
        handshake: list[tuple[Any, ...]] = []
        if options.get("password") is not None:
            user = options.get("username")
            handshake.append(("AUTH", *([user] if user else []), options["password"]))
        if options.get("db"):
            handshake.append(("SELECT", options["db"]))
        try:
            for reply in await protocol.execute(handshake) if handshake else []:
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            protocol.close()
            raise
        return protocol


def _pack(commands: tuple[tuple[Any, ...], ...]) -> bytes:
    """RESP2 encoding of a pipeline of commands (str, bytes and int arguments)."""
    parts = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            raw = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%b\r\n" % (len(raw), raw))
    return b"".join(parts)


class _Protocol(asyncio.BufferedProtocol):
    """Parses RESP2 replies as they arrive; big bulk strings are received in place."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray(_READ_BUFFER_BYTES)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._bulk: memoryview | None = None  # the big bulk string being received
        self._filled = 0
        self._skip_crlf = False
        self._stack: list[list[Any]] = []  # arrays being filled: [remaining, items]
        self._replies: list[Any] = []
        self._expected = 0
        self._waiter: asyncio.Future[list[Any]] | None = None

    # -- the connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed by server'}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._fail(RedisConnectionError("connection closed"))

    async def execute(self, commands: tuple[tuple[Any, ...], ...] | list[Any]) -> list[Any]:
        if self.closed or self.transport is None:
            raise RedisConnectionError("connection to Redis lost")
        assert self._waiter is None, "one pipeline at a time"
        waiter: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiter, self._expected, self._replies = waiter, len(commands), []
        self.transport.write(_pack(tuple(commands)))
        return await waiter

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    # -- receiving -----------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._bulk is not None:
            return self._bulk[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buffer) - self._end < _READ_WINDOW_BYTES:  # move the tail to the front
            tail = self._end - self._start
            self._buffer[:tail] = self._buffer[self._start : self._end]
            self._start, self._end = 0, tail
            if len(self._buffer) - self._end < _READ_WINDOW_BYTES:  # a line longer than that
                self._buffer.extend(bytes(len(self._buffer)))
        return memoryview(self._buffer)[self._end : self._end + _READ_WINDOW_BYTES]

    def buffer_updated(self, nbytes: int) -> None:
        if self._bulk is not None:
            self._filled += nbytes
            if self._filled < len(self._bulk):
                return
            value, self._bulk = self._bulk, None
            self._skip_crlf = True
            self._emit(value)
        else:
            self._end += nbytes
        try:
            self._parse()
        except Exception as exc:  # garbage from the server: this connection is done for
            self._fail(RedisConnectionError(f"unreadable reply from Redis: {exc!r}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails the waiter

    def _parse(self) -> None:
        """Parse every complete item in the buffer; stop at an incomplete one or a big bulk."""
        buffer = self._buffer
        while self._bulk is None:
            if self._skip_crlf:
                if self._end - self._start < 2:
                    return
                self._start += 2
                self._skip_crlf = False
            start = self._start
            line_end = buffer.find(b"\r\n", start, self._end)
            if line_end < 0:
                return
            if buffer[start] != 36:  # not a bulk string: arrays, integers, errors, ...
                self._start = line_end + 2
                self._item(buffer[start], buffer[start + 1 : line_end])
                continue
            length = int(buffer[start + 1 : line_end])
            body = line_end + 2
            if 0 <= length < BIG_BULK_BYTES:
                if self._end - body < length + 2:
                    return
                self._start = body + length + 2
                self._emit(bytes(buffer[body : body + length]))
            elif length < 0:
                self._start = body
                self._emit(None)
            else:
                self._begin_bulk(length, body)

    def _item(self, kind: int, line: bytearray) -> None:
        """Parse an item other than a bulk string, from its first line after the type byte."""
        if kind == 42:  # * array
            length = int(line)
            if length > 0:
                self._stack.append([length, []])
            else:
                self._emit(None if length < 0 else [])
        elif kind == 58:  # : integer
            self._emit(int(line))
        elif kind == 43:  # + simple string
            self._emit(bytes(line))
        elif kind == 45:  # - error
            self._emit(reply_error(line.decode(errors="replace")))
        else:
            raise ValueError(f"unexpected RESP type byte {kind!r}")

    def _begin_bulk(self, length: int, body: int) -> None:
        """Receive a big bulk string into a buffer of its own, from what is here already."""
        target = np.empty(length, dtype=np.uint8).data
        here = min(self._end - body, length)
        target[:here] = memoryview(self._buffer)[body : body + here]
        self._start = body + here
        if here == length:
            self._skip_crlf = True
            self._emit(target)
        else:
            self._bulk, self._filled = target, here

    def _emit(self, value: Any) -> None:
        """Place a parsed item in its array, or count it as a whole reply."""
        stack = self._stack
        while stack:
            top = stack[-1]
            top[1].append(value)
            top[0] -= 1
            if top[0]:
                return
            value = stack.pop()[1]
        self._replies.append(value)
        if len(self._replies) == self._expected:
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(self._replies)
