"""The queue's cost to one lock-step SMC program: the workload of ``lmq bench model`` (64
particles x 24 steps, a lipogram) through a `QueueLM` and one mock worker whose vectors are
precomputed (``distinct_vectors``: a call costs the backend nothing), on a private queue Redis
and cache Redis. Each step waits for all of its calls, so what a step costs here is what the
queue and the sampler add to every step of a real model's forward.

    python scripts/smc_lockstep.py [--rounds 5] [--particles 64] [--steps 24]

Prints, per round, calls/s, milliseconds a step and the client's and worker's CPU
milliseconds a step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any

from lmqueue.bench.lib.stack import (
    CpuMeter,
    connect_client,
    redis_server,
    wait_for_workers,
    worker_pool,
)
from lmqueue.bench.lib.workload import Workload, bench_prompt, one_torch_thread
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.workers.models import load_tokenizer

MODEL = "smollm2-135m"


async def _rounds(args: argparse.Namespace, queue: str, cache: str, workers: Any) -> None:
    tokenizer = load_tokenizer(MODEL)
    workload = Workload.for_tokenizer(
        tokenizer, decode_vocab(tokenizer)[0], 100, particles=args.particles,
        steps=args.steps, seed=0,
    )  # fmt: skip
    settings = ClientSettings(redis=RedisSettings(url=queue, cache_url=cache))
    async with await connect_client(MODEL, settings, workers) as lm:
        for index in range(args.rounds):  # each round its own prompt: no answer is cached
            run = dataclasses.replace(
                workload, seed=index, prompt=bench_prompt(tokenizer, 100, variant=index + 1)
            )
            await lm.next_token_logprobs(run.prompt)
            meter = CpuMeter({"client": [os.getpid()], "worker": [w.pid for w in workers]})
            with one_torch_thread():
                meter.start()
                started = time.perf_counter()
                result = await run.run(lm)
                wall = time.perf_counter() - started
                cpu = meter.stop()
            steps = max(result.steps, 1)
            print(
                f"round {index}: {result.calls / wall:7.0f} calls/s, {1000 * wall / steps:6.1f} ms"
                f" a step, CPU ms a step: "
                + ", ".join(f"{k} {1000 * v / steps:.1f}" for k, v in cpu.items()),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        queue = stack.enter_context(redis_server())
        cache = stack.enter_context(redis_server("256mb", "allkeys-lru"))
        workers = stack.enter_context(
            worker_pool(
                1,
                model=MODEL,
                backend="mock",
                backend_opts={"distinct_vectors": 64},
                redis_url=queue.url,
                cache_url=cache.url,
                tag="lockstep",
            )  # fmt: skip
        )
        asyncio.run(wait_for_workers(queue.url, MODEL, workers))
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
        asyncio.run(_rounds(args, queue.url, cache.url, workers))
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
