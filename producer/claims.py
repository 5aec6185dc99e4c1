"""`ClaimResolver`: fetches the vectors that claim-check replies point at.

A worker that writes a result to the shared cache answers a client that asked for it
(``Request.claims``) with the cache key instead of the vector, so the vector crosses the
network once each way. The reply reader hands every claim-check of one read batch to
`fetch`: one MGET on the cache instance (which may be a separate Redis) returns them all.

A claimed key can be gone (evicted between the worker's SET and this GET, the cache flushed
or unreachable); the reader then asks again for those requests with an inline reply, within
their original deadlines. If most claims miss (a cache too small for the traffic, or a client
pointed at another cache than the workers'), claim-checks only cost a round trip: the resolver
pauses them for a while and requests travel inline meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from lmqueue.shared.connections import bounded, multi_get
from lmqueue.shared.wire import Reply, holds_vector

from .node_pipes import NodePipes
from .resp_pipe import RespPipe
from .tensors import WideHalf

__all__ = ["ClaimResolver"]

logger = logging.getLogger(__name__)

#: Claims judged together, and the share of misses past which claim-checks pause.
_WINDOW = 64
_MAX_MISS_SHARE = 0.5
_PAUSE_S = 30.0


class ClaimResolver:
    """Resolves claim-check replies against the shared cache, one MGET per batch."""

    def __init__(
        self,
        cache_redis: Any,
        timeout_s: float = 10.0,
        pipe: RespPipe | None = None,
        vector_size: int = 0,
        nodes: NodePipes | None = None,
    ) -> None:
        self.redis = cache_redis
        #: A claimed value must hold exactly this many values of its dtype (0: whole values).
        self.vector_size = vector_size
        self.pipe = pipe  # where it can connect: vectors land in arrays of their own
        self.nodes = nodes  # the same, on a cluster's masters
        self.timeout_s = timeout_s
        self.resolved = 0
        self.missed = 0
        self._window = [0, 0]  # hits, misses
        self._paused_until = 0.0

    def disable(self) -> None:
        """Ask for no claim-checks from now on (this client cannot reach the cache)."""
        self._paused_until = float("inf")

    @property
    def enabled(self) -> bool:
        """Whether new requests should ask for claim-checks."""
        return not self._paused_until or time.monotonic() >= self._paused_until

    async def fetch(self, claims: Sequence[Reply]) -> tuple[list[Reply], list[Reply]]:
        """The claims whose vectors were found, as ordinary replies, and those that missed.

        Never raises for the cache's sake: an unreachable or silent cache misses every claim.
        """
        keys = [reply.claim for reply in claims]
        try:
            values = await bounded(self._mget(keys), self.timeout_s, "claim-check read")
        except Exception as exc:  # the inline path does not need the cache
            logger.warning("reading %d claimed results failed: %s", len(keys), exc)
            values = [None] * len(keys)
        found, missed = self.match(claims, values)
        self.record(len(found), len(missed))
        return found, missed

    def match(
        self, claims: Sequence[Reply], values: Sequence[Any]
    ) -> tuple[list[Reply], list[Reply]]:
        """Pair claims with the values read for them: replies carrying the vectors found, and
        the claims that missed (any thread may call it; `record` the counts on the loop)."""
        found, missed = [], []
        for reply, value in zip(claims, values, strict=True):
            if type(value) is WideHalf:  # a float16 vector widened as it arrived
                if reply.dtype == "float16" and holds_vector(
                    value.payload, "float32", self.vector_size
                ):
                    found.append(
                        Reply(reply.request_id, value.payload, "float32", cached=reply.cached)
                    )
                else:
                    missed.append(reply)
            elif holds_vector(value, reply.dtype, self.vector_size):
                found.append(Reply(reply.request_id, value, reply.dtype, cached=reply.cached))
            else:
                missed.append(reply)
        return found, missed

    async def _mget(self, keys: list[Any]) -> list[Any]:
        if self.pipe is None:
            if self.nodes is not None and (values := await self.nodes.get(keys)) is not None:
                return values
            return list(await multi_get(self.redis)(keys))  # split per node on a cluster
        (values,) = await self.pipe.execute(("MGET", *keys))
        if isinstance(values, Exception):
            raise values
        return list(values)

    def record(self, hits: int, misses: int) -> None:
        """Count resolved and missed claims; pause claim-checks if most of them miss."""
        self.resolved += hits
        self.missed += misses
        self._window[0] += hits
        self._window[1] += misses
        total = sum(self._window)
        if total < _WINDOW:
            return
        share = self._window[1] / total
        self._window = [0, 0]
        if share > _MAX_MISS_SHARE:
            logger.warning(
                "%.0f%% of claimed results were missing from the shared cache (too small, or "
                "not the workers' cache?); asking for inline replies for %.0f s",
                100 * share, _PAUSE_S,
            )  # fmt: skip
            self._paused_until = time.monotonic() + _PAUSE_S
