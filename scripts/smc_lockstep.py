"""The queue's cost to one lock-step SMC program: the workload of ``lmq bench model`` (64
particles x 24 steps, a lipogram) through a `QueueLM` and one mock worker whose vectors are
precomputed (``distinct_vectors``: a call costs the backend nothing), on a private queue Redis
and cache Redis. Each step waits for all of its calls, so what a step costs here is what the
queue and the sampler add to every step of a real model's forward.

    python scripts/smc_lockstep.py [--rounds 5] [--particles 64] [--steps 24] [--timeline]

Prints, per round, calls/s, milliseconds a step and the client's and worker's CPU
milliseconds a step; with ``--timeline``, what a step's time is made of (its first answer,
the spread of its answers, the sampler's weighing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
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
from lmqueue.devstack import CACHE_POLICY
from lmqueue.scheduler import smc_sampler
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.workers.models import load_tokenizer

#: The tokenizer (and mock model) name; a GPU machine without the package passes a saved tokenizer.
MODEL = os.environ.get("GPU_TOKENIZER", "smollm2-135m")


async def _rounds(args: argparse.Namespace, queue: str, cache: str, workers: Any) -> None:
    tokenizer = load_tokenizer(MODEL)
    extend_all = smc_sampler._extend_all
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
            timeline = _Timeline(lm) if args.timeline else None
            if timeline is not None:
                smc_sampler._extend_all = timeline.weighing(extend_all)
            meter = CpuMeter({"client": [os.getpid()], "worker": [w.pid for w in workers]})
            with one_torch_thread():
                meter.start()
                started = time.perf_counter()
                result = await run.run(timeline or lm)
                wall = time.perf_counter() - started
                cpu = meter.stop()
            steps = max(result.steps, 1)
            print(
                f"round {index}: {result.calls / wall:7.0f} calls/s, {1000 * wall / steps:6.1f} ms"
                f" a step, CPU ms a step: "
                + ", ".join(f"{k} {1000 * v / steps:.1f}" for k, v in cpu.items()),
                flush=True,
            )
            if timeline is not None:
                print("  " + timeline.summary(), flush=True)
                print(f"  client stats {lm.stats}", flush=True)


class _Timeline:
    """`lm` for the sampler, recording when each call started and ended and when each step's
    weighing ran (all of a step's answers are in when it starts), to split a step's wall time:
    the wait for its first answer, the spread of its answers, the weighing. ``TIMELINE_ALL=1``
    prints every step: total, first answer, spread, last answer to weighing, weighing (ms)."""

    def __init__(self, lm: Any) -> None:
        self._lm = lm
        self._calls: list[tuple[float, float]] = []
        self._marks: list[tuple[float, float]] = []

    async def next_token_logprobs_numpy(self, prompt: list[int]) -> Any:
        started = time.perf_counter()
        row = await self._lm.next_token_logprobs_numpy(prompt)
        self._calls.append((started, time.perf_counter()))
        return row

    def weighing(self, extend_all: Any) -> Any:
        """`extend_all` (the sampler's step), timed."""

        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return extend_all(*args)
            finally:
                self._marks.append((started, time.perf_counter()))

        return timed

    def summary(self) -> str:
        """The round's medians (and every step with ``TIMELINE_ALL``); starts the next round."""
        marks, self._marks = self._marks, []
        calls, self._calls = sorted(self._calls), []
        steps: list[tuple[float, ...]] = []
        begin = calls[0][0] if calls else 0.0
        for weigh_start, weigh_end in marks:  # a step: its calls, then the sampler's weighing
            own = [call for call in calls if begin <= call[0] < weigh_start]  # sorted by start
            if own:
                ends = [end for _, end in own]
                steps.append((weigh_end - begin, min(ends) - own[0][0], max(ends) - min(ends),
                              weigh_start - max(ends), weigh_end - weigh_start))  # fmt: skip
            begin = weigh_end
        if os.environ.get("TIMELINE_ALL"):
            for step in steps:
                print("   step " + " ".join(f"{1000 * v:6.1f}" for v in step))
        if not steps:
            return "timeline: no steps"
        total, first, spread, settle, weigh = ([1000 * step[i] for step in steps] for i in range(5))
        return (
            f"timeline of {len(steps)} steps, medians (ms): step {statistics.median(total):.1f}"
            f" (slowest {max(total):.1f}) = first answer {statistics.median(first):.1f}"
            f" + answers spread {statistics.median(spread):.1f} + to the weighing"
            f" {statistics.median(settle):.1f} + weighing {statistics.median(weigh):.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--timeline", action="store_true", help="split each step's time")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        queue = stack.enter_context(redis_server())
        cache = stack.enter_context(redis_server("256mb", CACHE_POLICY))
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
