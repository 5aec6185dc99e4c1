"""RESP2 encoding of commands: the one packer of the project's own connections.

`RespSocket` (the writer and reply threads) sends what it packs as iovecs, and the asyncio
connection of `shared.connections` packs a command of small strings and bytes with it instead
of redis-py's packer, which encodes each argument in a call of its own and joins the buffer
again for each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["BIG_BULK_BYTES", "pack_commands"]

#: Arguments and bulk replies from this size on travel as buffers of their own: sent as
#: their own iovec, received into an array of their own.
BIG_BULK_BYTES = 16 * 1024


def pack_commands(commands: Iterable[Sequence[Any]]) -> list[bytes | memoryview]:
    """RESP2 encoding of a pipeline: small parts joined, each big argument a piece of its own.

    Arguments are bytes, str, int or float, or contiguous byte memoryviews (vectors).
    """
    pieces: list[bytes | memoryview] = []
    small: list[bytes] = []
    for command in commands:
        small.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, bytes):
                raw: bytes | memoryview = arg
            elif isinstance(arg, str):
                raw = arg.encode()
            elif isinstance(arg, memoryview | bytearray):
                raw = memoryview(arg).cast("B")
            else:
                raw = str(arg).encode()
            size = len(raw)
            if size < BIG_BULK_BYTES:
                small.append(b"$%d\r\n%b\r\n" % (size, raw))  # type: ignore[str-format]
                continue
            small.append(b"$%d\r\n" % size)
            pieces.append(b"".join(small))
            pieces.append(raw)
            small = [b"\r\n"]
    if small:
        pieces.append(b"".join(small))
    return pieces
