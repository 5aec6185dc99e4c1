"""The soak's memory series: what every process and Redis holds, sampled every few seconds.

A sample reads, by role (a restarted process keeps its role's series):

* ``rss_mib:<role>``: the RSS of each worker, client process, the scheduler and both Redis
  servers; ``gpu_mib:<worker>`` where the driver reports a worker's GPU memory (a role's new
  pid is a restart: `restarts` keeps when, and `flatness` judges each life apart);
* ``queue_used_mib`` (Redis ``used_memory``, summed over a cluster's masters) and
  ``cache_used_mib``; ``claim_check_keys``: the cache's keys, every one a vector a reply may
  point to;
* ``request_entries``, ``pending_entries``, ``dead_letters``: over every tenant's request
  stream (entries waiting, delivered and unacknowledged, dead-lettered);
* ``reply_streams`` and ``reply_entries``: the clients' reply streams and what they hold;
* ``scheduler_keys`` (arq's and the scheduler's own) and ``experiment_keys`` (tenants'
  experiment records and results), both only the keys that never expire (`Monitor._count_key`),
  and ``queue_keys`` (all keys of the queue role, expiring ones too).

`FLOORS` is each kind's noise: the rise a flat series may show anyway (`flatness`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any

import psutil
import redis

from lmqueue.shared.keys import WORKER_GROUP

from ..lib import devices
from .rig import Rig

__all__ = ["Monitor", "FLOORS", "floor_of"]

#: series name prefix -> the allowed rise whatever the level (see `flatness`)
FLOORS = {
    "rss_mib": 16.0, "gpu_mib": 16.0, "queue_used_mib": 16.0, "cache_used_mib": 16.0,
    "claim_check_keys": 256.0, "request_entries": 64.0, "pending_entries": 64.0,
    "dead_letters": 0.0, "reply_streams": 4.0, "reply_entries": 64.0, "scheduler_keys": 16.0,
    "experiment_keys": 16.0, "queue_keys": 64.0,
}  # fmt: skip
_MIB = 2**20


def floor_of(name: str) -> float:
    """The noise floor of series `name`."""
    return FLOORS.get(name.split(":", 1)[0], 0.0)


class Monitor:
    """Takes samples of one rig; `series` maps each name to its (seconds, value) points."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.started = time.time()
        self.series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        #: series name -> the times (of the first sample) its process was a new one
        self.restarts: dict[str, list[float]] = defaultdict(list)
        self.errors = 0
        self._pids: dict[str, int] = {}

    def sample(self) -> None:
        """Take one sample of every series (a Redis that is down skips its series once)."""
        t = round(time.time() - self.started, 2)
        values = self._processes(t)
        for read in (self._queue, self._cache):
            try:
                values.update(read())
            except (redis.RedisError, OSError):
                self.errors += 1
        for name, value in values.items():
            self.series[name].append((t, float(value)))

    def _processes(self, t: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, pid in self.rig.pids().items():
            if self._pids.setdefault(role, pid) != pid:
                self._pids[role] = pid
                for kind in ("rss_mib", "gpu_mib"):
                    self.restarts[f"{kind}:{role}"].append(t)
            with contextlib.suppress(psutil.Error):
                out[f"rss_mib:{role}"] = psutil.Process(pid).memory_info().rss / _MIB
            if role.startswith("soak-w"):
                gpu = devices.gpu_used_bytes([pid])
                if gpu is not None:
                    out[f"gpu_mib:{role}"] = gpu / _MIB
        return out

    def _queue_nodes(self) -> list[Any]:
        if self.rig.cluster is not None:
            ports = self.rig.cluster.master_ports()
            return [redis.Redis(port=p, socket_timeout=5) for p in ports]
        return [redis.Redis.from_url(self.rig.queue_server.url, socket_timeout=5)]

    def _queue(self) -> dict[str, float]:
        nodes = self._queue_nodes()
        out: dict[str, float] = defaultdict(float)
        try:
            for node in nodes:
                out["queue_used_mib"] += int(node.info("memory")["used_memory"]) / _MIB
                out["queue_keys"] += int(node.dbsize())
                for key in node.scan_iter(count=1000):
                    self._count_key(node, key.decode(errors="replace"), out)
        finally:
            for node in nodes:
                node.close()
        return out

    def _count_key(self, node: Any, key: str, out: dict[str, float]) -> None:
        """Add `key` to its series (names as `lmqueue.shared.keys` lays them out)."""
        if key.startswith("arq:") or ":_sched:" in key:
            out["scheduler_keys"] += _lasting(node, key)
        elif ":exp:" in key:
            out["experiment_keys"] += _lasting(node, key)
        elif key.endswith(":replies"):
            out["reply_streams"] += 1
            out["reply_entries"] += int(node.xlen(key))
        elif key.endswith(":requests"):
            out["request_entries"] += int(node.xlen(key))
            with contextlib.suppress(redis.ResponseError):
                out["pending_entries"] += int(node.xpending(key, WORKER_GROUP)["pending"])
        elif key.endswith(":dead"):
            out["dead_letters"] += int(node.xlen(key))

    def _cache(self) -> dict[str, float]:
        cache: Any
        with redis.Redis.from_url(self.rig.cache.url, socket_timeout=5) as cache:
            return {
                "cache_used_mib": int(cache.info("memory")["used_memory"]) / _MIB,
                "claim_check_keys": int(cache.dbsize()),
            }

    def to_json(self) -> dict[str, Any]:
        """Every series as lists of [seconds, value]."""
        return {name: [list(p) for p in points] for name, points in self.series.items()}


def _lasting(node: Any, key: str) -> int:
    """1 if `key` never expires, else 0. A finished experiment's record, results and arq job
    expire (the scheduler's ``keep_finished_s``): how many there are is the experiment rate
    times that, and follows the rate through every fault (a 5-minute soak once failed on it:
    +19 keys at a level of 112, no key leaked). A leak is a key that stays: a lost expiry, a
    key made per experiment without one. Expiring keys still count in ``queue_keys``."""
    return 1 if int(node.ttl(key)) == -1 else 0
