"""What crashed workers leave in Redis for good: consumers of the group, live-set members."""

from __future__ import annotations

import asyncio
import time

from lmqueue.shared.connections import async_redis
from lmqueue.shared.keys import WORKER_GROUP
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.workers.janitor import Janitor
from lmqueue.workers.request_stream import RequestStream

from .harness import KEYS, MODEL


async def test_the_janitor_deletes_consumers_idle_long_with_nothing_pending(fault_redis):
    redis = async_redis(fault_redis.url)
    settings = WorkerSettings(model=MODEL, backend="mock", name="live", dead_consumer_idle_ms=300,
                              redis=RedisSettings(url=fault_redis.url))  # fmt: skip
    stream = RequestStream(redis, KEYS.requests(MODEL), "live")
    try:
        await stream.ensure_group()
        for n in range(2):
            await redis.xadd(stream.stream, {"m": str(n)})
        ((_, [(done_id, _)]),) = await redis.xreadgroup(
            WORKER_GROUP, "ghost", {stream.stream: ">"}, count=1
        )
        await redis.xack(stream.stream, WORKER_GROUP, done_id)
        await redis.xreadgroup(WORKER_GROUP, "holder", {stream.stream: ">"}, count=1)
        await asyncio.sleep(0.4)
        now_ms = int(time.time() * 1000)
        await redis.zadd(KEYS.model_workers(MODEL), {"ghost": now_ms - 60_000, "live": now_ms})
        janitor = Janitor(stream, KEYS, settings)
        assert await janitor.prune_if_due() == 1
        assert [name for name, _, _ in await stream.consumers()] == ["holder"]
        assert not await stream.delete_consumer_if_idle("holder")  # it holds an entry
        assert await redis.zrange(KEYS.model_workers(MODEL), 0, -1) == [b"live"]
        assert await janitor.prune_if_due() == 0  # not due again yet
    finally:
        await redis.aclose()
