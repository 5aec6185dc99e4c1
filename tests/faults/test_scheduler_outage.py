"""The scheduler rides out a Redis outage as workers and clients do.

A real redis-server with AOF, a real scheduler process running checkpointing experiments;
Redis is killed (SIGKILL) and started again on the same port: once mid-run a few seconds
later, and 25 times at random moments under three submitters. The scheduler process stays
up, and every experiment finishes with every row exactly once.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmqueue.devstack import LocalRedis
from lmqueue.producer import Experiments
from lmqueue.shared.errors import Unavailable, UnknownExperiment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scheduler_processes import SchedulerProcess, wait_for_published_kinds  # noqa: E402


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
            wait_for_published_kinds(server.url, scheduler)
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


async def _retrying(url: str, call: Any, attempts: int = 120) -> Any:
    """`call(experiments)` on a fresh connection, again while Redis is away (as a user's
    retry would: the same submission, the same wait)."""
    for attempt in range(attempts):
        try:
            async with Experiments.connect(url) as experiments:
                return await call(experiments)
        except (Unavailable, ConnectionError):
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


async def _completed_rows(url: str, exp_id: str, lost: list[str]) -> list[dict[str, Any]]:
    """Submit `exp_id`, wait until it is complete and read its rows, as a user would; an id
    that Redis forgot (a kill with ``everysec`` loses up to a second or two of acknowledged
    writes, a whole short experiment included) is submitted again and noted in `lost`."""
    params = {"n": 4, "delay_s": 0.02}
    while True:
        await _retrying(url, lambda ex: ex.submit("exp_kinds:count", params, experiment_id=exp_id))
        try:
            status = await _retrying(url, lambda ex: ex.wait(exp_id, 60))
            assert status.status == "complete", status
            return await _retrying(url, lambda ex: ex.results(exp_id))
        except UnknownExperiment:
            lost.append(exp_id)


async def test_a_scheduler_outlives_redis_restarts_at_random_moments_running_every_experiment_once(
    tmp_path: Path,
) -> None:
    """Restarts every 0.3-2 s under three submitters of short experiments: each cuts some
    round trip of the scheduler (a claim, a checkpoint, a finish) or of a submission. Before
    `scheduler.outage` handled them all, such runs ended the process (WatchError in a claim)
    or left experiments stuck (a claim held for the job timeout, a job failed by an outage)."""
    with LocalRedis(args=["--appendonly", "yes", "--appendfsync", "everysec"]) as server:
        config = tmp_path / "scheduler.json"
        config.write_text(json.dumps({
            "kinds": {"exp_kinds:count": "exp_kinds:count"}, "lease_s": 3.0,
        }))  # fmt: skip
        scheduler = SchedulerProcess(server.url, "restarts-0", config, tmp_path).start()
        stop, restarts, lost = threading.Event(), [], []

        def restart_often() -> None:
            rng = random.Random(7)
            while not stop.wait(rng.uniform(0.3, 2.0)) and len(restarts) < 25:
                server.kill()
                server.stop()
                server.start(timeout_s=60)
                restarts.append(time.monotonic())

        async def submitter(k: int) -> list[str]:
            ids = []
            while not stop.is_set():
                ids.append(f"r{k}-{len(ids)}")
                await _completed_rows(server.url, ids[-1], lost)
            return ids

        try:
            wait_for_published_kinds(server.url, scheduler)
            faults = threading.Thread(target=restart_often)
            faults.start()
            watcher = asyncio.get_running_loop().run_in_executor(None, faults.join)
            submitters = asyncio.gather(*(submitter(k) for k in range(3)))
            await watcher
            stop.set()
            ids = [i for some in await submitters for i in some]
            assert len(restarts) == 25
            assert scheduler.process is not None and scheduler.process.poll() is None, (
                scheduler.log()[-3000:]
            )
            for exp_id in ids:  # read again after the last restart: complete, once each
                rows = await _completed_rows(server.url, exp_id, lost)
                assert [row["index"] for row in rows] == list(range(4)), exp_id
            print(f"submissions Redis forgot and the user made again: {lost}")
            assert len(ids) >= 25
        finally:
            stop.set()
            code = scheduler.stop()
        assert code in (0, None), scheduler.log()[-3000:]
        assert "unexpected" not in scheduler.log(), scheduler.log()[-3000:]
