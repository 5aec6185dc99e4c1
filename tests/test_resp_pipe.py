"""RespPipe: RESP2 replies parsed however they are split, big values received in place."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from resp_wire import BIG, EXPECTED_REPLIES, WIRE, assert_wire_replies

from lmqueue.producer.resp_pipe import RespPipe, _Protocol


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def _feed(protocol: _Protocol, data: bytes, step: int) -> None:
    """Deliver `data` as the transport would, at most `step` bytes per read."""
    at = 0
    while at < len(data):
        buffer = protocol.get_buffer(-1)
        size = min(len(buffer), step, len(data) - at)
        buffer[:size] = data[at : at + size]
        protocol.buffer_updated(size)
        at += size


async def _pipeline(step: int) -> list[Any]:
    protocol = _Protocol()
    transport = _Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(protocol.execute([("PING",)] * EXPECTED_REPLIES))
    await asyncio.sleep(0)
    assert transport.written == b"*1\r\n$4\r\nPING\r\n" * EXPECTED_REPLIES
    _feed(protocol, WIRE, step)
    return await pending


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100, 4096, 1 << 20])
async def test_replies_parse_the_same_however_the_bytes_are_split(step):
    replies = await _pipeline(step)
    assert_wire_replies(replies)


async def test_big_values_arrive_in_writable_buffers_of_their_own():
    xread, *_ = await _pipeline(1000)
    value = xread[0][1][0][1][3]
    assert isinstance(value, memoryview) and not value.readonly and value.nbytes == len(BIG)
    array = np.frombuffer(value, dtype=np.uint8)
    array[0] ^= 1  # the caller may change it: nobody else holds it
    assert array.flags.writeable


async def test_garbage_from_the_server_fails_the_pipeline_and_closes_the_connection():
    protocol = _Protocol()
    transport = _Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(protocol.execute([("PING",)]))
    await asyncio.sleep(0)
    _feed(protocol, b"?what\r\n", 100)
    with pytest.raises(RedisConnectionError, match="unreadable"):
        await pending
    assert transport.closed and protocol.closed


async def test_a_connection_lost_mid_reply_fails_the_pipeline():
    protocol = _Protocol()
    protocol.connection_made(_Transport())  # type: ignore[arg-type]
    pending = asyncio.ensure_future(protocol.execute([("GET", "k")]))
    await asyncio.sleep(0)
    _feed(protocol, b"$%d\r\n%b" % (len(BIG), BIG[:1000]), 100)
    protocol.connection_lost(None)
    with pytest.raises(RedisConnectionError, match="lost"):
        await pending


async def test_a_real_server_round_trip_with_a_database_number(redis_url):
    pipe = RespPipe(redis_url[: redis_url.rindex("/")] + "/3")
    try:
        stored, (got, missing) = await pipe.execute(("SET", "k", BIG), ("MGET", "k", "nope"))
        assert stored == b"OK" and bytes(got) == BIG and missing is None
    finally:
        pipe.close()
    sync = redis.Redis.from_url(redis_url[: redis_url.rindex("/")] + "/3")
    try:
        assert sync.get("k") == BIG  # it really was database 3
    finally:
        sync.close()


async def test_a_cancelled_read_drops_the_connection_and_the_next_call_reconnects(redis_url):
    pipe = RespPipe(redis_url)
    try:
        blocked = asyncio.ensure_future(
            pipe.execute(("XREAD", "BLOCK", 5000, "STREAMS", "nothing", "$"))
        )
        await asyncio.sleep(0.1)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert await pipe.execute(("PING",)) == [b"PONG"]
    finally:
        pipe.close()


async def test_a_refused_connection_raises_redis_connection_error():
    with pytest.raises(RedisConnectionError):
        await RespPipe("redis://127.0.0.1:1/0", connect_timeout_s=1).execute(("PING",))


def test_tls_urls_are_left_to_redis_py():
    assert RespPipe.supports("redis://h:1/0") and RespPipe.supports("unix:///tmp/r.sock")
    assert not RespPipe.supports("rediss://h:1/0")
