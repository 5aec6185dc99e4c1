"""RespSocket: blocking RESP2 pipelines, vectors sent as their own iovecs and received in place."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import redis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from resp_wire import BIG, EXPECTED_REPLIES, WIRE, assert_wire_replies

from lmqueue.shared.connections import async_redis
from lmqueue.shared.resp_socket import (
    RespSocket,
    pack_commands,
    target_of,
    target_of_url,
)


def _served(
    data: bytes, step: int, hang_up: bool = False
) -> tuple[RespSocket, socket.socket, threading.Thread]:
    """A RespSocket on one end of a socket pair; the other end answers with `data`, `step`
    bytes at a time, once the pipeline has arrived (then hangs up, if told to)."""
    ours, theirs = socket.socketpair()
    sock = RespSocket({"path": "unused"})
    sock._sock = ours  # the pair stands in for a connection to Redis

    def serve() -> None:
        theirs.recv(1 << 16)
        for at in range(0, len(data), step):
            theirs.sendall(data[at : at + step])
            if step < 64:
                time.sleep(0)  # let the reader see the pieces apart
        if hang_up:
            theirs.shutdown(socket.SHUT_RDWR)

    server = threading.Thread(target=serve)
    server.start()
    return sock, theirs, server


def _answers(data: bytes, step: int, commands: int) -> list[Any]:
    """What a RespSocket makes of `data` (sent `step` bytes at a time) as the answers to a
    pipeline of `commands` PINGs."""
    sock, theirs, server = _served(data, step)
    try:
        return sock.execute([("PING",)] * commands)
    finally:
        server.join()
        theirs.close()
        sock.close()


@pytest.mark.parametrize("step", [1, 7, 100, 4096, 1 << 20])
def test_replies_parse_the_same_however_the_bytes_are_split(step: int) -> None:
    assert_wire_replies(_answers(WIRE, step, EXPECTED_REPLIES))


@pytest.mark.parametrize("step", [1, 3, 4096])
def test_runs_of_ok_parse_as_any_simple_string_does(step: int) -> None:
    """SET's answers take a shortcut (`RespSocket._receive`); one cut short, or another
    simple string that starts the same, does not."""
    replies = _answers(b"+OK\r\n" * 3 + b"+OKAY\r\n+OK\r\n:1\r\n", step, 6)
    assert replies == [b"OK", b"OK", b"OK", b"OKAY", b"OK", 1]


def test_big_values_arrive_in_writable_arrays_of_their_own() -> None:
    xread, *_ = _answers(WIRE, 1000, EXPECTED_REPLIES)
    value = xread[0][1][0][1][3]
    assert isinstance(value, memoryview) and not value.readonly and value.nbytes == len(BIG)
    array = np.frombuffer(value, dtype=np.uint8)
    array[0] ^= 1  # the caller may change it: nobody else holds it
    assert array.flags.writeable


def test_garbage_from_the_server_fails_the_call_and_closes_the_connection() -> None:
    sock, theirs, server = _served(b"?what\r\n", 100)
    try:
        with pytest.raises(RedisConnectionError, match="unreadable"):
            sock.execute([("PING",)])
    finally:
        server.join()
        theirs.close()
    assert not sock.connected


def test_a_connection_closed_mid_reply_fails_the_call() -> None:
    sock, theirs, server = _served(b"$%d\r\n%b" % (len(BIG), BIG[:1000]), 100, hang_up=True)
    try:
        with pytest.raises(RedisConnectionError, match="closed"):
            sock.execute([("GET", "k")])
    finally:
        server.join()
        theirs.close()
    assert not sock.connected


def test_vectors_go_out_as_pieces_of_their_own_and_come_back_bit_for_bit(redis_url: str) -> None:
    vector = np.random.default_rng(1).standard_normal(49_152).astype(np.float32)
    pieces = pack_commands([("SET", "v", vector.data.cast("B")), ("GET", "v")])
    assert any(isinstance(p, memoryview) and p.obj is vector for p in pieces)  # not copied
    sock = RespSocket.from_url(redis_url)
    try:
        stored, got = sock.execute([("SET", "v", vector.data.cast("B")), ("GET", "v")])
        many = sock.execute([("XADD", "s", "*", "d", vector.data.cast("B"))] * 300)
    finally:
        sock.close()
    assert stored == b"OK" and np.array_equal(np.frombuffer(got, np.float32), vector)
    assert len(many) == 300 and all(isinstance(entry_id, bytes) for entry_id in many)
    assert redis.Redis.from_url(redis_url).xlen("s") == 300


def test_a_database_number_and_a_user_are_honoured(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("rs-alice", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
    base = redis_url[: redis_url.rindex("/")].replace("redis://", "redis://rs-alice:pw@")
    sock = RespSocket.from_url(base + "/3")
    try:
        assert sock.execute([("SET", "k", b"x"), ("ACL", "WHOAMI")]) == [b"OK", b"rs-alice"]
        assert redis.Redis.from_url(redis_url[: redis_url.rindex("/")] + "/3").get("k") == b"x"
        wrong = RespSocket.from_url(base.replace("rs-alice:pw", "rs-alice:nope") + "/3")
        with pytest.raises(AuthenticationError):
            wrong.execute([("PING",)])
    finally:
        sock.close()
        admin.acl_deluser("rs-alice")


def test_a_silent_server_times_out_and_the_next_call_reconnects(redis_url: str) -> None:
    sock = RespSocket.from_url(redis_url, timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            sock.execute([("BLPOP", "nothing", 5)])
        assert time.monotonic() - started < 2 and not sock.connected
        assert sock.execute([("PING",)]) == [b"PONG"]
    finally:
        sock.close()


def test_an_interrupt_cuts_a_blocked_call_short(redis_url: str) -> None:
    sock = RespSocket.from_url(redis_url)
    failed: list[BaseException] = []

    def blocked() -> None:
        try:
            sock.execute([("BLPOP", "nothing", 10)])
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    sock.interrupt()
    thread.join(5)
    assert not thread.is_alive() and isinstance(failed[0], RedisConnectionError)


def test_a_refused_connection_raises_redis_connection_error() -> None:
    with pytest.raises(RedisConnectionError):
        RespSocket.from_url("redis://127.0.0.1:1/0", connect_timeout_s=1).execute([("PING",)])


async def test_only_plain_connections_have_a_target(redis_url: str) -> None:
    client = async_redis(redis_url)
    try:
        target: Any = target_of(client)
        assert target["port"] == int(redis_url.rsplit(":", 1)[1].split("/")[0])
    finally:
        await client.aclose()
    tls = async_redis("rediss://127.0.0.1:1/0")
    try:
        assert target_of(tls) is None and target_of_url("rediss://127.0.0.1:1/0") is None
    finally:
        await tls.aclose()
    assert target_of(object()) is None
    assert target_of_url("unix:///tmp/r.sock?db=2") == {"path": "/tmp/r.sock", "db": 2}


class _Keeper:
    """A `BulkIntake` that keeps a copy of each bulk it takes, tagged."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._buffer = bytearray(length)
        self.scratch = memoryview(self._buffer)

    def __call__(self) -> tuple[str, bytes]:
        return ("taken", bytes(self._buffer))


@pytest.mark.parametrize("length", [100, 40_000])
def test_bulks_of_the_intake_s_length_arrive_as_what_it_makes_of_them(
    redis_url: str, length: int
) -> None:
    """Each bulk of the intake's length, small or big, is the intake's value (one scratch,
    reused, yet each its own); other lengths, missing keys and a later call are as without."""
    rng = np.random.default_rng(7)
    first, second = (rng.integers(0, 256, length, dtype=np.uint8).tobytes() for _ in range(2))
    longer, short = b"L" * (length + 1) * 2, b"short"
    admin = redis.Redis.from_url(redis_url)
    admin.mset({"a": first, "b": longer, "c": second, "d": short})
    sock = RespSocket.from_url(redis_url)
    try:
        (values,) = sock.execute([("MGET", "a", "b", "nothing", "c", "d")], _Keeper(length))
        (plain,) = sock.execute([("MGET", "a", "b")])
    finally:
        sock.close()
    assert values[0] == ("taken", first) and values[3] == ("taken", second)
    assert bytes(values[1]) == longer and values[2] is None and values[4] == short
    assert bytes(plain[0]) == first and not isinstance(plain[0], tuple)
