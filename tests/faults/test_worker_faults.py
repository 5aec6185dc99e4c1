"""Workers that die, freeze or run long batches: another worker finishes their requests."""

from __future__ import annotations

import asyncio
import signal

from .harness import Load, assert_clean, connect, make_prompts, pending_of, probe, settled_streams

#: Workers that give up on a silent peer after 1 s, in batches of 16 that take 0.1 s each.
FAST_RECLAIM = {"LMQ_CLAIM_IDLE_MS": "1000", "LMQ_BATCH_SIZE": "16"}


async def test_a_worker_killed_mid_batch_leaves_no_request_unanswered(
    fault_redis, workers, reference, record
):
    victim, _ = workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.1}, env=FAST_RECLAIM
    )
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, make_prompts(600, seed=1))
        running = asyncio.create_task(load.run("kill -9 of a worker mid-batch"))
        held = await _until_holding(redis, victim.name)
        victim.signal(signal.SIGKILL)
        figures = load.check(await running, reference)
        left = await settled_streams(redis)
    figures.extra.update(killed_holding=held, dead_letters=left["dead_letters"])
    record(figures)
    assert_clean(figures)
    assert held > 0 and left["dead_letters"] == 0


async def test_a_frozen_worker_is_overtaken_and_its_late_replies_are_resolved_once(
    fault_redis, workers, reference, record
):
    victim, _ = workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.1}, env=FAST_RECLAIM
    )
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, make_prompts(600, seed=2))
        running = asyncio.create_task(load.run("SIGSTOP of a worker for 3 s (claim timeout 1 s)"))
        held = await _until_holding(redis, victim.name)
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(3.0)
        victim.signal(signal.SIGCONT)
        figures = load.check(await running, reference)
        await asyncio.sleep(1.0)  # the thawed worker's late replies arrive
        figures.duplicates = lm.stats["duplicate_replies"]
        left = await settled_streams(redis)
    figures.extra.update(frozen_holding=held, dead_letters=left["dead_letters"])
    record(figures)
    assert_clean(figures)
    assert figures.duplicates > 0, "the thawed worker should have answered its batch again"
    assert victim.alive


async def test_a_batch_longer_than_the_claim_timeout_keeps_its_claims(
    fault_redis, workers, reference, record
):
    pool = workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 2.5},
        env={"LMQ_CLAIM_IDLE_MS": "1000", "LMQ_BATCH_SIZE": "32", "LMQ_MAX_WAIT_MS": "50"},
    )  # fmt: skip
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, make_prompts(128, seed=3))
        figures = load.check(await load.run("2.5 s batches, claim timeout 1 s"), reference)
        await settled_streams(redis)
    reclaimed = sum(w.log().count("reclaimed idle entry") for w in pool)
    figures.extra.update(reclaimed=reclaimed)
    record(figures)
    assert_clean(figures)
    assert reclaimed == 0 and figures.duplicates == 0


async def _until_holding(redis, consumer: str) -> int:
    """Wait until `consumer` holds entries it has not acknowledged (it is mid-batch)."""
    for _ in range(1000):
        held = await pending_of(redis, consumer)
        if held:
            return held
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{consumer} never held a batch")
