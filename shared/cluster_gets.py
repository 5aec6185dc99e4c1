"""`ClusterGets`: what MGET answers, for keys spread over a Redis Cluster's slots.

A cluster refuses MGET across hash slots, and the shared cache's keys are spread over every
slot on purpose (their load shares the masters). redis-py's ``mget_nonatomic`` answers with one
MGET per slot through its cluster pipeline: a command object, a slot lookup for the command's
node and a response callback per key, ~8 CPU us a key on this project's 2-core machine, where a
worker's lookups, which nearly all miss, are one key per slot (``lmq bench transport --clients
2 --workers 1 --deployments cluster``: ~10% of the worker's event loop). Here each master gets
one pipeline of GETs, packed in one call and read straight off one of the node's own
connections, the masters asked concurrently; GET answers what MGET does for a string key and
nil for a missing one.

A redirection (MOVED, ASK: the slot map is stale), a slot nobody serves, any other error
answer, or a lost connection (a master failing over) sends the whole call through
``mget_nonatomic``, which follows redirections, retries, refreshes the map and raises what it
raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError

from .redis_errors import REDIS_DOWN

__all__ = ["ClusterGets", "by_master"]

#: Keys grouped by the master serving them: its node, their indexes and their bytes.
MasterGroups = dict[str, tuple[Any, list[int], list[bytes]]]


def by_master(cluster: Any, keys: Sequence[Any]) -> MasterGroups | None:
    """`keys` grouped by the master redis-py's slot map says serves each (by node name, in
    first-seen order); None if a slot has no master now."""
    groups: MasterGroups = {}
    node_of_slot = cluster.nodes_manager.get_node_from_slot
    try:
        for index, key in enumerate(keys):
            raw = key if isinstance(key, bytes) else str(key).encode()
            node = node_of_slot(key_slot(raw))
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (node, [], [])
            group[1].append(index)
            group[2].append(raw)
    except RedisClusterException:
        return None
    return groups


class ClusterGets:
    """The values of keys on an asyncio `RedisCluster`, in order (None: missing)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        #: Calls answered through ``mget_nonatomic`` (a redirection, an error, a lost connection).
        self.fallbacks = 0

    async def __call__(self, keys: Sequence[Any]) -> list[Any]:
        if not keys:
            return []
        groups = by_master(self.cluster, keys)
        if groups is None:  # a slot no master serves now
            return await self._fallback(keys)
        answers = await asyncio.gather(
            *(_gets(node, raws) for node, _, raws in groups.values()), return_exceptions=True
        )
        values: list[Any] = [None] * len(keys)
        for (_, indexes, _), answer in zip(groups.values(), answers, strict=True):
            if answer is None or isinstance(answer, REDIS_DOWN):  # refused, or failed over?
                return await self._fallback(keys)
            if isinstance(answer, BaseException):
                raise answer  # cancelled, or a bug
            for index, value in zip(indexes, answer, strict=True):
                values[index] = value
        return values

    async def _fallback(self, keys: Sequence[Any]) -> list[Any]:
        self.fallbacks += 1
        return list(await self.cluster.mget_nonatomic(keys))


async def _gets(node: Any, keys: list[bytes]) -> list[Any] | None:
    """GET every key on `node` in one pipeline; None if any answer was an error.

    The pipeline is packed here in one join (redis-py's packer, an encoder call and several
    joins an argument, was most of the CPU of a lookup that misses).

    The connection comes from the node's own pool and goes back to it as redis-py's
    ``ClusterNode.execute_command`` does; every answer is read first, so it goes back clean
    (a cancelled or failed read closes it, in redis-py's ``read_response``).
    """
    connection = node.acquire_connection()
    try:
        packed = b"".join([b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys])
        await connection.send_packed_command(packed, False)
        values: list[Any] = []
        refused = False
        for _ in keys:
            try:
                values.append(await connection.read_response())
            except ResponseError:
                refused = True
        return None if refused else values
    finally:
        node._free.append(connection)  # redis-py's own release (ClusterNode has no public one)
