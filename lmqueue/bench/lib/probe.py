"""The raw Redis limit for full-vector replies, measured with redis-py alone.

The probe has lmqueue's process layout and Redis traffic without lmqueue: a producer in this
process (where a `QueueLM` would be) keeps `concurrency` small request entries outstanding on
one stream; a consumer-group reader in another process (where a worker would be,
`probe_reader`) answers each with a full vector on one reply stream. The producer trims what it
read and reads the next replies in one round trip, as `ReplyReader` does, views each payload
with ``np.frombuffer`` (no copy, no conversion), and sends as many new requests as replies
came. Both sides use the same client library and connection options as lmqueue, so the ratio
of the two is what lmqueue's own code costs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import numpy as np

from lmqueue.devstack import ChildProcess
from lmqueue.shared.connections import async_redis, sync_redis

from .load import Counter, Window, measure_window
from .probe_reader import READY, REPLIES, REQUESTS
from .stack import CpuMeter

__all__ = ["ProbeReader", "run_probe"]

_DTYPES = {"float32": "<f4", "float16": "<f2"}


class ProbeReader(ChildProcess):
    """The probe's consumer as a child process (``python -m lmqueue.bench.lib.probe_reader``)."""

    def __init__(self, url: str, dtype: str, size: int, batch: int = 32) -> None:
        args = [sys.executable, "-m", "lmqueue.bench.lib.probe_reader", "--url", url,
                "--dtype", dtype, "--size", str(size), "--batch", str(batch)]  # fmt: skip
        log_path = Path(tempfile.mkdtemp(prefix="lmq-probe-")) / "reader.log"
        super().__init__("probe-reader", args, log_path, stop_grace_s=10.0)
        self.url = url

    def start(self, timeout_s: float = 60) -> Self:
        """Start the reader and wait until its consumer group exists."""
        redis = sync_redis(self.url)
        try:
            redis.delete(READY)
            super().start()
            deadline = time.monotonic() + timeout_s
            while not redis.exists(READY):
                if not self.alive or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"probe reader did not start:\n{self.log()}")
                time.sleep(0.05)
        finally:
            redis.close()
        return self

    def close(self) -> None:
        """Stop the reader and remove its log."""
        self.stop()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)


async def run_probe(
    url: str,
    redis_pid: int,
    dtype: str,
    size: int,
    concurrency: int,
    warmup_s: float,
    measure_s: float,
) -> Window:
    """Measure replies per second of the raw probe on the Redis at `url`."""
    cleaner = sync_redis(url)
    cleaner.delete(REQUESTS, REPLIES)  # a previous run's leftovers would be read as replies
    cleaner.close()
    reader = ProbeReader(url, dtype, size).start()
    meter = CpuMeter({"client": [os.getpid()], "worker": [reader.pid], "redis": [redis_pid]})
    redis = async_redis(url)
    counter = Counter()
    stopping = asyncio.Event()
    producer = asyncio.create_task(_produce(redis, counter, concurrency, dtype, size, stopping))
    try:
        window = await measure_window(counter, warmup_s, measure_s, meter)
    finally:
        stopping.set()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await redis.aclose()
        reader.close()
    if producer.done() and not producer.cancelled() and producer.exception() is not None:
        raise RuntimeError("the probe producer failed") from producer.exception()
    return window


async def _produce(
    redis: object, counter: Counter, concurrency: int, dtype: str, size: int, stop: asyncio.Event
) -> None:
    sequence = itertools.count()
    code = _DTYPES[dtype]

    async def send(n: int) -> None:
        async with redis.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
            for _ in range(n):
                i = next(sequence)
                pipe.xadd(REQUESTS, {"id": str(i).encode(), "t": np.int32(i).tobytes()})
            await pipe.execute()

    await send(concurrency)
    last: bytes | None = None
    while not stop.is_set():
        async with redis.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
            if last is not None:
                pipe.xtrim(REPLIES, minid=_after(last), approximate=False)
            pipe.xread({REPLIES: last or "0-0"}, count=256, block=1000)
            results = await pipe.execute()
        if not results[-1]:
            continue
        entries = results[-1][0][1]
        for _, fields in entries:
            if np.frombuffer(fields[b"d"], dtype=code).size != size:
                raise ValueError("probe reply of the wrong size")
        counter.tick(len(entries))
        last = entries[-1][0]
        await send(len(entries))


def _after(entry_id: bytes) -> str:
    """The smallest stream id greater than `entry_id`."""
    ms, seq = entry_id.decode().split("-")
    return f"{ms}-{int(seq) + 1}"
