"""ReadConnection: a worker's XREADGROUPs on a connection of their own, against a real Redis.

What it returns must be what redis-py's ``xreadgroup`` returned (the worker's reader made the
same entries of either), its failures redis-py's types, and a failed or cancelled read must
leave it able to read again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from lmqueue.shared.connections import async_redis
from lmqueue.workers.read_connection import ReadConnection

GROUP = "workers"


@pytest.fixture
async def reading(redis_url: str) -> AsyncIterator[tuple[Any, ReadConnection]]:
    """A client of the flushed session server and a `ReadConnection` made from it."""
    client = async_redis(redis_url)
    reads = ReadConnection(client)
    yield client, reads
    await reads.aclose()
    await client.aclose()


async def _stream_with_group(client: Any, name: str, entries: int) -> list[bytes]:
    await client.xgroup_create(name, GROUP, id="0", mkstream=True)
    return [
        await client.xadd(name, {"m": f"envelope {i}".encode(), "n": str(i)})
        for i in range(entries)
    ]


async def test_reads_what_redis_pys_xreadgroup_reads(
    reading: tuple[Any, ReadConnection],
) -> None:
    client, reads = reading
    ids_a = await _stream_with_group(client, "lmq:a", 5)
    ids_b = await _stream_with_group(client, "lmq:b", 2)
    got = await reads.xreadgroup(GROUP, "w1", ["lmq:a", "lmq:b"], 3, None)
    assert got == [("lmq:a", _expected(ids_a[:3])), ("lmq:b", _expected(ids_b))]
    # redis-py's own read of the rest: the same shape, the same consumer group state
    rest = await client.xreadgroup(GROUP, "w2", {"lmq:a": ">"}, count=10)
    assert [(i.decode(), fields) for i, fields in rest[0][1]] == _expected(ids_a[3:], 3)
    pending = await client.xpending("lmq:a", GROUP)
    assert pending["pending"] == 5
    assert {c["name"]: c["pending"] for c in pending["consumers"]} == {b"w1": 3, b"w2": 2}


async def test_an_empty_block_ends_with_no_entries_and_new_ones_wake_it(
    reading: tuple[Any, ReadConnection],
) -> None:
    client, reads = reading
    await _stream_with_group(client, "lmq:s", 0)
    assert await reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, 50) == []
    assert await reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, None) == []
    waiting = asyncio.create_task(reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, 5000))
    await asyncio.sleep(0.1)
    added = await client.xadd("lmq:s", {"m": b"x"})
    got = await asyncio.wait_for(waiting, 2)
    assert got == [("lmq:s", [(added.decode(), {b"m": b"x"})])]


async def test_an_error_reply_raises_and_the_next_read_works(
    reading: tuple[Any, ReadConnection],
) -> None:
    client, reads = reading
    await client.xadd("lmq:nogroup", {"m": b"x"})
    with pytest.raises(ResponseError, match="NOGROUP"):
        await reads.xreadgroup(GROUP, "w", ["lmq:nogroup"], 8, None)
    ids = await _stream_with_group(client, "lmq:s", 1)
    assert await reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, None) == [("lmq:s", _expected(ids))]


async def test_a_cancelled_read_leaves_no_half_read_reply_behind(
    reading: tuple[Any, ReadConnection],
) -> None:
    client, reads = reading
    await _stream_with_group(client, "lmq:s", 0)
    other = await _stream_with_group(client, "lmq:t", 1)
    blocked = asyncio.create_task(reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, 10_000))
    await asyncio.sleep(0.1)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    await asyncio.sleep(0.05)  # the connection's close reaches Redis before the entry
    late = await client.xadd("lmq:s", {"m": b"late"})
    # Had the cancelled read's connection stayed open, Redis would have handed it the late
    # entry, and the next read (of another stream) would take that reply for its own.
    assert await reads.xreadgroup(GROUP, "w", ["lmq:t"], 8, 1000) == [("lmq:t", _expected(other))]
    assert (await client.xpending("lmq:s", GROUP))["pending"] == 0
    assert await reads.xreadgroup(GROUP, "w", ["lmq:s"], 8, None) == [
        ("lmq:s", [(late.decode(), {b"m": b"late"})])
    ]


async def test_a_connection_killed_by_redis_fails_one_read_and_the_next_reconnects(
    reading: tuple[Any, ReadConnection], redis_url: str
) -> None:
    client, reads = reading
    ids = await _stream_with_group(client, "lmq:s", 2)
    await reads.xreadgroup(GROUP, "w", ["lmq:s"], 1, None)
    admin = redis.Redis.from_url(redis_url)
    try:
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
    finally:
        admin.close()
    with pytest.raises(RedisConnectionError):
        await reads.xreadgroup(GROUP, "w", ["lmq:s"], 1, None)
    got = await reads.xreadgroup(GROUP, "w", ["lmq:s"], 1, None)
    assert got == [("lmq:s", _expected(ids[1:], 1))]


async def test_reads_over_tls_with_the_clients_own_settings(tls_redis: tuple[str, Path]) -> None:
    url, _ = tls_redis
    client = async_redis(url)
    reads = ReadConnection(client)
    try:
        await client.delete("lmq:tls")
        ids = await _stream_with_group(client, "lmq:tls", 1)
        got = await reads.xreadgroup(GROUP, "w", ["lmq:tls"], 4, 100)
        assert got == [("lmq:tls", _expected(ids))]
    finally:
        await reads.aclose()
        await client.delete("lmq:tls")
        await client.aclose()


def _expected(ids: list[bytes], first: int = 0) -> list[tuple[str, dict[bytes, bytes]]]:
    """The entries `_stream_with_group` added under `ids`, numbered from `first`."""
    return [
        (entry_id.decode(), {b"m": f"envelope {n}".encode(), b"n": str(n).encode()})
        for n, entry_id in enumerate(ids, start=first)
    ]
