"""`SchedulerProcess` for the tests: the scheduler child process, able to import the tests'
own experiment kinds (`exp_kinds`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import redis

from lmqueue import devstack
from lmqueue.shared.keys import KeySpace

TESTS = Path(__file__).resolve().parent


class SchedulerProcess(devstack.SchedulerProcess):
    """``python -m lmqueue.scheduler`` with the tests' folder on its ``PYTHONPATH``."""

    def __init__(self, url: str, name: str, config: Path, log_dir: Path) -> None:
        path = os.pathsep.join([str(TESTS), os.getcwd()])
        super().__init__(url, name, config, log_dir, env={"PYTHONPATH": path})


def wait_for_published_kinds(url: str, scheduler: SchedulerProcess, timeout_s: float = 60) -> None:
    """Until a scheduler has published the kinds it runs (submissions are checked on them);
    `scheduler`'s log if it does not in `timeout_s`."""
    admin = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout_s
        while not admin.exists(KeySpace().experiment_kinds()):
            assert time.monotonic() < deadline, scheduler.log()
            time.sleep(0.1)
    finally:
        admin.close()
