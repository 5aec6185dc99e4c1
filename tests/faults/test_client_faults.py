"""Clients that vanish before their replies, and clients that read replies slowly."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import DeadlineExceeded
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

from .harness import (
    KEYS,
    Figures,
    Load,
    assert_clean,
    connect,
    make_prompts,
    probe,
    settled_streams,
)

ROOT = Path(__file__).resolve().parents[2]
VECTOR_BYTES = 49152 * 4


async def test_a_client_killed_before_its_replies_leaves_nothing_behind(
    fault_redis, workers, record
):
    workers.spawn(fault_redis.url, 2, backend_opts={"batch_delay_s": 0.05},
                  env={"LMQ_REPLY_TTL_S": "2", "LMQ_CACHE_WRITES": "off"})  # fmt: skip
    async with probe(fault_redis.url) as redis:
        baseline = (await redis.info("memory"))["used_memory"]
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.abandoning_client", fault_redis.url, "300"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None
        with child.stdout:
            try:
                client_id = (await asyncio.to_thread(child.stdout.readline)).split()[1]
                child.send_signal(signal.SIGKILL)
            finally:
                child.kill()
                child.wait()
        started = time.monotonic()
        replies = KEYS.replies(client_id)
        peak_replies, peak_memory = 0, 0
        while await redis.exists(replies) or not peak_replies:
            peak_replies = max(peak_replies, await redis.xlen(replies))
            peak_memory = max(peak_memory, (await redis.info("memory"))["used_memory"])
            assert time.monotonic() - started < 30, "the reply stream never expired"
            await asyncio.sleep(0.05)
        gone_after_s = time.monotonic() - started
        await settled_streams(redis)
        after = (await redis.info("memory"))["used_memory"]
    figures = Figures(
        "kill -9 of a client before it read its 300 replies (reply TTL 2 s)", sent=300,
        time_s=gone_after_s,
        extra={
            "replies_left": peak_replies,
            "reply_stream_gone_after_s": round(gone_after_s, 1),
            "redis_mb_peak_over_baseline": _mb(peak_memory - baseline),
            "redis_mb_after_over_baseline": _mb(after - baseline),
        },
    )  # fmt: skip
    record(figures)
    assert peak_replies == 300 and after - baseline < 2_000_000


async def test_a_slow_reader_under_fast_workers_stays_within_its_inflight_bound(
    fault_redis, workers, reference, record
):
    workers.spawn(fault_redis.url, 2, env={"LMQ_CACHE_WRITES": "off"})
    peaks = {}
    for bound in (64, 100_000):
        async with connect(fault_redis.url, max_inflight=bound, read_count=16,
                           local_cache_size=0, use_shared_cache=False) as lm:  # fmt: skip
            _slow_down(lm, pause_s=0.05)
            load = Load(lm, make_prompts(1200, seed=10 + bound))
            running = asyncio.create_task(load.run(f"slow reader, max_inflight {bound}"))
            peaks[bound] = await _sample_peaks(fault_redis.url, KEYS.replies(lm.client_id), running)
            figures = load.check(await running, reference)
        figures.extra.update(peaks[bound])
        record(figures)
        assert_clean(figures)
    bounded = peaks[64]
    assert bounded["reply_stream_peak"] <= 64 + 16  # in flight, plus one read not yet trimmed
    assert bounded["redis_mb_peak_over_baseline"] < _mb(3 * (64 + 16) * VECTOR_BYTES)
    assert peaks[100_000]["reply_stream_peak"] > bounded["reply_stream_peak"]


def _slow_down(lm, pause_s: float) -> None:
    """Make the client's reply reader pause before every read, as a busy program would."""
    read = lm.channel.reader._read

    async def slow_read():
        await asyncio.sleep(pause_s)
        return await read()

    lm.channel.reader._read = slow_read


async def _sample_peaks(url: str, replies: str, running: asyncio.Task) -> dict[str, float]:
    """Peak reply-stream length, Redis memory and this process's RSS while `running` runs."""
    me = psutil.Process()
    async with probe(url) as redis:
        base_memory = (await redis.info("memory"))["used_memory"]
        base_rss = me.memory_info().rss
        stream = memory = rss = 0
        while not running.done():
            stream = max(stream, await redis.xlen(replies))
            memory = max(memory, (await redis.info("memory"))["used_memory"])
            rss = max(rss, me.memory_info().rss)
            await asyncio.sleep(0.02)
    return {
        "reply_stream_peak": stream,
        "redis_mb_peak_over_baseline": _mb(memory - base_memory),
        "client_rss_mb_peak_over_start": _mb(rss - base_rss),
    }


def _mb(count: int) -> float:
    return round(count / 1e6, 1)


async def test_callers_past_max_inflight_wait_for_a_slot_within_their_deadline(
    redis_url, smol_tokenizer
):
    served = ThreadedWorker(MockAsyncLM(smol_tokenizer), redis_url).start()
    served.stop()  # the model stays published; nobody answers
    async with await QueueLM.connect(
        "mock", redis_url=redis_url, timeout_s=0.5, max_inflight=2
    ) as lm:
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(lm.next_token_logprobs([1, n]) for n in range(5)), return_exceptions=True
        )
        elapsed_s = time.monotonic() - started
        assert lm.stats["sent"] <= 5 and len(lm.channel.inflight) == 0
        assert lm.channel.permits.free == 2  # every permit came back
    assert all(isinstance(outcome, DeadlineExceeded) for outcome in outcomes)
    assert elapsed_s < 0.5 + 0.5  # the waiters' deadlines ran while they waited
