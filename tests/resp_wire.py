"""A pipeline's replies as Redis sends them, for the tests of both RESP readers."""

from __future__ import annotations

import numpy as np

from lmqueue.shared.resp_socket import BIG_BULK_BYTES

BIG = np.random.default_rng(0).bytes(3 * BIG_BULK_BYTES + 5)

#: An XREAD-shaped reply, then an integer, a nil, an error, a simple string, an empty array.
WIRE = (
    b"*1\r\n*2\r\n$1\r\ns\r\n*2\r\n"
    + b"*2\r\n$3\r\n1-0\r\n*4\r\n$1\r\nh\r\n$3\r\nabc\r\n$1\r\nd\r\n$%d\r\n%b\r\n" % (len(BIG), BIG)
    + b"*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nh\r\n$0\r\n\r\n"
    + b":42\r\n$-1\r\n-ERR no such thing\r\n+OK\r\n*0\r\n*-1\r\n"
)
EXPECTED_REPLIES = 7
