"""`ChaosProxy`: a loopback TCP proxy that injects network faults, for fault-injection tests.

Put it between Redis and its clients (``redis://127.0.0.1:<proxy.port>``) and, while they run:

- `set_latency` delays every chunk by a fixed time in both directions (order and throughput
  are kept: a chunk waits for its due time, not for the chunk before it to be sent);
- `blackhole` stops delivering anything, in both directions, on every connection, old and new,
  while keeping the connections open: a silent peer, like a partition or a frozen host. Bytes
  are held, not dropped (TCP would retransmit them), and `heal` delivers them;
- `reset_all` aborts every open connection with an RST, as a crashed middlebox or a restarted
  load balancer does;
- `heal` ends the blackhole and the latency.

It serves from its own event loop on a daemon thread, so it keeps forwarding while a test's
loop is blocked, and its control methods may be called from any thread. It listens on
127.0.0.1 only. Held bytes are buffered in memory without bound: this is a test tool.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any

from lmqueue.devstack import free_port

__all__ = ["ChaosProxy"]

_CHUNK = 1 << 16


class _Link:
    """One proxied connection: the accepted socket and the upstream one."""

    def __init__(self, down: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.writers = (down, up)

    def abort(self, rst: bool) -> None:
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if rst and sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            writer.transport.abort()


class ChaosProxy:
    """Forwards 127.0.0.1:`port` to `upstream_port`, with faults on demand.

    Use as a context manager, or call `start` and `close`.
    """

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self.accepted = 0
        self.resets = 0
        self._latency_s = 0.0
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="chaos-proxy", daemon=True
        )
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of database 0 through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ChaosProxy:
        """Start listening; returns once connections are accepted."""
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, abort every connection and stop the thread."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- faults --------------------------------------------------------------------------------
    def set_latency(self, seconds: float) -> None:
        """Deliver every chunk `seconds` after it was read (0: at once)."""
        self._loop.call_soon_threadsafe(setattr, self, "_latency_s", max(seconds, 0.0))

    def blackhole(self) -> None:
        """Stop delivering bytes on every connection; connections stay open, bytes are held."""
        self._loop.call_soon_threadsafe(self._gate().clear)

    def reset_all(self) -> int:
        """Abort every open connection with an RST; returns how many were reset."""
        return int(self._call(self._reset_all()))

    def heal(self) -> None:
        """End the blackhole (held bytes are delivered) and the latency."""
        self.set_latency(0.0)
        self._loop.call_soon_threadsafe(self._gate().set)

    @property
    def open_connections(self) -> int:
        """Connections currently proxied."""
        return len(self._links)

    # -- the loop's side -----------------------------------------------------------------------
    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    def _gate(self) -> asyncio.Event:
        if self._flowing is None:
            raise RuntimeError("the proxy is not started")
        return self._flowing

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()

    async def _reset_all(self) -> int:
        links = list(self._links)
        for link in links:
            link.abort(rst=True)
        self.resets += len(links)
        return len(links)

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            down_w.transport.abort()
            return
        link = _Link(down_w, up_w)
        self._links.add(link)
        pipes = [
            asyncio.create_task(self._pipe(down_r, up_w)),
            asyncio.create_task(self._pipe(up_r, down_w)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:  # one side ended: end both, as a proxy does
            for pipe in pipes:
                pipe.cancel()
            self._links.discard(link)
            link.abort(rst=False)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction: read chunks at once, deliver each when due and flowing."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._deliver(queue, writer))
        try:
            while not sender.done() and (data := await reader.read(_CHUNK)):
                queue.put_nowait((self._loop.time() + self._latency_s, data))
            queue.put_nowait((0.0, b""))
            await sender
        except OSError:
            pass
        finally:
            sender.cancel()

    async def _deliver(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                return
            delay_s = due - self._loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await self._gate().wait()
            writer.write(data)
            await writer.drain()
