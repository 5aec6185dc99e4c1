"""`RespSocket`: a blocking Redis connection for a thread of its own, moving vectors uncopied.

A worker writes each batch's replies, and a client reads its replies, on a thread that spends
its time in the kernel with the GIL released: one ``sendmsg`` hands a whole pipeline over,
every vector an iovec of its own (never joined into one bytes object), and a vector in a reply
is received straight into the array it is handed out as (``recv_into``, ``MSG_WAITALL``).
Meanwhile the event loop's thread reads, decodes and computes. The asyncio path cost 3x the
CPU for the same sends once the socket was full (a wake-up, a callback and a partial write per
64 KiB; docs/benchmarks-history.md, "RespPipe alone").

It speaks RESP2 pipelines of plain commands over TCP or a Unix socket; not TLS, nor anything
but a plain redis-py client's connection (`target_of` says None, and callers keep redis-py).
Timeouts are the kernel's (``SO_SNDTIMEO``/``SO_RCVTIMEO``): a peer that stops reading or
answering ends a call with redis-py's `TimeoutError` after ``timeout_s`` without progress. Any
failure closes the connection, and the next call connects again. Errors are redis-py's types:
`ConnectionError` and `TimeoutError` are raised; an error reply comes back as a
`ResponseError` in its place among the results.

One thread at a time: a `RespSocket` is not shared between threads.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.connection import parse_url as parse_async_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .connections import tune_socket
from .redis_errors import reply_error
from .resp_encoding import BIG_BULK_BYTES, pack_commands

__all__ = [
    "BulkIntake", "RespSocket", "BIG_BULK_BYTES", "target_of", "target_of_url", "pack_commands",
]  # fmt: skip

_BUFFER_BYTES = 256 * 1024
_READ_WINDOW_BYTES = 16 * 1024
_IOV_MAX = 1024
#: What a connection is: ``host``/``port`` or ``path``, and ``username``, ``password``, ``db``.
Target = dict[str, Any]


def target_of_url(url: str) -> Target | None:
    """Where a ``redis://`` or ``unix://`` URL points, or None for what this cannot speak."""
    if url.startswith("rediss://"):
        return None
    options = parse_async_url(url)
    return {k: options[k] for k in ("host", "port", "path", "username", "password", "db")
            if options.get(k) is not None}  # fmt: skip


def target_of(client: Any) -> Target | None:
    """Where a plain redis-py asyncio client connects, or None (TLS, a cluster, a fake)."""
    pool = getattr(client, "connection_pool", None)
    kind = getattr(pool, "connection_class", None)
    if not isinstance(kind, type) or issubclass(kind, SSLConnection):
        return None
    if not issubclass(kind, Connection | UnixDomainSocketConnection):
        return None
    kwargs = pool.connection_kwargs  # type: ignore[union-attr]
    return {k: kwargs[k] for k in ("host", "port", "path", "username", "password", "db")
            if kwargs.get(k) is not None}  # fmt: skip


class BulkIntake(Protocol):
    """Takes the bulk strings of one exact length as they arrive (`RespSocket.receive`).

    Each such bulk is received into `scratch` (reused: it stays in the CPU's cache) and the
    intake is called at once, while those bytes are still there, for the value that stands
    in the bulk's place: a client widens a float16 vector into its float32 array straight
    from the bytes just received, instead of from a buffer written long before.
    """

    #: The length in bytes of the bulks it takes (others arrive as usual).
    length: int
    #: Where such a bulk is received (`length` bytes).
    scratch: memoryview

    def __call__(self) -> Any:
        """The value of the bulk now in `scratch`."""


class RespSocket:
    """One blocking connection to a Redis `target` (see `target_of`), connected on first use."""

    def __init__(self, target: Target, connect_timeout_s: float = 5.0, timeout_s: float = 10.0):
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._intake: BulkIntake | None = None  # of the receive under way

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RespSocket:
        """A connection to the Redis at `url` (``redis://`` or ``unix://``)."""
        target = target_of_url(url)
        if target is None:
            raise ValueError("RespSocket does not speak TLS")
        return cls(target, **options)

    @property
    def connected(self) -> bool:
        """Whether a connection is open now."""
        return self._sock is not None

    def execute(
        self, commands: Sequence[Sequence[Any]], intake: BulkIntake | None = None
    ) -> list[Any]:
        """Send `commands` as one pipeline; their replies, error replies as `ResponseError`s.

        Bulk strings come back as bytes, or, from `BIG_BULK_BYTES` on, as writable byte
        memoryviews of arrays nobody else holds; those of ``intake.length`` bytes (any size)
        as what `intake` makes of them.

        Raises:
            redis.exceptions.ConnectionError: the connection failed or was lost.
            redis.exceptions.TimeoutError: the server made no progress for ``timeout_s``.
        """
        self.send(commands)
        return self.receive(len(commands), intake)

    def send(self, commands: Sequence[Sequence[Any]]) -> None:
        """Send `commands` as one pipeline (read their replies with `receive`)."""
        self._guard(self._send, pack_commands(commands))

    def send_packed(self, pieces: list[bytes | memoryview]) -> None:
        """Send a pipeline packed already (`pack_commands`)."""
        self._guard(self._send, pieces)

    def receive(self, count: int, intake: BulkIntake | None = None) -> list[Any]:
        """The next `count` replies (bulks of ``intake.length`` bytes as `intake` makes
        them)."""
        self._intake = intake
        try:
            replies: list[Any] = self._guard(self._receive, count)
        finally:
            self._intake = None
        return replies

    def set_timeout(self, timeout_s: float) -> None:
        """Give up on a send or receive that makes no progress for `timeout_s` from now on."""
        if timeout_s != self.timeout_s:
            self.timeout_s = timeout_s
            if self._sock is not None:
                self._apply_timeout(self._sock)

    def interrupt(self) -> None:
        """Cut a call under way on another thread short (it fails with `ConnectionError`)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more

    def close(self) -> None:
        """Drop the connection (idempotent); the next call connects again."""
        sock, self._sock = self._sock, None
        self._start = self._end = 0
        if sock is not None:
            sock.close()

    # -- the connection -------------------------------------------------------------------------
    def _guard(self, action: Any, argument: Any) -> Any:
        """Run `action`, connecting first; translate and close on any failure."""
        try:
            if self._sock is None:
                self._connect()
            return action(argument)
        except (RedisConnectionError, RedisTimeoutError):
            self.close()
            raise
        except BlockingIOError as exc:  # the kernel's send or receive timeout
            self.close()
            raise RedisTimeoutError(f"Redis made no progress in {self.timeout_s:g} s") from exc
        except OSError as exc:
            self.close()
            raise RedisConnectionError(f"connection to Redis failed: {exc}") from exc
        except BaseException:
            self.close()  # a half-sent pipeline or half-read reply cannot be resumed
            raise

    def _connect(self) -> None:
        target = self.target
        if "path" in target:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.connect_timeout_s)
                sock.connect(target["path"])
            except BaseException:
                sock.close()
                raise
        else:
            address = (target.get("host", "localhost"), int(target.get("port", 6379)))
            sock = socket.create_connection(address, timeout=self.connect_timeout_s)
            tune_socket(sock)
        sock.settimeout(None)  # blocking: the kernel's timeouts bound each call
        self._apply_timeout(sock)
        self._sock = sock
        self._start = self._end = 0
        handshake: list[tuple[Any, ...]] = []
        if target.get("password") is not None:
            user = target.get("username")
            handshake.append(("AUTH", *([user] if user else []), target["password"]))
        if target.get("db"):
            handshake.append(("SELECT", target["db"]))
        if handshake:
            self._send(pack_commands(handshake))
            for reply in self._receive(len(handshake)):
                if isinstance(reply, ResponseError):
                    raise _handshake_error(reply)
                if isinstance(reply, Exception):  # LOADING: the server is not up yet
                    raise reply

    def _apply_timeout(self, sock: socket.socket) -> None:
        seconds = max(self.timeout_s, 0.001)
        value = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)

    # -- sending ------------------------------------------------------------------------------
    def _send(self, pieces: list[bytes | memoryview]) -> None:
        sock = self._sock
        assert sock is not None
        first, count = 0, len(pieces)
        while first < count:
            sent = sock.sendmsg(pieces[first : first + _IOV_MAX])
            while sent:  # drop what was sent from the front
                size = len(pieces[first])
                if sent < size:
                    pieces[first] = memoryview(pieces[first])[sent:]
                    break
                sent -= size
                first += 1

    # -- receiving ----------------------------------------------------------------------------
    def _receive(self, count: int) -> list[Any]:
        # Most replies of a worker's pipelines are SET's and MULTI's "+OK": matched here
        # without a line search and a call each (the worker's parsing of its writes' answers
        # 5.6% -> 4.3% of its CPU in lmq bench transport's float16 profile).
        out: list[Any] = []
        for _ in range(count):
            start = self._start
            if self._end - start >= 5 and self._buffer.startswith(b"+OK\r\n", start):
                self._start = start + 5
                out.append(b"OK")
            else:
                out.append(self._item())
        return out

    def _item(self) -> Any:
        """Parse one reply (recursively for arrays)."""
        buffer = self._buffer
        line_end = buffer.find(b"\r\n", self._start, self._end)
        while line_end < 0:
            self._fill()
            line_end = buffer.find(b"\r\n", self._start, self._end)
        start = self._start
        kind = buffer[start]
        self._start = line_end + 2
        if kind == 36:  # $ bulk string
            length = int(buffer[start + 1 : line_end])
            if length < 0:
                return None
            if length >= BIG_BULK_BYTES or (
                self._intake is not None and length == self._intake.length
            ):
                return self._big_bulk(length)
            while self._end - self._start < length + 2:
                self._fill()
            body = self._start
            self._start = body + length + 2
            return bytes(buffer[body : body + length])
        if kind == 42:  # * array
            length = int(buffer[start + 1 : line_end])
            return None if length < 0 else [self._item() for _ in range(length)]
        if kind == 58:  # : integer
            return int(buffer[start + 1 : line_end])
        if kind == 43:  # + simple string
            return bytes(buffer[start + 1 : line_end])
        if kind == 45:  # - error
            return reply_error(buffer[start + 1 : line_end].decode(errors="replace"))
        raise RedisConnectionError(f"unreadable reply from Redis: type byte {kind!r}")

    def _big_bulk(self, length: int) -> Any:
        """Receive a big bulk string into an array of its own (or into the intake's scratch,
        for what the intake makes of it)."""
        intake = self._intake
        if intake is not None and length == intake.length:
            self._receive_bulk(intake.scratch, length)
            return intake()
        target = np.empty(length, dtype=np.uint8).data
        self._receive_bulk(target, length)
        return target

    def _receive_bulk(self, target: memoryview, length: int) -> None:
        """Receive a bulk's `length` bytes and its line end into `target`, from what is here
        already, the rest straight from the kernel."""
        here = min(self._end - self._start, length)
        target[:here] = self._view[self._start : self._start + here]
        self._start += here
        sock = self._sock
        assert sock is not None
        while here < length:
            got = sock.recv_into(target[here:], length - here, socket.MSG_WAITALL)
            if not got:
                raise RedisConnectionError("connection closed by Redis")
            here += got
        while self._end - self._start < 2:
            self._fill()
        self._start += 2

    def _fill(self) -> None:
        """Receive more into the buffer, moving what is unparsed to its front first.

        Reads stay small (`_READ_WINDOW_BYTES`): what arrives with a big bulk's first line is
        copied into its array, the rest the kernel writes there itself.
        """
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buffer) - self._end < _READ_WINDOW_BYTES:
            tail = self._end - self._start
            self._buffer[:tail] = self._buffer[self._start : self._end]
            self._start, self._end = 0, tail
            if len(self._buffer) - self._end < _READ_WINDOW_BYTES:  # a very long line
                self._view.release()
                self._buffer.extend(bytes(len(self._buffer)))
                self._view = memoryview(self._buffer)
        sock = self._sock
        assert sock is not None
        got = sock.recv_into(self._view[self._end : self._end + _READ_WINDOW_BYTES])
        if not got:
            raise RedisConnectionError("connection closed by Redis")
        self._end += got


def _handshake_error(reply: ResponseError) -> Exception:
    """A refused AUTH as redis-py reports it (an AuthenticationError), else the reply."""
    from redis.exceptions import AuthenticationError

    text = str(reply)
    if text.startswith(("WRONGPASS", "NOAUTH", "ERR invalid password", "ERR AUTH")):
        return AuthenticationError(text)
    return reply
