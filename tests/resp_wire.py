"""A pipeline's replies as Redis sends them, for the tests of both RESP readers."""

from __future__ import annotations

from typing import Any

import numpy as np
from redis.exceptions import BusyLoadingError, ResponseError

from lmqueue.shared.redis_errors import REDIS_DOWN
from lmqueue.shared.resp_socket import BIG_BULK_BYTES

BIG = np.random.default_rng(0).bytes(3 * BIG_BULK_BYTES + 5)

#: An XREAD-shaped reply, then an integer, a nil, an error, a simple string, an empty array.
WIRE = (
    b"*1\r\n*2\r\n$1\r\ns\r\n*2\r\n"
    + b"*2\r\n$3\r\n1-0\r\n*4\r\n$1\r\nh\r\n$3\r\nabc\r\n$1\r\nd\r\n$%d\r\n%b\r\n" % (len(BIG), BIG)
    + b"*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nh\r\n$0\r\n\r\n"
    + b":42\r\n$-1\r\n-ERR no such thing\r\n+OK\r\n*0\r\n*-1\r\n"
    + b"-LOADING Redis is loading the dataset in memory\r\n"
)
EXPECTED_REPLIES = 8


def assert_wire_replies(replies: list[Any]) -> None:
    """`replies` are `WIRE`'s eight, parsed: what either RESP reader must make of it (a
    server still loading its data is down for now, as redis-py says: `REDIS_DOWN`)."""
    xread, number, nil, error, ok, empty, nil_array, loading = replies
    [[stream, entries]] = xread
    assert stream == b"s" and [entry[0] for entry in entries] == [b"1-0", b"1-1"]
    fields = entries[0][1]
    assert fields[:3] == [b"h", b"abc", b"d"] and bytes(fields[3]) == BIG
    assert entries[1][1] == [b"h", b""]
    assert (number, nil, ok, empty, nil_array) == (42, None, b"OK", [], None)
    assert isinstance(error, ResponseError) and str(error) == "ERR no such thing"
    assert isinstance(loading, BusyLoadingError) and isinstance(loading, REDIS_DOWN)
