"""`ReadConnection`: a worker's XREADGROUPs on one connection of their own.

A worker reads a batch's entries with one XREADGROUP; through redis-py's ``execute_command``
each read also checks a connection out of the pool and back in, goes through the retry
wrapper and the reply callback that makes every entry's fields a dict: ~170 against ~110 CPU
us a read of 32 entries from a local Redis, on this project's 2-core machine (1,500 reads
each, three rounds alternated; docs/benchmarks-history.md, "Issue 33, 2026-12-07 (eighth
session)"). That is a worker's largest cost per batch on its event loop (``lmq bench
transport``: ~850 CPU us a batch besides ~50 a reply), paid for every batch a GPU forwards.

Here the command goes out on a connection made from the client's own pool settings (so TLS,
a Unix socket, ACL credentials, timeouts and its health checks are as for every other
command) and the raw reply is read back. redis-py's connection closes itself on any failure
or cancellation of a send or read (a half-read reply cannot be resumed); the next read
connects again. Error replies raise as they do through redis-py (`ResponseError`, e.g.
``NOGROUP``). A single instance only: a cluster's reads keep the cluster client's routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ReadConnection"]


class ReadConnection:
    """XREADGROUP on a connection of its own, made like those of `redis`'s pool (one read at a
    time: the worker's read loop is its only user)."""

    def __init__(self, redis: Any) -> None:
        self._pool = redis.connection_pool
        self._connection: Any = None

    async def xreadgroup(
        self, group: str, consumer: str, streams: Sequence[str], count: int, block_ms: int | None
    ) -> list[tuple[str, list[tuple[str, dict[bytes, bytes] | None]]]]:
        """New entries (``>``) of `streams` for `consumer`: ``[(stream, [(id, fields), ...])]``
        as redis-py's ``xreadgroup`` gives them (fields None for an entry deleted since), or
        an empty list when none came within `block_ms` (None: no blocking).

        Raises:
            redis.exceptions.ResponseError: Redis refused the read (e.g. ``NOGROUP``).
            redis.exceptions.ConnectionError, TimeoutError: the connection failed.
        """
        connection = self._connection
        if connection is None:
            connection = self._connection = self._pool.make_connection()
        # numbers as text: a command of strings only is packed by the project's packer, not
        # redis-py's (`shared.connections._VectoredConnection.pack_command`)
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", str(count)]
        if block_ms is not None:
            args += ["BLOCK", str(block_ms)]
        args += ["STREAMS", *streams, *(">" for _ in streams)]
        await connection.send_command(*args)
        reply = await connection.read_response()
        return [(_text(name), [(_text(entry_id), _fields(raw)) for entry_id, raw in rows])
                for name, rows in reply or ()]  # fmt: skip

    async def aclose(self) -> None:
        """Close the connection (a later read opens another)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: Any) -> dict[bytes, bytes] | None:
    """An entry's flat field list as a dict (None: deleted since it was delivered)."""
    if raw is None:
        return None
    return dict(zip(raw[::2], raw[1::2], strict=True))
