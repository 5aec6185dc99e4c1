"""`SlotPipe`: a `RespPipe` that follows one key's hash slot around a Redis Cluster.

A client's reply stream lives on the master that serves its slot. The in-place receiver
(`RespPipe`) speaks to one node, so on a cluster it is aimed at that master, taken from the
redis-py cluster client's slot map, and re-aimed when the node answers ``MOVED`` (the slot
moved: resharding, or a failover the map already knows). An ``ASK`` (the slot is migrating and
the key already left) is answered on a one-off connection to the importing node, each command
after ``ASKING``. A lost connection re-aims from the map on the next call; the cluster client
refreshes its map itself when a node fails (the reader's identity check goes through it).
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError, TryAgainError

from .resp_pipe import RespPipe

__all__ = ["SlotPipe", "redirect_of"]


class SlotPipe:
    """Pipelines of commands on the single key `key`, sent to the node that serves its slot."""

    def __init__(self, cluster: Any, key: str, url: str, connect_timeout_s: float = 5.0) -> None:
        self.cluster = cluster
        self.key = key
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.pipe = RespPipe(url, connect_timeout_s)
        self.redirects = 0
        self._aimed = False

    async def execute(self, *commands: tuple[Any, ...]) -> list[Any]:
        """As `RespPipe.execute`, on the node serving `key`, redirections followed.

        Raises:
            redis.exceptions.TryAgainError: if the node redirects twice in a row (the slot map
                is changing under us); callers retry as when Redis is down.
        """
        if not self._aimed:
            node = self.cluster.get_node_from_key(self.key)
            self.pipe.retarget(node.host, int(node.port))
            self._aimed = True
        try:
            results = await self.pipe.execute(*commands)
            redirect = redirect_of(results)
            if redirect is None:
                return results
            self.redirects += 1
            kind, host, port = redirect
            if kind == "ASK":
                return await self._asking(host, port, commands)
            self.pipe.retarget(host, port)
            results = await self.pipe.execute(*commands)
        except BaseException:
            self._aimed = False
            raise
        if redirect_of(results) is not None:
            self._aimed = False
            raise TryAgainError(f"{self.key}: redirected twice; the slot map is changing")
        return results

    async def _asking(
        self, host: str, port: int, commands: tuple[tuple[Any, ...], ...]
    ) -> list[Any]:
        once = RespPipe(self.url, self.connect_timeout_s)
        once.retarget(host, port)
        try:
            results = await once.execute(*(part for c in commands for part in (("ASKING",), c)))
        finally:
            once.close()
        return results[1::2]

    def close(self) -> None:
        """Drop the connection (idempotent)."""
        self.pipe.close()


def redirect_of(results: list[Any]) -> tuple[str, str, int] | None:
    """``(kind, host, port)`` of the first MOVED or ASK error among `results`, else None."""
    for result in results:
        if isinstance(result, ResponseError):
            text = str(result)
            if text.startswith(("MOVED ", "ASK ")):
                kind, _slot, address = text.split()[:3]
                host, port = address.rsplit(":", 1)
                return kind, host, int(port)
    return None
