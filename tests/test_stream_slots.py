"""`shared.stream_slots`: the keys of a stream read, read off its arguments as Redis reads them."""

from __future__ import annotations

import inspect

import pytest
import redis.asyncio.cluster as aiocluster

from lmqueue.shared.stream_slots import stream_read_keys


@pytest.mark.parametrize(
    ("command", "args", "keys"),
    [
        ("XREADGROUP", ("GROUP", "g", "c", "COUNT", 5, "STREAMS", "a", "b", ">", ">"), ["a", "b"]),
        ("xreadgroup", ("group", "g", "c", "noack", "block", 0, "streams", "a", ">"), ["a"]),
        # a group and a consumer named like options are arguments, not options
        (b"XREADGROUP", (b"GROUP", b"STREAMS", b"COUNT", b"STREAMS", b"s", b">"), [b"s"]),
        (
            "XREAD",
            ("COUNT", 1, "BLOCK", 10, "STREAMS", "a", "b", "c", "0", "0", "$"),
            ["a", "b", "c"],
        ),
        ("XREAD", ("STREAMS", "x", "0"), ["x"]),
        # not a stream read, or arguments that do not parse: redis-py's own way
        ("GET", ("k",), None),
        ("XREAD", ("STREAMS", "a", "b", "0"), None),
        ("XREAD", ("STREAMS",), None),
        ("XREAD", ("COUNT", 1), None),
        ("XREAD", ("FOO", "STREAMS", "a", "0"), None),
    ],
)
def test_the_keys_of_a_stream_read_are_read_off_its_arguments(command, args, keys) -> None:
    assert stream_read_keys(command, args) == keys


def test_redis_py_still_routes_by_the_method_stream_slots_overrides() -> None:
    method = aiocluster.RedisCluster._determine_slot
    assert inspect.iscoroutinefunction(method)
    assert list(inspect.signature(method).parameters) == ["self", "command", "args"]
