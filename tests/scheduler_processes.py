"""`SchedulerProcess`: ``python -m lmqueue.scheduler`` as a child process, for the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


class SchedulerProcess:
    """``python -m lmqueue.scheduler`` as a child process, its log in a file."""

    def __init__(self, url: str, name: str, config: Path, log_dir: Path) -> None:
        self.name = name
        self.args = [sys.executable, "-m", "lmqueue.scheduler", "--redis-url", url, "--name", name]
        self.args += ["--config", str(config)]
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> SchedulerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.getcwd()])}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
