"""`WorkerProcess`: a worker as a real child process, for the demo, benchmarks and tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["WorkerProcess", "child_environment"]


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top, for a child process (read nowhere
    else: settings come from `shared.settings` alone)."""
    return {**os.environ, **extra}


class WorkerProcess:
    """``python -m lmqueue.workers`` with the given settings; its log goes to a file.

    Args:
        model, backend, redis_url, name: the worker's settings.
        backend_opts: JSON-able backend options (``--backend-opts``).
        env: extra environment variables (``LMQ_*`` settings).
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
        self.name = name
        self.args = [
            sys.executable,
            "-m",
            "lmqueue.workers",
            "--model",
            model,
            "--backend",
            backend,
            "--redis-url",
            redis_url,
            "--name",
            name,
            *extra_args,
        ]
        if backend_opts:
            self.args += ["--backend-opts", json.dumps(backend_opts)]
        self.env = child_environment(env or {})
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="lmq-worker-"))
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        """Start the process (returns at once; the model loads in the child)."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        """The child's pid."""
        assert self.process is not None, "not started"
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether the child still runs."""
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send `signum` (SIGKILL, SIGSTOP, SIGCONT, ...) to the child."""
        if self.alive:
            os.kill(self.pid, signum)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait for a clean exit (SIGKILL after `timeout_s`); the exit code."""
        if self.process is None:
            return None
        if self.alive:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        """Everything the child wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
