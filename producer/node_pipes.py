"""`NodePipes`: GETs of keys spread over a Redis Cluster's masters, one `RespPipe` a master.

On one instance a client receives claimed vectors in place (`RespPipe`, or the reply thread's
socket); on a cluster the keys span masters, and through redis-py each 100-200 KB vector is
copied several times in Python (~75 CPU us a 98 KB value in a microbenchmark, against ~4.7 for
a missing one: BENCHMARKS.md, transport; the clients cost 205-272 us a reply on a cluster
against 113-157 on one instance). Here each master of the keys gets one pipeline of GETs on a
`RespPipe` aimed at it, the masters asked concurrently, and a vector lands in the array it is
handed out as, as on one instance.

The slot map is redis-py's (its cluster client keeps it current). A redirection (MOVED, ASK),
any other error answer, a slot nobody serves or a lost connection makes `get` answer None: the
caller then asks redis-py, which follows redirections, retries and refreshes the map. A pipe
that failed is dropped, so the next call connects afresh to whoever serves the slot then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lmqueue.shared.cluster_gets import by_master
from lmqueue.shared.redis_errors import REDIS_DOWN

from .resp_pipe import RespPipe

__all__ = ["NodePipes"]


class NodePipes:
    """One `RespPipe` per master of a cluster; one `get` at a time (the reply reader's)."""

    def __init__(self, cluster: Any, url: str, connect_timeout_s: float = 5.0) -> None:
        self.cluster = cluster
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        #: Keys answered here, and calls answered None (the caller went through redis-py).
        self.answered = 0
        self.refusals = 0
        self._pipes: dict[str, RespPipe] = {}

    async def get(self, keys: Sequence[Any]) -> list[Any] | None:
        """The values of `keys` in order (None: missing), or None if a master redirected,
        refused or could not be reached."""
        groups = by_master(self.cluster, keys)
        if groups is None:  # a slot no master serves now
            self.refusals += 1
            return None
        answers = await asyncio.gather(
            *(self._pipe(node).execute(*(("GET", raw) for raw in raws))
              for node, _, raws in groups.values()),
            return_exceptions=True,
        )  # fmt: skip
        values: list[Any] = [None] * len(keys)
        refused = False
        for (name, (_, indexes, _)), answer in zip(groups.items(), answers, strict=True):
            if isinstance(answer, REDIS_DOWN):
                self._pipes.pop(name).close()
                refused = True
            elif isinstance(answer, BaseException):
                raise answer  # cancelled, or a bug
            elif any(isinstance(value, Exception) for value in answer):
                refused = True
            else:
                for index, value in zip(indexes, answer, strict=True):
                    values[index] = value
        if refused:
            self.refusals += 1
            return None
        self.answered += len(keys)
        return values

    def _pipe(self, node: Any) -> RespPipe:
        pipe = self._pipes.get(node.name)
        if pipe is None:
            pipe = self._pipes[node.name] = RespPipe(self.url, self.connect_timeout_s)
            pipe.retarget(node.host, int(node.port))
        return pipe

    def close(self) -> None:
        """Drop every connection (idempotent)."""
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()
