"""`StreamSlots`: a cluster client that finds the slot of a stream read itself.

To route a command, redis-py's asyncio `RedisCluster` needs its keys. For commands whose keys
move with their options (``movablekeys``: XREAD, XREADGROUP), it asks a node with ``COMMAND
GETKEYS`` every time: one more round trip, and one more command for the node to run, for every
read. A worker reads its partitions with XREADGROUP and a client its reply stream with XREAD,
so each paid it for every read (on a 3-master cluster, a worker's reads of its three
partitions cost ~35 CPU us a request on this project's 2-core machine, against ~14 on one
instance; `COMMAND GETKEYS` and its parsing were a third of them).

Here the keys of XREAD and XREADGROUP are read off the arguments, as Redis reads them:
options (``GROUP`` with two arguments, ``COUNT`` and ``BLOCK`` with one, ``NOACK``) up to
``STREAMS``, then the keys, then as many ids. Anything else, or arguments that do not parse,
go to redis-py's own way. All keys of one command must share a slot, as redis-py requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio.cluster as aiocluster
from redis.exceptions import RedisClusterException

__all__ = ["StreamSlots", "stream_read_keys"]

#: The options of XREAD and XREADGROUP before ``STREAMS``, and how many arguments each takes.
_OPTIONS = {"GROUP": 2, "COUNT": 1, "BLOCK": 1, "NOACK": 0}
_READS = {"XREAD", "XREADGROUP"}


def stream_read_keys(command: Any, args: Sequence[Any]) -> list[Any] | None:
    """The stream keys of an XREAD or XREADGROUP with these arguments (after the command's
    name); None for another command or arguments that do not parse."""
    if _text(command).upper() not in _READS:
        return None
    at = 0
    while at < len(args):
        token = _text(args[at]).upper()
        if token == "STREAMS":
            rest = args[at + 1 :]
            if not rest or len(rest) % 2:
                return None
            return list(rest[: len(rest) // 2])
        taken = _OPTIONS.get(token)
        if taken is None:
            return None
        at += 1 + taken
    return None


class StreamSlots(aiocluster.RedisCluster):
    """A `redis.asyncio.RedisCluster` that routes stream reads without asking a node for
    their keys (see the module docstring)."""

    async def _determine_slot(self, command: Any, *args: Any) -> int:
        keys = stream_read_keys(command, args)
        if keys is None:
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(key) for key in keys}
        if len(slots) != 1:
            raise RedisClusterException(f"{command} - all keys must map to the same key slot")
        return int(slots.pop())


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
