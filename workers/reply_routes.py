"""`Routes`: which connection each key a batch writes goes to, for the writer thread.

On a single instance every key goes to it; on a Redis Cluster each key goes to the master
serving its hash slot, looked up on the event loop in a snapshot of redis-py's slot map (the
map is that client's, kept current by it; `shared.cluster_targets.SlotTargets`), so the writer
thread gets plain addresses. Keys of one node share one `Target` object: the thread groups a
batch's commands by it, one pipeline per node. A slot that moved shows as a ``MOVED``/``ASK``
reply there, and the batch is written again through redis-py, which follows it and refreshes
its map; the snapshot is taken again for the next batch (`ReplyWriter`).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.connection import SSLConnection

from lmqueue.shared.cluster_targets import SlotTargets, node_target
from lmqueue.shared.connections import is_cluster
from lmqueue.shared.resp_socket import Target, target_of

__all__ = ["Routes"]


class Routes:
    """Keys to connections of one client's Redis (a single instance or a cluster)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.cluster = is_cluster(client)
        self._single = None if self.cluster else target_of(client)
        self._slots = SlotTargets(client) if self.cluster else None

    @staticmethod
    def supports(client: Any) -> bool:
        """Whether the writer thread can reach `client`'s Redis itself (plain TCP or Unix)."""
        if is_cluster(client):
            kind = client.nodes_manager.connection_kwargs.get("connection_class")
            return not (isinstance(kind, type) and issubclass(kind, SSLConnection))
        return target_of(client) is not None

    def of(self, key: str) -> Target:
        """The connection `key` is written on (call on the event loop): on a cluster, from a
        snapshot of redis-py's slot map (`SlotTargets`: ~0.5 CPU us a key, against ~2.4 for
        redis-py's own lookup), taken again after `stale`.

        Raises:
            redis.exceptions.SlotNotCoveredError: the slot has no master in the map.
        """
        if self._single is not None:
            return self._single
        assert self._slots is not None
        target = SlotTargets.of(self._slots.table(), key.encode())
        if target is None:  # no master in the snapshot: redis-py's map says, or raises
            node = self.client.get_node_from_key(key)
            self._slots.stale = True
            return node_target(self.client, node.host, int(node.port))
        return target

    def stale(self) -> None:
        """A node redirected a write: take the slot map again before the next batch."""
        if self._slots is not None:
            self._slots.stale = True
