"""The stack a benchmark runs on: private Redis servers, worker processes, clients, CPU meters.

Every benchmark starts its own redis-server(s) on free ports, so runs never see each other's
keys or memory, and its workers as real processes (``python -m lmqueue.workers``), the layout of a
deployment. Nothing is read from ``LMQ_*`` variables here: a benchmark's configuration is its
flags, so a rerun with the same command measures the same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from lmqueue.devstack import LocalRedis, WorkerProcess
from lmqueue.producer import QueueLM
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.registry import ModelRegistry
from lmqueue.shared.settings import ClientSettings, RedisSettings

__all__ = [
    "redis_server",
    "server_pid",
    "worker_pool",
    "add_workers",
    "connect_client",
    "wait_for_workers",
    "CpuMeter",
    "batch_size_env",
]

#: Worker processes log only warnings: a benchmark's output is its figures.
QUIET = {"LMQ_LOG_LEVEL": "WARNING"}


def batch_size_env(rows: int) -> dict[str, str]:
    """The environment that gives a worker batches of `rows` (a benchmark's flag, not the
    caller's ``LMQ_BATCH_SIZE``)."""
    return {"LMQ_BATCH_SIZE": str(rows)}


@contextlib.contextmanager
def redis_server(maxmemory: str = "0", policy: str = "noeviction") -> Iterator[LocalRedis]:
    """A private redis-server for the duration of the block."""
    with LocalRedis(maxmemory=maxmemory, policy=policy) as server:
        yield server


@contextlib.contextmanager
def worker_pool(count: int, *, tag: str, **spec: Any) -> Iterator[list[WorkerProcess]]:
    """`count` worker processes (`spec`: as for `add_workers`), all stopped when the block ends.

    The yielded list may grow inside the block (`add_workers`); those are stopped too.
    """
    workers: list[WorkerProcess] = []
    try:
        add_workers(workers, count, tag=tag, **spec)
        yield workers
    finally:
        for worker in workers:
            worker.stop(timeout_s=15)
        shutil.rmtree(_log_dir(tag), ignore_errors=True)


def add_workers(
    workers: list[WorkerProcess],
    count: int,
    *,
    model: str,
    backend: str,
    redis_url: str,
    tag: str,
    cache_url: str | None = None,
    backend_opts: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Start `count` more workers and append them to `workers`."""
    extra = ["--cache-url", cache_url] if cache_url else []
    log_dir = _log_dir(tag)
    log_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(count):
        name = f"bench-{tag}-{len(workers)}"
        process = WorkerProcess(
            model,
            backend,
            redis_url,
            name,
            backend_opts=backend_opts,
            env={**QUIET, **(env or {})},
            log_dir=log_dir,
            extra_args=extra,
        )
        workers.append(process.start())


async def connect_client(
    model: str, settings: ClientSettings, workers: Sequence[WorkerProcess], timeout_s: float = 180
) -> QueueLM:
    """Connect once a worker has published `model`; fail fast with their logs if all died."""
    deadline = time.monotonic() + timeout_s
    quick = replace(settings, connect_timeout_s=1.0)
    while True:
        try:
            return await QueueLM.connect(model, settings=quick)
        except LookupError:
            _check_alive(workers)
            if time.monotonic() > deadline:
                raise


async def wait_for_workers(
    redis_url: str, model: str, workers: Sequence[WorkerProcess], timeout_s: float = 300
) -> None:
    """Wait until every one of `workers` has sent a heartbeat for `model`."""
    redis = await connect_async_redis(redis_url)  # a cluster client on a cluster node
    registry = ModelRegistry(redis, RedisSettings(url=redis_url).keyspace())
    names = {w.name for w in workers}
    deadline = time.monotonic() + timeout_s
    try:
        while not names <= set(await registry.live_workers(model, within_s=10)):
            _check_alive(workers)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(names)} did not all start in {timeout_s} s")
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


def _log_dir(tag: str) -> Path:
    """Where the logs of this run's workers tagged `tag` go (removed with their pool)."""
    return Path(tempfile.gettempdir()) / f"lmq-bench-{os.getpid()}-{tag}"


def server_pid(server: LocalRedis) -> int:
    """The pid of a started `LocalRedis` (for CPU and memory meters)."""
    assert server.process is not None, "not started"
    return server.process.pid


def _check_alive(workers: Sequence[WorkerProcess]) -> None:
    dead = [w for w in workers if not w.alive]
    if dead:
        logs = "\n".join(f"--- {w.name}\n{w.log()[-3000:]}" for w in dead)
        raise RuntimeError(f"{len(dead)} worker process(es) exited:\n{logs}")


class CpuMeter:
    """CPU seconds (user + system) that named groups of processes spend between start and stop.

    Per-reply CPU of client, worker and Redis is the figure a loaded machine distorts least:
    throughput drops when others steal the cores, CPU per reply mostly does not. The kernel's
    share of it (`system_s`) tells moving bytes (copies into and out of sockets, page faults)
    from the Python a process runs per reply.
    """

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {name: [psutil.Process(pid) for pid in pids] for name, pids in groups.items()}
        self._start: dict[str, tuple[float, float]] = {}
        #: After `stop`: the system (kernel) part of each group's CPU seconds.
        self.system_s: dict[str, float] = {}

    def _now(self) -> dict[str, tuple[float, float]]:
        """Each group's (user + system, system) CPU seconds so far."""
        totals = {}
        for name, processes in self.groups.items():
            total = system = 0.0
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
                    system += times.system
            totals[name] = (total, system)
        return totals

    def start(self) -> None:
        """Take the starting readings."""
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        """CPU seconds per group since `start` (their system part in `system_s`)."""
        now = self._now()
        before = {name: self._start.get(name, (0.0, 0.0)) for name in now}
        self.system_s = {name: now[name][1] - before[name][1] for name in now}
        return {name: now[name][0] - before[name][0] for name in now}
