"""The dispatcher enqueues every order it read, also one read just before an outage.

Found by ``lmq bench soak``: an experiment submitted as the queue Redis was killed stayed
``queued`` for good. The scheduler had read its order, the connection broke before the order
was enqueued and acknowledged, and after reconnecting the dispatcher read only new orders:
its own pending one was too young to reclaim then, and was never looked at again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from lmqueue.scheduler import dispatcher as dispatching
from lmqueue.scheduler.dispatcher import SCHEDULER_GROUP, Dispatcher
from lmqueue.scheduler.settings import SchedulerSettings
from lmqueue.shared.keys import KeySpace

KEYS = KeySpace()


class _Arq:
    """arq's pool as the dispatcher uses it: records what was enqueued."""

    def __init__(self) -> None:
        self.jobs: list[str] = []

    async def enqueue_job(self, function: str, tenant: str, experiment_id: str, **_: object):
        self.jobs.append(experiment_id)
        return object()


async def _submitted(url: str, experiment_id: str) -> None:
    """What `Experiments.submit` writes: the record, then the order in the inbox."""
    client = aioredis.Redis.from_url(url)
    try:
        record = {"kind": "score", "model": "m", "params": "{}", "status": "queued",
                  "start_after_ms": 0, "submitted_ms": int(time.time() * 1000)}  # fmt: skip
        await client.hset(KEYS.experiment_record(experiment_id), mapping=record)
        await client.xadd(KEYS.experiment_inbox(), {"id": experiment_id})
    finally:
        await client.aclose()


async def _dispatching(dispatcher: Dispatcher, arq: _Arq, wanted: set[str], timeout_s: float):
    """Run the dispatcher until `wanted` are enqueued (or the time is up); what was."""
    task = asyncio.create_task(dispatcher.run())
    deadline = time.monotonic() + timeout_s
    while not wanted <= set(arq.jobs) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return set(arq.jobs)


async def _read_by(redis_url: str, aredis, reader: str, experiment_id: str) -> None:
    """Submit `experiment_id` and have scheduler `reader` read its order (and do no more)."""
    inbox = KEYS.experiment_inbox()
    await aredis.xgroup_create(inbox, SCHEDULER_GROUP, id="0", mkstream=True)
    await _submitted(redis_url, experiment_id)
    await aredis.xreadgroup(SCHEDULER_GROUP, reader, {inbox: ">"}, count=10)


async def test_an_order_read_before_the_connection_broke_is_enqueued_after_it(redis_url, aredis):
    arq = _Arq()
    dispatcher = Dispatcher(SchedulerSettings(redis_url=redis_url, name="sched-a"), aredis, arq,
                            {"score"})  # fmt: skip
    # the read that the outage interrupted: delivered to this scheduler, never enqueued
    await _read_by(redis_url, aredis, "sched-a", "read-then-cut")
    assert await _dispatching(dispatcher, arq, {"read-then-cut"}, 3.0) == {"read-then-cut"}
    inbox = KEYS.experiment_inbox()
    assert (await aredis.xpending(inbox, SCHEDULER_GROUP))["pending"] == 0
    assert await aredis.xlen(inbox) == 0


async def test_a_dead_schedulers_order_is_taken_over_while_the_dispatcher_runs(
    redis_url, aredis, monkeypatch
):
    monkeypatch.setattr(dispatching, "_RECLAIM_IDLE_MS", 1500)
    arq = _Arq()
    dispatcher = Dispatcher(SchedulerSettings(redis_url=redis_url, name="sched-b"), aredis, arq,
                            {"score"})  # fmt: skip
    await _read_by(redis_url, aredis, "sched-dead", "orphan")
    # too young to take over when the dispatcher starts; idle long enough 1.5 s later
    assert await _dispatching(dispatcher, arq, {"orphan"}, 5.0) == {"orphan"}


class _CutOnceArq(_Arq):
    """arq's enqueue, whose first call loses its connection while it watches the job key
    (redis-py raises WatchError there): it ended the dispatcher's task, and every later
    submission stayed ``queued`` while the scheduler process ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    async def enqueue_job(self, function: str, tenant: str, experiment_id: str, **kw: object):
        if not self.cut:
            self.cut = True
            raise WatchError("A ConnectionError occurred on while watching one or more keys")
        return await super().enqueue_job(function, tenant, experiment_id, **kw)


async def test_an_enqueue_cut_while_watching_is_retried_and_the_dispatcher_goes_on(
    redis_url, aredis
):
    arq = _CutOnceArq()
    dispatcher = Dispatcher(SchedulerSettings(redis_url=redis_url, name="sched-w"), aredis, arq,
                            {"score"})  # fmt: skip
    await _submitted(redis_url, "cut-while-watching")
    await _submitted(redis_url, "after-it")
    wanted = {"cut-while-watching", "after-it"}
    assert await _dispatching(dispatcher, arq, wanted, 5.0) == wanted
