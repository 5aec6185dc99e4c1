"""Requests that fail their batch, exhaust the device, or kill the worker that runs them."""

from __future__ import annotations

import asyncio
from typing import Any

from lmqueue.shared.errors import DeadLettered, ModelError
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes, payload_bytes
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.processor import BatchProcessor
from lmqueue.workers.request_stream import Entry

from .harness import KEYS, MODEL, Load, assert_clean, connect, make_prompts, probe, settled_streams

POISON, CRASH = 666, 777


async def test_poison_requests_get_model_errors_and_their_batch_mates_results(
    fault_redis, workers, reference, record
):
    workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.02, "poison_token": POISON},
        env={"LMQ_BATCH_SIZE": "16"},
    )  # fmt: skip
    prompts = make_prompts(400, seed=4)
    poisoned = {index: ModelError for index in range(0, 400, 40)}
    for index in poisoned:
        prompts[index] = [*prompts[index], POISON]
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, prompts, poisoned)
        figures = load.check(await load.run("poison requests (fail their whole batch)"), reference)
        left = await settled_streams(redis)
    figures.extra.update(poison_requests=len(poisoned), dead_letters=left["dead_letters"])
    record(figures)
    assert_clean(figures, {"ModelError": len(poisoned)})


async def test_a_batch_too_large_for_the_device_is_split_until_it_fits(
    fault_redis, workers, reference, record
):
    (worker,) = workers.spawn(
        fault_redis.url, 1, backend_opts={"batch_delay_s": 0.01, "oom_batch_size": 4},
        env={"LMQ_BATCH_SIZE": "32", "LMQ_MAX_WAIT_MS": "20"},
    )  # fmt: skip
    async with connect(fault_redis.url) as lm, probe(fault_redis.url) as redis:
        load = Load(lm, make_prompts(200, seed=5))
        figures = load.check(await load.run("out of memory above 4 prompts a batch"), reference)
        await settled_streams(redis)
    figures.extra.update(splits=worker.log().count("a forward failed"))
    record(figures)
    assert_clean(figures)
    assert figures.extra["splits"] > 0


async def test_a_request_that_kills_every_worker_running_it_is_dead_lettered(
    fault_redis, workers, reference, record
):
    env = {"LMQ_CLAIM_IDLE_MS": "1000", "LMQ_MAX_DELIVERIES": "2", "LMQ_BATCH_SIZE": "8"}
    pool = workers.spawn(
        fault_redis.url, 2, backend_opts={"batch_delay_s": 0.05, "crash_token": CRASH}, env=env
    )
    prompts = make_prompts(200, seed=6)
    prompts[50] = [*prompts[50], CRASH]
    crashes = 0

    async def supervise() -> None:  # restarts dead workers under their names, as systemd would
        nonlocal crashes
        while True:
            for worker in pool:
                if not worker.alive:
                    crashes += 1
                    worker.start()
            await asyncio.sleep(0.1)

    async with connect(fault_redis.url, timeout_s=90) as lm, probe(fault_redis.url) as redis:
        supervisor = asyncio.create_task(supervise())
        try:
            load = Load(lm, prompts, {50: DeadLettered})
            figures = load.check(await load.run("a request that kills its worker"), reference)
            left = await settled_streams(redis)
            dead = await redis.xrange(KEYS.dead_letters(MODEL))
        finally:
            supervisor.cancel()
    figures.extra.update(worker_crashes=crashes, dead_letters=left["dead_letters"])
    record(figures)
    assert_clean(figures, {"DeadLettered": 1})
    assert crashes == 2 and len(dead) == 1  # max_deliveries, each alone: no batch-mate charged
    assert dead[0][1][b"lmq.reason"].startswith(b"DeadLettered")


class _WindowBatching(MockAsyncLM):
    """Gathers calls for 5 ms before each batch, as engines with a batching window do."""

    async def _run_batch(self) -> None:
        await asyncio.sleep(0.005)
        await super()._run_batch()


async def test_another_batchs_poison_never_becomes_this_batchs_error(smol_tokenizer):
    backend = _WindowBatching(smol_tokenizer, batch_delay_s=0.01, poison_token=POISON)
    processor = BatchProcessor(backend, cache=None)
    wrong = 0
    for trial in range(10):  # two batches in flight at once, as a worker with prefetch has
        poisoned = [_entry("a", i, [1, i, trial]) for i in range(15)] + [_entry("a", 15, [POISON])]
        clean = [_entry("b", i, [2, i, trial]) for i in range(16)]
        _, outcome = await asyncio.gather(processor.process(poisoned), processor.process(clean))
        wrong += sum(not decode_reply(_as_read(fields)).ok for _, fields in outcome.replies)
    assert wrong == 0


def _entry(client: str, n: int, tokens: list[int]) -> Entry:
    request = Request(f"{client}:{n}", client, ids_to_bytes(tokens))
    return Entry(f"1-{n}", _as_read(encode_request(request)))


def _as_read(fields: dict[str, Any]) -> dict[bytes, Any]:
    """Reply fields as a client reads them (deferred payloads made into bytes, as written)."""
    return {key.encode(): payload_bytes(value) for key, value in fields.items()}
