"""The private parts of redis-py that `shared.connections._VectoredConnection` stands on.

The vectored connection overrides three methods of redis-py's asyncio `Connection` and reads a
few private attributes. Each one is pinned here against the installed redis-py, so an upgrade
that renames or reshapes them fails this file by name instead of silently falling back or
breaking every large write.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import numpy as np
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
