"""`WorkerStats`: the small hash each worker keeps in Redis so `lmq status` needs no Prometheus.

Written by the worker with every heartbeat under ``KeySpace.worker_stats(model, worker)``
(``lmq:model:<model>:worker:<worker>``) and set to expire a few heartbeats later, so a worker
that died leaves no stale figures behind. Values are plain strings (readable with
``redis-cli HGETALL``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .keys import KeySpace

__all__ = ["WorkerStats", "write_worker_stats", "read_worker_stats"]


@dataclass(frozen=True)
class WorkerStats:
    """What one worker serves and how busy it has been recently."""

    model: str
    backend: str = ""
    revision: str = ""
    #: Tenants whose request streams the worker reads.
    tenants: tuple[str, ...] = ()
    batch_size: int = 0
    started_ms: int = 0
    updated_ms: int = 0
    batches_total: int = 0
    requests_total: int = 0
    #: Over about the last minute.
    batches_per_s: float = 0.0
    requests_per_s: float = 0.0
    shared_cache_hits: int = 0
    shared_cache_misses: int = 0
    #: Rebuilds of the worker's Redis Cluster clients after they lost every node
    #: (`shared.cluster_client`), and the Unix time in ms of the last one seen (0: none).
    cluster_rebuilds: int = 0
    cluster_rebuilt_ms: int = 0

    def to_fields(self) -> dict[str, str]:
        """The hash fields."""
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = ",".join(value) if isinstance(value, tuple) else str(value)
        return fields

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> WorkerStats:
        """Parse a hash as read (bytes or str); unknown fields are ignored, missing ones default.

        Raises:
            ValueError: if a known field does not parse.
        """
        text = {_text(k): _text(v) for k, v in raw.items()}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in text:
                continue
            value = text[f.name]
            if f.name == "tenants":
                values[f.name] = tuple(t for t in value.split(",") if t)
            elif isinstance(f.default, int):
                values[f.name] = int(value)
            elif isinstance(f.default, float):
                values[f.name] = float(value)
            else:
                values[f.name] = value
        return cls(**values)


async def write_worker_stats(
    redis: Any, keys: KeySpace, worker: str, stats: WorkerStats, ttl_s: int
) -> None:
    """Write `worker`'s stats hash (every field, each time) and let it expire after `ttl_s`.

    A plain pipeline, not MULTI: redis-py's cluster client refuses transactions, and a reader
    between the two commands sees a complete hash either way.
    """
    key = keys.worker_stats(stats.model, worker)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(key, mapping=stats.to_fields())
        pipe.expire(key, ttl_s)
        await pipe.execute()


async def read_worker_stats(
    redis: Any, keys: KeySpace, model: str, workers: Sequence[str]
) -> dict[str, WorkerStats]:
    """The stats of each of `workers` that has a readable hash."""
    if not workers:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for worker in workers:
            pipe.hgetall(keys.worker_stats(model, worker))
        rows = await pipe.execute()
    stats = {}
    for worker, row in zip(workers, rows, strict=True):
        if row:
            try:
                stats[worker] = WorkerStats.from_fields(row)
            except (TypeError, ValueError):
                continue  # an older or foreign writer: show the worker without figures
    return stats


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
