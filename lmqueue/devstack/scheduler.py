"""`SchedulerProcess`: the experiment scheduler as a real child process, for the soak and tests."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from .process import ChildProcess

__all__ = ["SchedulerProcess"]


class SchedulerProcess(ChildProcess):
    """``python -m lmqueue.scheduler`` with a settings file; its log is ``<log_dir>/<name>.log``.

    Args:
        url: the admin URL of the queue (``--redis-url``).
        config: the scheduler's JSON settings file (``--config``).
        env: extra environment variables (e.g. a ``PYTHONPATH`` for custom kinds).
    """

    def __init__(
        self,
        url: str,
        name: str,
        config: Path,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        args = [sys.executable, "-m", "lmqueue.scheduler", "--redis-url", url, "--name", name,
                "--config", str(config)]  # fmt: skip
        super().__init__(name, args, log_dir / f"{name}.log", env)
