"""`VersionProxy`: a loopback TCP proxy in front of a real redis-server that reports another
version in INFO, so a worker can be shown an old Redis without installing one.

Everything passes through unchanged except the ``redis_version:<real>`` line of INFO replies,
rewritten to ``redis_version:<fake>``. The fake is padded to the real version's length
(``6.2.14`` for ``7.0.15``, ``6.2.1`` for ``7.2.4``), so the RESP bulk length in front of the
INFO text stays right without re-framing replies. A read that ends in the first bytes of the
pattern keeps them until the next read, so a line split across two reads is still rewritten.
"""

from __future__ import annotations

import asyncio
import threading

import redis

from lmqueue.devstack import free_port

__all__ = ["VersionProxy"]


def same_length_version(real: str, major_minor: str) -> str:
    """A version of `major_minor` as long as `real` (pad or cut its patch number)."""
    fill = len(real) - len(major_minor) - 1
    assert fill >= 1, (real, major_minor)
    return f"{major_minor}.{'1' * fill}"


class VersionProxy:
    """Forwards 127.0.0.1:`port` to the Redis on `upstream_port`, reporting `fake_major_minor`
    (e.g. ``"6.2"``) as its version. Use as a context manager."""

    def __init__(self, upstream_port: int, fake_major_minor: str) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        client = redis.Redis(port=upstream_port)
        self.real = str(client.info("server")["redis_version"])
        client.close()
        self.fake = same_length_version(self.real, fake_major_minor)
        self._old = f"redis_version:{self.real}\r\n".encode()
        self._new = f"redis_version:{self.fake}\r\n".encode()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        """The redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> VersionProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop
        )
        self._server = future.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(
            self._pipe(reader, up_writer, rewrite=False),
            self._pipe(up_reader, writer, rewrite=True),
            return_exceptions=True,
        )

    def _split_pattern(self, data: bytes) -> int:
        """Length of the longest end of `data` that begins the pattern (0: none). A complete
        reply ends in CRLF, which begins no pattern, so nothing is held between replies."""
        for size in range(min(len(data), len(self._old) - 1), 0, -1):
            if self._old.startswith(data[-size:]):
                return size
        return 0

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rewrite: bool
    ) -> None:
        pending = b""
        try:
            while chunk := await reader.read(1 << 16):
                if rewrite:
                    pending = (pending + chunk).replace(self._old, self._new)
                    held = self._split_pattern(pending)  # may finish in the next read
                    chunk, pending = pending[: len(pending) - held], pending[len(pending) - held :]
                writer.write(chunk)
                await writer.drain()
        finally:
            if pending:
                writer.write(pending)
            writer.close()
