"""`RecoveringCluster`: redis-py's asyncio cluster client, able to find the cluster again.

redis-py 5.x's asyncio `RedisCluster` re-reads the slot map (``NodesManager.initialize``,
``CLUSTER SLOTS``) from the nodes in ``nodes_manager.startup_nodes``. When a command's node
fails to connect, ``_execute_command`` pops that node from the list and calls ``aclose()``,
which disconnects every node's connections, including those other tasks are using right
then; their commands fail with connection errors in turn and pop *their* nodes, although those
are alive. With a few dozen concurrent commands (a client's sends, its reply reads, a worker's
reads and writes) the cascade empties the list, and from then on every command fails with
``RedisClusterException: Redis Cluster cannot be connected. Please provide at least one
reachable node: None``: only a successful re-read refills the list, and none can start
(reproduced by tests/test_cluster_recovery.py).

`RecoveringCluster` remembers the address of every node it has ever seen (the URL's first)
and, when the library says it cannot reach any node, puts them all back into the startup list
and re-reads the slot map from them: a rebuild. A rebuild that fails is raised as
`ClusterUnreachable`, a ``ConnectionError``, so every caller's existing "Redis is down" retry
loop (`shared.redis_errors.REDIS_DOWN`) backs off and tries again within its own deadline;
while a rebuild runs, attempts are also spaced here (`Backoff`, 50 ms doubling to 1 s): a task
calling meanwhile fails at once, so a hundred waiting tasks do not dial every dead address a
hundred times. ``rebuilds`` and ``rebuilding`` say what happened, for
``/metrics``, ``/readyz``, `QueueLM.stats` and ``lmq status``.

The override sits on ``RedisCluster.initialize``, the one method through which both commands
and pipelines (re)initialize; it relies on ``nodes_manager.startup_nodes`` (a dict of
``ClusterNode`` by ``host:port``) and ``nodes_cache``, pinned by tests/test_cluster_recovery.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio.cluster as aiocluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from .backoff import Backoff
from .stream_slots import StreamSlots

__all__ = ["ClusterUnreachable", "RecoveringCluster", "cluster_rebuilds"]

logger = logging.getLogger(__name__)

#: How the library says that no startup node answered (``NodesManager.initialize``).
_UNREACHABLE = "Redis Cluster cannot be connected"
#: ``NodesManager.initialize`` iterates ``startup_nodes`` while other tasks pop from it.
_LIST_CHANGED = "changed size during iteration"
#: Addresses remembered at most (a long-lived process on a churning fleet sees many).
_MAX_ADDRESSES = 256


class ClusterUnreachable(RedisConnectionError):
    """Raised when the slot map could not be read, from any node the client ever knew."""


class RecoveringCluster(StreamSlots):
    """A `redis.asyncio.RedisCluster` that rebuilds its node list from every node it saw (and
    routes stream reads without asking a node for their keys: `StreamSlots`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: ``host:port`` -> (host, port), the URL's and every node of a slot map read since,
        #: least recently seen first.
        self.addresses: dict[str, tuple[str, int]] = {}
        #: Rebuilds started (each time the library lost every node, once until it recovers).
        self.rebuilds = 0
        #: True from the moment the library lost every node until a slot map is read again.
        self.rebuilding = False
        self._backoff = Backoff(first_s=0.05, max_s=1.0)
        self._retry_at = 0.0
        self._remember(self.nodes_manager.startup_nodes)

    async def initialize(self) -> RecoveringCluster:
        """Read the slot map if needed; rebuild the node list when the library lost it.

        Raises:
            ClusterUnreachable: if no remembered node answered, or the slot map read was not
                usable (a ``ConnectionError``: callers retry later).
        """
        if self.rebuilding and self._initialize:  # space the attempts of every waiting task
            wait_s = self._retry_at - time.monotonic()
            if wait_s > 0:
                raise ClusterUnreachable(f"rebuilding the cluster client: next in {wait_s:.2f} s")
        try:
            await super().initialize()
        except RedisClusterException as exc:
            if not str(exc).startswith(_UNREACHABLE):  # e.g. nodes disagree mid-failover
                raise ClusterUnreachable(f"reading the cluster's slot map failed: {exc}") from exc
            await self._rebuild(exc)
        except RuntimeError as exc:  # another task popped a node mid-read: try again later
            if _LIST_CHANGED not in str(exc):
                raise
            raise RedisConnectionError(f"the cluster's node list changed: {exc}") from exc
        self._recovered()
        return self

    async def _rebuild(self, cause: BaseException) -> None:
        """Put every remembered node back in the startup list and read the slot map again."""
        if not self.rebuilding:
            self.rebuilding = True
            self.rebuilds += 1
            logger.warning(
                "the cluster client lost every node (%s); rebuilding it from %d known addresses",
                cause, len(self.addresses),
            )  # fmt: skip
        assert self._lock is not None  # made by the library's initialize
        async with self._lock:  # the library iterates the startup list under this lock
            if not self._initialize:
                return  # another task rebuilt it meanwhile
            added = self._reseed()
        if added:  # else the library has just tried every known node
            try:
                await super().initialize()
                return
            except (RedisClusterException, RuntimeError, RedisConnectionError) as exc:
                cause = exc
        self._retry_at = time.monotonic() + self._backoff.delay_s()
        raise ClusterUnreachable(f"no known cluster node answered: {cause}") from cause

    def _reseed(self) -> int:
        """Add each remembered address missing from the library's startup list; how many."""
        manager = self.nodes_manager
        missing = [item for item in self.addresses.items() if item[0] not in manager.startup_nodes]
        for name, (host, port) in missing:
            manager.startup_nodes[name] = aiocluster.ClusterNode(
                host, port, **manager.connection_kwargs
            )
        return len(missing)

    def _recovered(self) -> None:
        """A slot map was read: remember its nodes; end a rebuild."""
        self._remember(self.nodes_manager.nodes_cache)
        if self.rebuilding:
            self.rebuilding = False
            logger.warning("the cluster client is rebuilt (%d nodes)", len(self.get_nodes()))
        self._backoff.reset()
        self._retry_at = 0.0

    def _remember(self, nodes: dict[str, Any]) -> None:
        for name, node in list(nodes.items()):
            self.addresses.pop(name, None)  # most recently seen last
            self.addresses[name] = (node.host, int(node.port))
        while len(self.addresses) > _MAX_ADDRESSES:
            del self.addresses[next(iter(self.addresses))]


def cluster_rebuilds(*clients: Any) -> tuple[int, bool]:
    """``(rebuilds so far, whether one runs now)`` over the distinct `RecoveringCluster`s among
    `clients` (a process's queue and cache roles may share one); ``(0, False)`` for others."""
    distinct = {id(c): c for c in clients if isinstance(c, RecoveringCluster)}.values()
    return sum(c.rebuilds for c in distinct), any(c.rebuilding for c in distinct)
