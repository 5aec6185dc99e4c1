"""`ChildProcess`: a command run as a child process, its output in a log file."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from .stop import kill_process, stop_process

__all__ = ["ChildProcess", "child_environment"]


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with `extra` on top, for a child process (read nowhere
    else: settings come from `shared.settings` alone)."""
    return {**os.environ, **extra}


class ChildProcess:
    """`args` as a child process, with this environment and `env` on top, writing to `log_path`.

    `start` may be called again after `stop` or `kill`: the log is appended to.
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 30.0,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.env = child_environment(env or {})
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        """Start the process (returns at once)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
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
        if self.process is not None and self.alive:
            self.process.send_signal(signum)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM and wait for a clean exit (SIGKILL after `timeout_s`, by default the
        process's grace period); the exit code."""
        grace_s = self.stop_grace_s if timeout_s is None else timeout_s
        return stop_process(self.process, grace_s)

    def kill(self) -> int | None:
        """SIGKILL, as a crash would; the exit code."""
        return kill_process(self.process)

    def log(self) -> str:
        """Everything the child wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
