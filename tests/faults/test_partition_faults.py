"""A partition's owner killed mid-batch: its pending entries are reclaimed and answered once.

Two mock workers serve a model split into 4 partitions, each preferring the two it owns. The
victim is killed (SIGKILL) while it holds unacknowledged entries of its own partitions; the
survivor's janitor reclaims them, its reader steals the victim's partitions while they are
orphaned and owns all four once the victim's heartbeat has expired.
"""

from __future__ import annotations

import asyncio
import signal

import redis

from lmqueue.shared.keys import WORKER_GROUP, KeySpace

from .harness import MODEL, Load, assert_clean, connect, make_prompts, probe, until
from .test_worker_faults import FAST_RECLAIM

PARTITIONS = 4
KEYS = KeySpace()


async def test_a_partition_owner_killed_mid_batch_leaves_no_request_unanswered(
    fault_redis, workers, reference, record
):
    env = {**FAST_RECLAIM, "LMQ_PARTITIONS": str(PARTITIONS), "LMQ_HEARTBEAT_S": "0.5"}
    victim, _ = workers.spawn(fault_redis.url, 2, backend_opts={"batch_delay_s": 0.1}, env=env)
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis_probe:
        load = Load(lm, make_prompts(600, seed=21))
        running = asyncio.create_task(load.run("kill -9 of a partition owner mid-batch"))
        held = await until(lambda: _held_by(redis_probe, victim.name), every_s=0.005)
        victim.signal(signal.SIGKILL)
        figures = load.check(await running, reference)
        left = await until(lambda: _all_settled(redis_probe), timeout_s=30, every_s=0.1)
    figures.extra.update(killed_holding=held)
    record(figures)
    assert_clean(figures)
    assert sum(held.values()) > 0 and left == {"queued": 0, "pending": 0, "dead_letters": 0}


async def _held_by(redis_probe, consumer: str) -> dict[int, int] | None:
    """What `consumer` holds unacknowledged in each partition, once it holds any."""
    held = {}
    for partition in range(PARTITIONS):
        try:
            summary = await redis_probe.xpending(KEYS.requests(MODEL, partition), WORKER_GROUP)
        except redis.ResponseError:
            return None
        rows = {_text(row["name"]): int(row["pending"]) for row in summary.get("consumers") or []}
        held[partition] = rows.get(consumer, 0)
    return held if sum(held.values()) else None


async def _all_settled(redis_probe) -> dict[str, int] | None:
    left = {"queued": 0, "pending": 0, "dead_letters": 0}
    for partition in range(PARTITIONS):
        stream = KEYS.requests(MODEL, partition)
        left["queued"] += int(await redis_probe.xlen(stream))
        left["pending"] += int((await redis_probe.xpending(stream, WORKER_GROUP))["pending"])
    left["dead_letters"] = int(await redis_probe.xlen(KEYS.dead_letters(MODEL)))
    return left if not left["queued"] and not left["pending"] else None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
