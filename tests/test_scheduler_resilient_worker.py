"""The scheduler's arq worker outlives what an outage does to arq's own bookkeeping.

A real Redis; the outage is a connection error raised at the exact round trip it would cut
(the full restarts are in tests/faults/test_scheduler_outage.py and the soak). Each case failed
before `ResilientWorker` handled it: a claim cut short kept its job slot (after ``max_jobs``
outages the process ran nothing), a job task that ended cancelled ended the process, and an
outage escaping an experiment's run failed its arq job, leaving the record "running" for good.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from arq import Retry
from arq.connections import ArqRedis
from arq.worker import func
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

from lmqueue.scheduler import arq_worker
from lmqueue.scheduler.outage import ResilientWorker


async def _noop(ctx: dict[str, Any]) -> None:
    return None


@pytest.fixture
async def arq_pool(redis_url: str) -> Any:
    pool = ArqRedis.from_url(redis_url)
    await pool.flushdb()
    yield pool
    await pool.aclose()


def _worker(pool: ArqRedis, max_jobs: int = 2) -> ResilientWorker:
    return ResilientWorker(
        functions=[func(_noop, name="noop")], redis_pool=pool, max_jobs=max_jobs,
        queue_name="resilient-test", handle_signals=False, poll_delay=0.05,
    )  # fmt: skip


class _CutPipeline:
    """A pipeline whose WATCH finds the connection gone (the claim's first round trip), or
    whose EXISTS does, which redis-py reports as a WatchError while a key is watched."""

    def __init__(self, where: str = "watch") -> None:
        self.where = where

    async def __aenter__(self) -> _CutPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def watch(self, *keys: str) -> None:
        if self.where == "watch":
            raise RedisConnectionError("Connection closed by server.")

    async def exists(self, *keys: str) -> int:
        raise WatchError("A ConnectionError occurred on while watching one or more keys")


async def test_a_claim_cut_by_an_outage_gives_its_job_slot_back(
    arq_pool: ArqRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _worker(arq_pool, max_jobs=2)
    slots = worker.sem._value
    job = await arq_pool.enqueue_job("noop", _queue_name="resilient-test")
    assert job is not None
    for where in ("watch", "exists", "watch"):  # more outages than slots
        monkeypatch.setattr(arq_pool, "pipeline", lambda where=where, **kw: _CutPipeline(where))
        with pytest.raises(RedisConnectionError):  # (REDIS_DOWN: the poll loop retries it)
            await worker.start_jobs([job.job_id.encode()])
    assert worker.job_counter == 0
    assert worker.sem._value == slots  # every slot free again
    monkeypatch.undo()
    await worker.start_jobs([job.job_id.encode()])  # and the job still starts
    assert list(worker.tasks) == [job.job_id]
    await asyncio.gather(*worker.tasks.values())
    assert worker.job_counter == 0


async def test_a_job_task_that_ended_cancelled_does_not_end_the_poll_loop(
    arq_pool: ArqRedis,
) -> None:
    worker = _worker(arq_pool)
    worker._pool = arq_pool

    async def forever() -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(forever())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    worker.tasks["gone"] = task
    await worker._poll_iteration()  # arq re-raises each finished task's exception here
    assert "gone" not in worker.tasks
    # the poll's own cancellation (the process stopping) still ends it
    poll = asyncio.create_task(worker._poll_iteration())
    poll.cancel()
    with pytest.raises(asyncio.CancelledError):
        await poll


async def test_an_outage_that_escapes_an_experiments_run_sends_its_job_back_to_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Cut:
        def __init__(self, *args: object) -> None:
            pass

        async def execute(self) -> dict[str, Any]:
            raise RedisConnectionError("Connection closed by server.")

    monkeypatch.setattr(arq_worker, "ExperimentRun", Cut)
    with pytest.raises(Retry) as retry:
        await arq_worker.run_experiment({"lmq": None, "job_id": "j"}, "alice", "e1")
    assert retry.value.defer_score is not None and retry.value.defer_score > 0


async def test_a_wrong_password_still_fails_the_job(redis_url: str) -> None:
    from redis.exceptions import AuthenticationError

    client = aioredis.Redis.from_url(redis_url.replace("redis://", "redis://nobody:wrong@"))
    with pytest.raises(AuthenticationError) as wrong:
        await client.ping()
    await client.aclose()

    class Refused:
        def __init__(self, *args: object) -> None:
            pass

        async def execute(self) -> dict[str, Any]:
            raise wrong.value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(arq_worker, "ExperimentRun", Refused)
        with pytest.raises(AuthenticationError):
            await arq_worker.run_experiment({"lmq": None, "job_id": "j"}, "alice", "e1")


async def test_a_claim_lasts_the_lease_not_the_job_timeout(arq_pool: ArqRedis) -> None:
    from arq.constants import in_progress_key_prefix

    release = asyncio.Event()

    async def held(ctx: dict[str, Any]) -> None:
        await release.wait()

    worker = ResilientWorker(
        functions=[func(held, name="held", timeout=7 * 24 * 3600)], redis_pool=arq_pool,
        queue_name="resilient-test", handle_signals=False, claim_lease_s=2.0,
    )  # fmt: skip
    job = await arq_pool.enqueue_job("held", _queue_name="resilient-test")
    assert job is not None
    await worker.start_jobs([job.job_id.encode()])
    # a run cut off here (its connection lost) frees the job in 2 s, not in 7 days
    assert 0 < await arq_pool.pttl(in_progress_key_prefix + job.job_id) <= 2000
    release.set()
    await asyncio.gather(*worker.tasks.values())


async def test_a_connection_lost_while_a_claim_watches_its_key_is_an_outage_the_poll_outlives(
    arq_pool: ArqRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _worker(arq_pool)
    worker._pool = arq_pool
    job = await arq_pool.enqueue_job("noop", _queue_name="resilient-test")
    assert job is not None
    real = arq_pool.pipeline
    cuts = iter([_CutPipeline("exists")])  # the first claim is cut, the next one is not
    monkeypatch.setattr(arq_pool, "pipeline", lambda **kw: next(cuts, None) or real(**kw))
    await worker._poll_iteration()  # ended the scheduler process with "unexpected WatchError"
    assert list(worker.tasks) == [job.job_id]
    await asyncio.gather(*worker.tasks.values())


@pytest.mark.filterwarnings("ignore:Call to deprecated close:DeprecationWarning")  # arq's call
async def test_a_job_cancelled_while_its_result_is_written_does_not_fail_the_close(
    arq_pool: ArqRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's flake (stop 48): SIGTERM right after an experiment completed, its result write slow
    on a Redis just restarted; arq's close raised the job task's CancelledError (exit 1)."""
    returned = asyncio.Event()
    shut_down: list[bool] = []

    async def quick(ctx: dict[str, Any]) -> None:
        returned.set()

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        shut_down.append(True)

    worker = ResilientWorker(
        functions=[func(quick, name="quick")], redis_pool=arq_pool, queue_name="resilient-test",
        handle_signals=False, on_shutdown=on_shutdown,
    )  # fmt: skip
    worker._pool = arq_pool
    real_finish = worker.finish_job
    writing = asyncio.Event()

    async def slow_finish(*args: Any) -> None:
        writing.set()
        await asyncio.sleep(0.3)
        await real_finish(*args)

    monkeypatch.setattr(worker, "finish_job", slow_finish)
    job = await arq_pool.enqueue_job("quick", _queue_name="resilient-test")
    assert job is not None
    await worker.start_jobs([job.job_id.encode()])
    await asyncio.wait_for(writing.wait(), 5)
    assert returned.is_set()
    await worker.close()  # cancels the task inside arq's shielded write: raised CancelledError
    assert shut_down == [True]  # arq's on_shutdown ran, and the pool was closed
    assert worker._pool is None
