"""Scaling with real work: hf workers serving SmolLM2-135M, one against two (``lmq bench scaling``).

The mock figure of ``lmq bench scaling`` measures the queue's overhead with fixed-latency
workers: a sleeping worker uses no core, so eight of them scale on two cores. Real workers
compute, so a machine holds only as many as it has cores. This figure is what this machine can
hold: each configuration on a fresh worker pool, distinct 16-token prompts kept outstanding
(64 a worker), calls per second and CPU milliseconds per call (workers, client, Redis):

* ``1 worker x 1 thread``: one core computing;
* ``2 workers x 1 thread``: both cores, one process each (what adding a worker gives);
* ``1 worker x 2 threads``: both cores in one process (torch's own parallelism), for reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from lmqueue.shared.settings import ClientSettings, RedisSettings

from .load import closed_loop, distinct_prompt
from .report import Report
from .stack import CpuMeter, connect_client, redis_server, server_pid, wait_for_workers, worker_pool

__all__ = ["CONFIGS", "run_hf"]

#: (workers, torch threads each)
CONFIGS = ((1, 1), (2, 1), (1, 2))
PROMPT_TOKENS = 16
INFLIGHT_PER_WORKER = 64


async def _one(model: str, workers_n: int, threads: int, warmup_s: float, measure_s: float):
    env = {"LMQ_CACHE_WRITES": "0", "OMP_NUM_THREADS": str(threads)}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        workers = stack.enter_context(worker_pool(
            workers_n, model=model, backend="hf", redis_url=server.url, tag="scaling-hf", env=env,
        ))  # fmt: skip
        await wait_for_workers(server.url, model, workers)
        settings = ClientSettings(redis=RedisSettings(url=server.url), use_shared_cache=False,
                                  local_cache_size=0, wire_dtype="float16")  # fmt: skip
        async with await connect_client(model, settings, workers) as lm:

            async def call(index: int) -> None:
                await lm.next_token_logprobs(distinct_prompt(index, workers_n * 10 + threads,
                                                             PROMPT_TOKENS))  # fmt: skip

            meter = CpuMeter({
                "workers": [w.pid for w in workers], "client": [os.getpid()],
                "redis": [server_pid(server)],
            })  # fmt: skip
            inflight = INFLIGHT_PER_WORKER * workers_n
            return await closed_loop(call, inflight, warmup_s, measure_s, meter)


def run_hf(model: str, warmup_s: float, measure_s: float, report: Report) -> dict[str, Any]:
    """Every configuration in turn; calls/s and CPU ms per call of each, and 2 over 1."""
    figures: dict[str, Any] = {}
    for workers_n, threads in CONFIGS:
        window = asyncio.run(_one(model, workers_n, threads, warmup_s, measure_s))
        key = f"{workers_n}w_x_{threads}t"
        cpu_ms = {k: round(v / 1000, 2) for k, v in window.cpu_us_per_reply().items()}
        figures[key] = {**window.as_dict(), "cpu_ms_per_call": cpu_ms,
                        "load_avg": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
        report.figure(f"hf.{key}", figures[key], line=(
            f"hf {workers_n} worker(s) x {threads} torch thread(s): {window.per_s:6.1f} calls/s,"
            f" CPU ms/call {cpu_ms} (load average {figures[key]['load_avg']})"
        ))  # fmt: skip
    one, two = figures["1w_x_1t"]["replies_per_s"], figures["2w_x_1t"]["replies_per_s"]
    figures["two_workers_over_one"] = round(two / one, 3) if one else None
    return figures
