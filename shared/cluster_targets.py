"""A Redis Cluster's masters as plain `Target`s, for a thread that speaks to them itself.

A thread with blocking connections (`RespSocket`) cannot use redis-py's asyncio cluster
client, whose slot map belongs to the event loop (redis-py updates it in place when a node
answers ``MOVED``). So the loop hands the thread plain addresses: `node_target` for one node,
and `SlotTargets`, a snapshot of the whole map (16,384 slots, one `Target` object per master, so
a thread can group keys by it), taken on the loop and taken again once marked stale or once
redis-py has replaced its map (after a failover or a lost node). A thread that meets a
redirection or a lost node marks it stale and leaves the keys concerned to the loop, whose
redis-py client follows redirections and refreshes its map.
"""

from __future__ import annotations

import contextlib
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import SlotNotCoveredError

from .resp_socket import Target

__all__ = ["SlotTargets", "node_target"]


def node_target(cluster: Any, host: str, port: int) -> Target:
    """The `Target` of one node of `cluster` (an asyncio `RedisCluster`), with its credentials."""
    target: Target = {"host": host, "port": int(port)}
    kwargs = cluster.nodes_manager.connection_kwargs
    target.update({k: kwargs[k] for k in ("username", "password") if kwargs.get(k)})
    return target


class SlotTargets:
    """Which master serves each hash slot, as `cluster`'s slot map said when last taken."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.stale = True
        #: Snapshots taken so far (the first included).
        self.taken = 0
        self._table: list[Target | None] = []
        self._source: Any = None  # the map the snapshot was taken of

    def table(self) -> list[Target | None]:
        """The snapshot, taken again first if it is stale or redis-py has taken a new map
        since (after a failover or a lost node: it replaces its map whole), on the event loop;
        a slot no master serves is None. A thread may keep reading a table it was handed."""
        if self.stale or self.cluster.nodes_manager.slots_cache is not self._source:
            self._table = self._take()
            self.stale = False
            self.taken += 1
        return self._table

    def _take(self) -> list[Target | None]:
        manager = self.cluster.nodes_manager
        # redis-py applies a MOVED it met to its map on its next lookup: one, first
        with contextlib.suppress(SlotNotCoveredError):
            manager.get_node_from_slot(0)
        table: list[Target | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        by_address: dict[tuple[str, int], Target] = {}
        self._source = manager.slots_cache
        for slot, nodes in list(self._source.items()):
            if not nodes:
                continue
            address = (nodes[0].host, int(nodes[0].port))
            target = by_address.get(address)
            if target is None:
                target = by_address[address] = node_target(self.cluster, *address)
            table[slot] = target
        return table

    @staticmethod
    def of(table: list[Target | None], key: bytes) -> Target | None:
        """The master `table` says serves `key` (any thread), or None."""
        return table[key_slot(key)]
