"""Which number should KEDA scale workers on? Real workers through backlog, deletion and drain.

Workers XACK and XDEL each entry once answered, so a request stream holds exactly the
unanswered requests: pending (delivered to a worker) plus undelivered. KEDA's redis-streams
scaler reads one of three numbers (pkg/scalers/redis_streams_scaler.go, KEDA v2.20.2):

- ``streamLength``: XLEN;
- ``pendingEntriesCount``: the XPENDING summary's count;
- ``lagCount``: XINFO GROUPS ``lag`` of the group (0 if the stream does not exist, XLEN if the
  group does not), parsed by go-redis v9.19, which turns a nil lag into -1.

In every mode KEDA calls the trigger active while the number is above ``activationLagCount``
(default 0), and scales to zero replicas after its cooldown when no trigger is active.

The test walks real worker processes (mock backend) through a fleet's life, scale to zero and
back included, and at every step compares each reading with the true backlog: requests sent
whose reply has not been written. XLEN equals it at every step; the other two go wrong in the
ways that matter: XPENDING is 0 while requests wait for a worker that does not exist (the
fleet never wakes from zero), and the lag is 0 while a worker holds work, then nil (-1 in
KEDA) once a later batch was deleted before an earlier one finished, so KEDA would keep the
fleet at zero with eight requests waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from lmqueue.devstack import WorkerProcess
from lmqueue.producer.admission import Admission
from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes
from lmqueue.status import collect_status

MODEL = "smollm2-135m"
KEYS = KeySpace()
STREAM = KEYS.requests(MODEL)
CLIENT = "scaler-probe"
#: Small batches, no waiting to fill one, a short grace: a SIGTERM leaves in-flight work pending.
WORKER_ENV = {
    "LMQ_BATCH_SIZE": "5",
    "LMQ_MAX_WAIT_MS": "0",
    "LMQ_HEARTBEAT_S": "0.5",
    "LMQ_SHUTDOWN_GRACE_S": "0.2",
}


async def keda_readings(redis: Any) -> dict[str, int]:
    """The number each mode of KEDA's redis-streams scaler reads, as that scaler computes it."""
    readings = {"streamLength": int(await redis.xlen(STREAM))}
    try:
        readings["pendingEntriesCount"] = int(
            (await redis.xpending(STREAM, WORKER_GROUP))["pending"]
        )
    except ResponseError:  # KEDA reports an error; no number, no scaling
        readings["pendingEntriesCount"] = -1
    readings["lagCount"] = await _keda_lag(redis)
    return readings


async def _keda_lag(redis: Any) -> int:
    try:
        groups = await redis.xinfo_groups(STREAM)
    except ResponseError as exc:
        if "no such key" in str(exc):
            return 0
        raise
    for group in groups:
        if group["name"] == WORKER_GROUP.encode():
            return -1 if group["lag"] is None else int(group["lag"])
    return int(await redis.xlen(STREAM))


class Fleet:
    """One client's requests, their replies, and the worker processes serving them."""

    def __init__(self, redis: Any, redis_url: str, log_dir: Path) -> None:
        self.redis = redis
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.sent: list[str] = []
        self.workers: list[WorkerProcess] = []
        self._admission = Admission(redis, STREAM, max_backlog=0)

    async def send(self, prompts: list[list[int]]) -> list[str]:
        """Enqueue one request per prompt through the clients' admission script."""
        requests = [
            Request(f"{CLIENT}:{len(self.sent) + i}", CLIENT, ids_to_bytes(p))
            for i, p in enumerate(prompts)
        ]
        await self._admission.enqueue([encode_request(r)["m"] for r in requests])
        self.sent += [r.request_id for r in requests]
        return [r.request_id for r in requests]

    async def answered(self) -> set[str]:
        """Request ids with a reply written."""
        rows = await self.redis.xrange(KEYS.replies(CLIENT))
        return {decode_reply(fields).request_id for _, fields in rows}

    async def true_backlog(self) -> int:
        """Requests sent and not answered: what a scaler should see."""
        return len(set(self.sent) - await self.answered())

    async def start(self, batch_delay_s: float = 0.0) -> WorkerProcess:
        """Start the worker ``w1`` (always the same name, like a restarted pod) and wait for it."""
        since_ms = int(time.time() * 1000)
        worker = WorkerProcess(
            MODEL, "mock", self.redis_url, "w1", {"batch_delay_s": batch_delay_s},
            WORKER_ENV, log_dir=self.log_dir,
        ).start()  # fmt: skip
        self.workers.append(worker)

        async def beating() -> bool:
            assert worker.alive, worker.log()[-3000:]
            score = await self.redis.zscore(KEYS.model_workers(MODEL), "w1")
            return score is not None and score >= since_ms

        await until(beating, "the worker's first heartbeat", timeout_s=90)
        return worker

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=10)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30) -> None:
    """Poll `check` until it holds."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def fleet(aredis: aioredis.Redis, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(aredis, redis_url, tmp_path)
    yield fleet
    fleet.stop_all()


def prompts(first: int, count: int) -> list[list[int]]:
    return [[11, first + i] for i in range(count)]


async def test_xlen_tracks_the_true_backlog_where_pending_count_and_lag_do_not(
    fleet: Fleet, aredis: aioredis.Redis
) -> None:
    steps: list[tuple[str, int, dict[str, int]]] = []

    async def record(step: str) -> dict[str, int]:
        readings = await keda_readings(aredis)
        true = await fleet.true_backlog()
        status = await collect_status(aredis, KEYS, models=[MODEL])
        assert status["models"][MODEL]["backlog"] == true, step  # lmq status reads the same
        steps.append((step, true, readings))
        return readings

    # 1. A worker answers 5 requests; answered entries are deleted. (It also leaves their
    #    results in the shared cache: they come back in step 3.)
    worker = await fleet.start()
    cached = await fleet.send(prompts(100, 5))
    await until(lambda: _answered_all(fleet, cached), "5 answers")
    await record("drained after deletions")
    # 2. Scale to zero: no worker, nothing queued.
    assert worker.stop() == 0
    await record("zero workers, idle")
    # 3. Requests arrive while no worker runs: 5 new prompts (A), then the 5 cached ones (B).
    slow = await fleet.send(prompts(200, 5))
    fast = await fleet.send(prompts(100, 5))
    woke = await record("zero workers, 10 queued")
    # 4. Scale from zero: a slow worker takes A (its forward takes 60 s) and B, answers B
    #    from the shared cache at once and deletes it: a later batch deleted before an earlier.
    worker = await fleet.start(batch_delay_s=60)
    await until(lambda: _answered_all(fleet, fast), "the cached batch's answers")
    await until(lambda: _pending_is(aredis, 5), "batch A pending")
    busy = await record("one worker busy with 5")
    # 5. Scale to zero while A is in flight: SIGTERM, a 0.2 s grace, A stays pending.
    assert worker.stop() == 0
    await record("zero workers, 5 left pending")
    # 6. Three more requests arrive; no worker runs.
    late = await fleet.send(prompts(300, 3))
    stranded = await record("zero workers, 5 pending + 3 queued")
    # 7. Scale from zero again: a fast worker under the same name answers A, then the rest.
    worker = await fleet.start()
    await until(lambda: _answered_all(fleet, slow + late), "every answer")
    await record("drained")
    assert worker.stop() == 0

    report = "\n".join(f"{step:<36} true {true:>2}  {readings}" for step, true, readings in steps)
    print(report)
    for step, true, readings in steps:
        assert readings["streamLength"] == true, f"{step}: XLEN differs\n{report}"
    # The other modes' failures, each of which would strand work:
    assert woke["pendingEntriesCount"] == 0  # 10 waiting, no worker: never activates
    assert busy["lagCount"] == 0  # 5 held by a worker: lag says idle, KEDA may scale it away
    assert stranded["lagCount"] == -1  # nil lag (go-redis: -1): inactive with 8 waiting
    groups = await aredis.xinfo_groups(STREAM)
    assert groups[0]["lag"] == 0  # after the drain the lag is known again
    assert steps[4][2]["pendingEntriesCount"] == 5 and steps[5][1] == 8


async def _answered_all(fleet: Fleet, request_ids: list[str]) -> bool:
    return set(request_ids) <= await fleet.answered()


async def _pending_is(redis: Any, count: int) -> bool:
    return int((await redis.xpending(STREAM, WORKER_GROUP))["pending"]) == count


async def test_a_nil_lag_is_what_redis_reports_after_an_out_of_order_delete(
    aredis: aioredis.Redis,
) -> None:
    """The same at the Redis level, without workers: the rule the scaler trips over."""
    await aredis.xgroup_create("s", "g", id="0", mkstream=True)
    ids = [await aredis.xadd("s", {"n": str(n)}) for n in range(10)]
    await aredis.xreadgroup("g", "c", {"s": ">"}, count=10)
    await aredis.xack("s", "g", *ids[5:])
    await aredis.xdel("s", *ids[5:])  # the later half finished first
    assert (await aredis.xinfo_groups("s"))[0]["lag"] == 0
    await aredis.xadd("s", {"n": "new"})
    assert (await aredis.xinfo_groups("s"))[0]["lag"] is None
    assert await aredis.xlen("s") == 6  # five pending + one new
