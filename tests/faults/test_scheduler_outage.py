"""The scheduler rides out a Redis outage as workers and clients do.

A real redis-server with AOF (fsync always, so a restart keeps what was acknowledged), a real
scheduler process running a checkpointing experiment; Redis is killed (SIGKILL) mid-run and
started again on the same port a few seconds later. The scheduler process stays up, and the
experiment finishes with every row exactly once.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import redis

from lmqueue.devstack import LocalRedis
from lmqueue.producer import Experiments
from lmqueue.shared.keys import KeySpace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scheduler_processes import SchedulerProcess  # noqa: E402


def _persistent() -> LocalRedis:
    return LocalRedis(args=["--appendonly", "yes", "--appendfsync", "always"])


async def test_a_redis_restart_under_a_running_experiment_loses_and_doubles_no_row(
    tmp_path: Path,
) -> None:
    with _persistent() as server:
        config = tmp_path / "scheduler.json"
        config.write_text(json.dumps({
            "kinds": {"exp_kinds:count": "exp_kinds:count"}, "lease_s": 6.0,
            "poll_delay_s": 0.1,
        }))  # fmt: skip
        scheduler = SchedulerProcess(server.url, "outage-0", config, tmp_path).start()
        try:
            admin = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 60
            while not admin.exists(KeySpace().experiment_kinds()):
                assert time.monotonic() < deadline, scheduler.log()
                time.sleep(0.1)
            admin.close()
            async with Experiments.connect(server.url) as experiments:
                exp_id = await experiments.submit("exp_kinds:count", {"n": 60, "delay_s": 0.1})
                async for status in experiments.follow(exp_id, 0.05):
                    if status.done >= 10:
                        break
            server.kill()  # SIGKILL: a crash, mid-run
            server.stop()
            await asyncio.sleep(3)
            server.start()
            async with Experiments.connect(server.url) as experiments:
                status = await experiments.wait(exp_id, 120)
                results = await experiments.results(exp_id)
            assert scheduler.process is not None and scheduler.process.poll() is None
            assert status.status == "complete", (status, scheduler.log())
            assert [row["index"] for row in results] == list(range(60))  # once each, in order
            assert "cannot be reached" in scheduler.log()  # it noticed, and went on
        finally:
            assert scheduler.stop() in (0, None), scheduler.log()
        assert "Traceback" not in scheduler.log(), scheduler.log()
