"""The private parts of redis-py that `shared.connections._VectoredConnection` stands on.

The vectored connection overrides three methods of redis-py's asyncio `Connection` and reads a
few private attributes. Each one is pinned here against the installed redis-py, so an upgrade
that renames or reshapes them fails this file by name instead of silently falling back or
breaking every large write.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import resource
import time
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from lmqueue.shared.connections import _VectoredConnection, connect_async_redis


def test_the_overridden_methods_keep_their_names_and_signatures() -> None:
    base = aioredis.Connection
    assert inspect.iscoroutinefunction(base._connect)
    assert list(inspect.signature(base._connect).parameters) == ["self"]
    send = inspect.signature(base.send_packed_command)
    assert list(send.parameters) == ["self", "command", "check_health"]
    assert send.parameters["check_health"].default is True
    assert inspect.iscoroutinefunction(base.check_health)
    assert "nowait" in inspect.signature(base.disconnect).parameters
    assert isinstance(base.is_connected, property)
    assert list(inspect.signature(base.pack_command).parameters) == ["self", "args"]
    assert {"encoding", "encoding_errors"} <= set(aioredis.connection.Encoder.__slots__)
    assert inspect.iscoroutinefunction(base.can_read_destructive)
    assert list(inspect.signature(base.can_read_destructive).parameters) == ["self"]
    loop = asyncio.new_event_loop()
    try:  # what the fast check of can_read_destructive reads
        stream = asyncio.StreamReader(loop=loop)
        assert stream._buffer == b"" and not stream.at_eof() and stream.exception() is None
    finally:
        loop.close()
    import hiredis

    assert hasattr(hiredis.Reader(), "has_data")


@given(
    st.lists(
        st.one_of(
            st.text(max_size=40),
            st.binary(max_size=40),
            st.integers(),
            st.floats(allow_nan=False),
            st.binary(min_size=16_384, max_size=16_500),  # a piece of its own
            st.binary(max_size=20).map(memoryview),
        ),
        max_size=40,
    ),
    st.sampled_from(["MGET", "XREADGROUP", "SET", "CONFIG GET", "XACK"]),
)
def test_commands_are_packed_into_the_bytes_redis_py_packs(args: list[Any], name: str) -> None:
    """The project's packing (strings and bytes, strict UTF-8) and every command it hands to
    redis-py put the same bytes on the wire as redis-py's own packer."""
    ours, theirs = _VectoredConnection(), aioredis.Connection()
    for encoding, errors in (("utf-8", "strict"), ("latin-1", "replace")):
        ours.encoder.encoding = theirs.encoder.encoding = encoding
        ours.encoder.encoding_errors = theirs.encoder.encoding_errors = errors
        packed = b"".join(map(bytes, ours.pack_command(name, *args)))
        assert packed == b"".join(map(bytes, theirs.pack_command(name, *args)))


def test_the_cluster_client_still_takes_a_connection_class_in_its_node_kwargs() -> None:
    manager = inspect.signature(aioredis.cluster.NodesManager.__init__).parameters
    assert "connection_kwargs" in manager


async def test_a_connected_vectored_connection_exposes_the_writer_and_a_socket(
    redis_url: str,
) -> None:
    client = await connect_async_redis(redis_url)
    try:
        assert client.connection_pool.connection_class is _VectoredConnection
        connection = await client.connection_pool.get_connection()
        try:
            writer = connection._writer
            assert isinstance(writer, asyncio.StreamWriter)
            assert writer.transport.max_size == 64 * 1024  # set by the override
            assert writer.transport.get_write_buffer_limits() == (0, 64 * 1024)
        finally:
            await client.connection_pool.release(connection)
        # a multi-piece command (a vector beside its key) goes out by sendmsg and arrives whole
        vector = np.arange(200_000, dtype=np.float32)
        await client.set("surface:vector", memoryview(vector.tobytes()))
        assert np.array_equal(
            np.frombuffer(await client.get("surface:vector"), dtype=np.float32), vector
        )
    finally:
        await client.aclose()


def test_redis_py_is_the_major_version_the_overrides_were_written_for() -> None:
    assert redis.__version__.split(".")[0] == "5"


async def _pooled_connection_id(client: aioredis.Redis) -> tuple[Any, int]:
    """A connection the pool hands out, and its client id on the server."""
    connection = await client.connection_pool.get_connection()
    await connection.send_command("CLIENT", "ID")
    return connection, int(await connection.read_response())


async def test_an_idle_pooled_connection_is_handed_out_without_a_read(redis_url: str) -> None:
    client = await connect_async_redis(redis_url)
    try:
        connection, _ = await _pooled_connection_id(client)
        reads = 0
        parser_read = connection._parser.read_from_socket

        async def counted() -> Any:
            nonlocal reads
            reads += 1
            return await parser_read()

        connection._parser.read_from_socket = counted
        assert await connection.can_read_destructive() is False
        assert reads == 0  # redis-py's check would have tried one under a zero timeout
        await client.connection_pool.release(connection)
        assert await client.ping() is True
    finally:
        await client.aclose()


async def test_a_pooled_connection_the_server_closed_is_replaced_before_a_command(
    redis_url: str,
) -> None:
    """Whether the loop saw the EOF already or it still waits in the kernel, the pool's
    check finds it and reconnects: the command after it answers on a new connection."""
    client = await connect_async_redis(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        for loop_saw_it in (True, False):
            connection, old_id = await _pooled_connection_id(client)
            await client.connection_pool.release(connection)
            admin.client_kill_filter(_id=old_id)
            if loop_saw_it:
                await asyncio.sleep(0.05)  # the loop delivers the EOF to the stream
            else:
                time.sleep(0.05)  # the FIN arrives; the loop does not run meanwhile
            assert connection.is_connected  # the pool's check is what finds the EOF
            reused, new_id = await _pooled_connection_id(client)
            assert reused is connection and new_id != old_id  # reconnected, not failed
            await client.connection_pool.release(reused)
            assert await client.ping() is True
    finally:
        admin.close()
        await client.aclose()


@pytest.mark.parametrize("loop_saw_it", [True, False])
async def test_a_pooled_connection_holding_an_unread_reply_is_replaced(
    redis_url: str, loop_saw_it: bool
) -> None:
    client = await connect_async_redis(redis_url)
    try:
        connection, old_id = await _pooled_connection_id(client)
        await connection.send_command("ECHO", "stale")  # its reply is never read
        if loop_saw_it:
            await asyncio.sleep(0.05)  # in the stream's buffer
        else:
            time.sleep(0.05)  # in the socket's
        await client.connection_pool.release(connection)
        assert await client.echo("fresh") == b"fresh"
        _, new_id = await _pooled_connection_id(client)
        assert new_id != old_id
    finally:
        await client.aclose()


async def test_the_pools_check_works_on_a_descriptor_past_1023(redis_url: str) -> None:
    """A busy process's sockets get high descriptors; ``select`` refuses those past 1023."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.skip(f"this process may open {hard} files, fewer than the test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    fillers = []
    try:
        while len(fillers) < 1030 and (not fillers or fillers[-1] < 1024):
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        client = await connect_async_redis(redis_url)
        try:
            connection, _ = await _pooled_connection_id(client)
            assert connection._writer.get_extra_info("socket").fileno() >= 1024
            assert await connection.can_read_destructive() is False
            await client.connection_pool.release(connection)
            assert await client.ping() is True
        finally:
            await client.aclose()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
