"""A real worker process's metrics and probes, scraped over HTTP while it serves."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from lmqueue.devstack import LocalRedis, WorkerProcess, free_port
from lmqueue.producer.admission import Admission
from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes
from lmqueue.status import collect_status

MODEL = "smollm2-135m"
KEYS = KeySpace()
ENV = {"LMQ_HEARTBEAT_S": "0.3", "LMQ_BATCH_SIZE": "8", "LMQ_LOG_LEVEL": "INFO"}


async def get(url: str) -> tuple[int, str]:
    """Status and body of one real HTTP GET; (0, reason) when nothing listens."""

    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except (urllib.error.URLError, ConnectionError) as error:
            return 0, str(error)

    return await asyncio.to_thread(fetch)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        await asyncio.sleep(0.05)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    workers: list[WorkerProcess] = []
    yield workers
    for worker in workers:
        worker.stop(timeout_s=10)


async def send(redis: aioredis.Redis, requests: list[Request]) -> None:
    admission = Admission(redis, KEYS.requests(MODEL), max_backlog=0)
    await admission.enqueue([encode_request(r)["m"] for r in requests])


async def replies(redis: aioredis.Redis, client: str) -> dict[str, object]:
    rows = await redis.xrange(KEYS.replies(client))
    return {reply.request_id: reply for reply in (decode_reply(f) for _, f in rows)}


async def test_a_workers_counters_match_the_requests_sent(
    aredis: aioredis.Redis, redis_url: str, started: list[WorkerProcess], tmp_path: Path
) -> None:
    port = free_port()
    worker = WorkerProcess(MODEL, "mock", redis_url, "metered", env=ENV, log_dir=tmp_path,
                           extra_args=["--metrics-port", str(port)]).start()  # fmt: skip
    started.append(worker)
    base = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        assert worker.alive, worker.log()[-3000:]
        return (await get(f"{base}/readyz"))[0] == 200

    await until(ready, "readiness")
    past = int(time.time() * 1000) - 1000
    first = [Request(f"a{n}", "c1", ids_to_bytes([9, n]), claims=n < 4) for n in range(12)]
    refused = [Request(f"late{n}", "c1", ids_to_bytes([9, 100 + n]), deadline_ms=past)
               for n in range(3)]  # fmt: skip
    refused += [Request(f"oov{n}", "c1", ids_to_bytes([10**6 + n])) for n in range(2)]
    await send(aredis, first + refused)
    await aredis.xadd(KEYS.requests(MODEL), {"m": b"not msgpack"})  # dead-lettered

    async def answered(client: str, count: int) -> bool:
        return len(await replies(aredis, client)) == count

    await until(lambda: answered("c1", 17), "17 replies")
    again = [Request(f"b{n}", "c2", ids_to_bytes([9, n])) for n in range(12)]
    await send(aredis, again)  # the same prompts: the shared cache has them now
    await until(lambda: answered("c2", 12), "12 more replies")

    async def settled() -> bool:  # the heartbeat wrote the final counts to the stats hash
        status = await collect_status(aredis, KEYS, models=[MODEL])
        return status["models"][MODEL]["workers"].get("metered", {}).get("requests_total") == 29

    await until(settled, "the stats hash")
    status_code, text = await get(f"{base}/metrics")
    assert status_code == 200
    got = samples(text)

    def at(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted({"model": MODEL, **labels}.items()))), 0.0)

    assert at("lmq_requests_total", tenant="default", outcome="ok") == 24
    assert at("lmq_requests_total", tenant="default", outcome="DeadlineExceeded") == 3
    assert at("lmq_requests_total", tenant="default", outcome="TokenOutOfVocabulary") == 2
    assert at("lmq_dead_letters_total", tenant="default") == 1
    assert at("lmq_batch_requests_sum") == 30  # every entry read, the dead letter's too
    assert at("lmq_queue_wait_seconds_count", tenant="default") == 30
    assert at("lmq_e2e_request_seconds_count", tenant="default") == 30
    assert at("lmq_batch_tokens_sum") == 2 * 24  # admitted prompts only: refused ones cost none
    assert at("lmq_output_cache_misses_total", cache="shared") == 12
    assert at("lmq_output_cache_hits_total", cache="shared") == 12
    assert at("lmq_claim_checks_total") == 4 and at("lmq_claim_check_misses_total") == 0
    assert at("lmq_forward_seconds_count") >= 1
    assert time.time() - at("lmq_heartbeat_timestamp_seconds") < 10
    assert got[("process_resident_memory_bytes", ())] > 50 << 20


async def test_probes_flip_as_the_worker_starts_serves_and_stops(
    started: list[WorkerProcess], tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    queue = LocalRedis()  # not running yet: the worker starts before its Redis
    env = {**ENV, "LMQ_CONNECT_TIMEOUT_S": "0.5"}
    worker = WorkerProcess(
        MODEL, "mock", queue.url, "probed", {"batch_delay_s": 3.0}, env, log_dir=tmp_path,
        extra_args=["--metrics-port", str(port)],
    ).start()  # fmt: skip
    started.append(worker)
    try:

        async def answering() -> bool:
            assert worker.alive, worker.log()[-3000:]
            return (await get(f"{base}/readyz"))[0] != 0

        await until(answering, "the probe server")
        await asyncio.sleep(1.0)  # the model is loaded by now; Redis is still down
        assert await get(f"{base}/readyz") == (503, "loading\n")
        assert await get(f"{base}/healthz") == (503, "starting\n")
        queue.start()
        redis = aioredis.Redis.from_url(queue.url)

        async def ready() -> bool:
            return (await get(f"{base}/readyz"))[0] == 200

        await until(ready, "readiness once Redis is up")
        assert await get(f"{base}/healthz") == (200, "alive\n")
        await send(redis, [Request("slow", "c1", ids_to_bytes([5, 6]))])

        async def taken() -> bool:
            summary = await redis.xpending(KEYS.requests(MODEL), WORKER_GROUP)
            return int(summary["pending"]) == 1

        await until(taken, "the worker to take the request")
        assert worker.process is not None
        worker.process.terminate()  # SIGTERM while the batch computes (3 s)

        async def not_ready() -> bool:
            return await get(f"{base}/readyz") == (503, "stopping\n")

        await until(not_ready, "readiness to fail on SIGTERM", timeout_s=2)
        assert await get(f"{base}/healthz") == (200, "alive\n")  # draining is alive
        assert await asyncio.to_thread(worker.process.wait, 30) == 0
        assert "slow" in await replies(redis, "c1")  # finished within the grace period
        assert (await get(f"{base}/healthz"))[0] == 0  # gone
        await redis.aclose()
    finally:
        queue.close()
