"""`WorkerProcess`: a worker as a real child process, for the demo, benchmarks and tests;
`wait_live` waits for their heartbeats."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmqueue.shared.connections import sync_redis
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import REDIS_DOWN

from .process import ChildProcess

__all__ = ["WorkerProcess", "wait_live"]


class WorkerProcess(ChildProcess):
    """``python -m lmqueue.workers`` with the given settings; its log goes to a file.

    Args:
        model, backend, redis_url, name: the worker's settings.
        backend_opts: JSON-able backend options (``--backend-opts``).
        env: extra environment variables (``LMQ_*`` settings).
        log_dir: where ``<name>.log`` goes (a new temporary folder by default).
        extra_args: further ``lmq worker`` flags.
    """

    def __init__(
        self,
        model: str,
        backend: str,
        redis_url: str,
        name: str,
        backend_opts: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        args = [sys.executable, "-m", "lmqueue.workers", "--model", model, "--backend", backend,
                "--redis-url", redis_url, "--name", name, *extra_args]  # fmt: skip
        if backend_opts:
            args += ["--backend-opts", json.dumps(backend_opts)]
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="lmq-worker-"))
        super().__init__(name, args, log_dir / f"{name}.log", env)


def wait_live(
    redis_url: str, model: str, workers: Sequence[WorkerProcess], timeout_s: float = 90.0
) -> float:
    """Block until each of `workers` has sent a heartbeat for `model` since now; the seconds
    that took.

    Raises:
        RuntimeError: if a worker exited (the end of its log in the message).
        TimeoutError: if they were not all live within `timeout_s`.
    """
    started = time.monotonic()
    since_ms = int(time.time() * 1000)
    key = KeySpace().model_workers(model)
    client: Any = sync_redis(redis_url)  # a cluster client where `redis_url` is a cluster node
    try:
        while True:
            try:
                beats = dict(client.zrange(key, 0, -1, withscores=True))
            except REDIS_DOWN:  # a young cluster, or a Redis restarting, is down for a moment
                beats = {}
            if all(beats.get(w.name.encode(), 0) >= since_ms for w in workers):
                return time.monotonic() - started
            for worker in workers:
                if not worker.alive:
                    raise RuntimeError(f"{worker.name} exited:\n{worker.log()[-4000:]}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"workers {[w.name for w in workers]} not live in {timeout_s} s")
            time.sleep(0.05)
    finally:
        client.close()
