"""`SchedulerProcess` for the tests: the scheduler child process, able to import the tests'
own experiment kinds (`exp_kinds`)."""

from __future__ import annotations

import os
from pathlib import Path

from lmqueue import devstack

TESTS = Path(__file__).resolve().parent


class SchedulerProcess(devstack.SchedulerProcess):
    """``python -m lmqueue.scheduler`` with the tests' folder on its ``PYTHONPATH``."""

    def __init__(self, url: str, name: str, config: Path, log_dir: Path) -> None:
        path = os.pathsep.join([str(TESTS), os.getcwd()])
        super().__init__(url, name, config, log_dir, env={"PYTHONPATH": path})
