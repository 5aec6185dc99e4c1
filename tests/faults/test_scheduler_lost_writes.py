"""A Redis that comes back without writes it had acknowledged, under a running experiment.

An AOF with ``appendfsync everysec`` (or a snapshot) can lose the last second of acknowledged
writes when Redis is killed; the random-restart scenario of `test_scheduler_outage` met it
about once in twenty runs. Here the loss is made deterministic: ``SAVE`` takes a snapshot,
the run goes on writing, Redis is killed and comes back from the snapshot. The run's next
checkpoint is refused (`LostOwnership`: fewer rows than it wrote, or an earlier run's token);
with nobody else running the experiment, the job must run again from what Redis kept and end
with every row exactly once. Where another live run did take the experiment over (a scheduler
stalled past its lease), the stalled run must step aside and write nothing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from lmqueue.devstack import LocalRedis
from lmqueue.producer import Experiments
from lmqueue.shared.keys import KeySpace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scheduler_processes import SchedulerProcess, wait_for_published_kinds  # noqa: E402

ROWS = 40
PARAMS = {"n": ROWS, "delay_s": 0.1}


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "scheduler.json"
    config.write_text(json.dumps({
        "kinds": {"exp_kinds:count": "exp_kinds:count"}, "lease_s": 3.0, "poll_delay_s": 0.1,
    }))  # fmt: skip
    return config


async def _until_done(url: str, exp_id: str, done: int) -> None:
    async with Experiments.connect(url) as experiments:
        async for status in experiments.follow(exp_id, 0.05):
            if status.done >= done:
                return
    raise AssertionError(f"{exp_id} finished before {done} rows")


async def _running(url: str, scheduler: SchedulerProcess) -> None:
    """Experiment "x" submitted, and 5 of its rows written by `scheduler`."""
    wait_for_published_kinds(url, scheduler)
    async with Experiments.connect(url) as experiments:
        await experiments.submit("exp_kinds:count", PARAMS, experiment_id="x")
    await _until_done(url, "x", 5)


async def _until_taken_over(url: str, field: str, before: str, by: SchedulerProcess) -> None:
    """Until the record's `field` is no longer `before`: another run, `by`'s, has started."""
    deadline = time.monotonic() + 30
    while _record(url, "x").get(field) == before:
        assert time.monotonic() < deadline, by.log()[-3000:]
        await asyncio.sleep(0.1)


def _record(url: str, exp_id: str) -> dict[str, str]:
    admin = redis.Redis.from_url(url, decode_responses=True)
    try:
        return admin.hgetall(KeySpace().experiment_record(exp_id))
    finally:
        admin.close()


def _snapshot(url: str) -> int:
    """``SAVE``; the rows the snapshot holds."""
    admin = redis.Redis.from_url(url)
    try:
        admin.save()
        return int(admin.llen(KeySpace().experiment_results("x")))
    finally:
        admin.close()


def _back_from_snapshot(server: LocalRedis) -> None:
    """SIGKILL, then start again: Redis loads the last ``SAVE`` and forgets what came after."""
    server.kill()
    server.stop()
    server.start()


async def _finished_once(url: str, exp_id: str, *schedulers: SchedulerProcess) -> None:
    async with Experiments.connect(url) as experiments:
        status = await experiments.wait(exp_id, 60)
        rows = await experiments.results(exp_id)
    logs = "\n".join(s.log()[-3000:] for s in schedulers)
    assert status.status == "complete", (status, logs)
    assert [row["index"] for row in rows] == list(range(ROWS)), logs  # once each, in order
    assert "Traceback" not in logs, logs  # e.g. arq's, for one job run twice in one process


async def test_a_run_whose_rows_redis_lost_runs_again_from_what_redis_kept(tmp_path: Path) -> None:
    with LocalRedis() as server:
        scheduler = SchedulerProcess(server.url, "lost-0", _config(tmp_path), tmp_path).start()
        try:
            await _running(server.url, scheduler)
            kept = _snapshot(server.url)
            token = _record(server.url, "x")["run_token"]
            await _until_done(server.url, "x", kept + 10)
            _back_from_snapshot(server)
            # the snapshot has this run's token and fewer rows than the run wrote
            assert _record(server.url, "x")["run_token"] == token
            await _finished_once(server.url, "x", scheduler)
            assert "Redis lost writes of this run" in scheduler.log(), scheduler.log()[-3000:]
            assert "another run took it over" not in scheduler.log()
        finally:
            assert scheduler.stop() in (0, None), scheduler.log()[-3000:]


@contextmanager
def _two_schedulers(
    tmp_path: Path, names: tuple[str, str]
) -> Iterator[tuple[LocalRedis, SchedulerProcess, SchedulerProcess]]:
    """A Redis, the first scheduler started and the second not yet; both killed at the end
    (a test stops the ones that must exit cleanly itself)."""
    config = _config(tmp_path)
    with LocalRedis() as server:
        first, second = (SchedulerProcess(server.url, n, config, tmp_path) for n in names)
        try:
            yield server, first.start(), second
        finally:
            first.kill()
            second.kill()


async def test_a_run_whose_start_redis_lost_runs_again_rather_than_yield_to_a_dead_run(
    tmp_path: Path,
) -> None:
    """The snapshot holds the token of a run whose scheduler has since died: the record says
    "running" under that token, but nobody has touched it for longer than a lease."""
    with _two_schedulers(tmp_path, ("lost-1", "lost-2")) as (server, first, second):
        url = server.url
        await _running(url, first)
        kept = _snapshot(url)
        dead = _record(url, "x")["run_token"]
        first.kill()
        second.start()  # takes the job over once the dead run's lease has run out
        await _until_taken_over(url, "run_token", dead, second)
        await _until_done(url, "x", kept + 5)
        _back_from_snapshot(server)
        record = _record(url, "x")
        assert (record["run_token"], record["status"]) == (dead, "running")
        await _finished_once(url, "x", second)
        assert "Redis lost writes of this run" in second.log(), second.log()[-3000:]
        assert second.stop() in (0, None), second.log()[-3000:]


async def test_a_stalled_run_steps_aside_for_the_live_run_that_took_over(tmp_path: Path) -> None:
    """A scheduler stopped (SIGSTOP) past its lease: another takes the experiment over; the
    stalled one, continued, finds the other's fresh token and writes nothing more."""
    with _two_schedulers(tmp_path, ("stall-1", "stall-2")) as (server, stalled, live):
        url = server.url
        await _running(url, stalled)
        stalled.signal(signal.SIGSTOP)
        live.start()
        await _until_taken_over(url, "scheduler", "stall-1", live)
        stalled.signal(signal.SIGCONT)
        await _finished_once(url, "x", stalled, live)
        assert "another run took it over" in stalled.log(), stalled.log()[-3000:]
        assert "Redis lost writes" not in stalled.log() + live.log()
        for scheduler in (stalled, live):
            assert scheduler.stop() in (0, None), scheduler.log()[-3000:]
