"""The fairness question on a real model: ``lmq bench fairness --real-repeats N``.

One hf worker serves SmolLM2-135M. Tenant B runs a few SMC programs (`workload.Workload`:
the lipogram sampler, each program its own prompt variant and seed, one after another while
the window lasts); tenant A floods with distinct short prompts. B's latency is that of each
SMC step, one ``batch_next_token_logprobs`` call of all its particles, as a program waits for
it: first alone, then while A floods. On a real model a forward's cost is not a constant (it
grows with the batch's tokens, a KV-cache hit costs little), so this ratio says how much a
flood slows a light tenant's program, not only how fair the scheduler is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import redis

from lmqueue.producer import QueueLM
from lmqueue.shared.heap_freeze import freeze_heap
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

from .call_loop import Loop
from .report import Report
from .stack import connect_client, redis_server, wait_for_workers, worker_pool
from .tails import histogram_line, latency_figures, load_avg, spread, spread_lines
from .workload import Workload, bench_prompt

__all__ = ["add_arguments", "run_real"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The real-model experiment's flags (``lmq bench fairness``)."""
    parser.add_argument("--real-model", default="smollm2-135m")
    parser.add_argument("--real-programs", type=int, default=2, help="B's SMC programs")
    parser.add_argument("--real-particles", type=int, default=8)
    parser.add_argument("--real-flood-inflight", type=int, default=256, help="A's flood")
    parser.add_argument("--real-measure-s", type=float, default=20.0)


class _TimedLM:
    """Wraps a `QueueLM`: records how long each batch call (one SMC step) took."""

    def __init__(self, lm: QueueLM) -> None:
        self.lm = lm
        self.done: list[tuple[float, float]] = []  # (finished at, latency)

    async def batch_next_token_logprobs(self, prompts: list[list[int]]) -> Any:
        started = time.monotonic()
        rows = await self.lm.batch_next_token_logprobs(prompts)
        now = time.monotonic()
        self.done.append((now, now - started))
        return rows

    def between(self, start: float, end: float) -> list[float]:
        return [latency for at, latency in self.done if start <= at < end]


async def _programs(lm: _TimedLM, workload: Workload, variant: int, stop: asyncio.Event) -> None:
    """One of B's programs: SMC runs on its own prompt variant, one after another."""
    prompt = bench_prompt(lm.lm.tokenizer, len(workload.prompt), variant=variant)
    seed = variant * 1000
    while not stop.is_set():
        await workload.run(lm, prompt=prompt, seed=seed)
        seed += 1


async def _window(warmup_s: float, measure_s: float) -> tuple[float, float]:
    await asyncio.sleep(warmup_s)
    start = time.monotonic()
    await asyncio.sleep(measure_s)
    return start, time.monotonic()


async def _experiment(args: argparse.Namespace, flood: QueueLM, light: QueueLM) -> dict:
    workload = Workload.for_tokenizer(
        light.tokenizer, [bytes(t) for t in light.byte_vocab], 40,
        particles=args.real_particles, steps=12,
    )  # fmt: skip
    timed, stop = _TimedLM(light), asyncio.Event()
    programs = [
        asyncio.create_task(_programs(timed, workload, variant, stop))
        for variant in range(1, args.real_programs + 1)
    ]
    try:
        alone = await _window(args.warmup_s, args.real_measure_s)
        a = Loop(flood, args.real_flood_inflight, salt=77).start()
        under = await _window(args.warmup_s, args.real_measure_s)
        flood_per_s = len(a.between(*under)) / (under[1] - under[0])
        await a.stop()
    finally:
        stop.set()
        failed = [r for r in await asyncio.gather(*programs, return_exceptions=True) if r]
    if failed:
        raise RuntimeError(f"{len(failed)} of B's programs failed") from failed[0]
    alone_s, under_s = timed.between(*alone), timed.between(*under)
    a_fig, u_fig = latency_figures(alone_s), latency_figures(under_s)
    return {
        "light_alone": a_fig,
        "light_under_flood": u_fig,
        "light_alone_ms": [round(v * 1000, 1) for v in alone_s],
        "light_under_flood_ms": [round(v * 1000, 1) for v in under_s],
        "p99_ratio": round(u_fig["p99_s"] / a_fig["p99_s"], 3),
        "p50_ratio": round(u_fig["p50_s"] / a_fig["p50_s"], 3),
        "flood_calls_per_s": round(flood_per_s, 1),
        "load_avg": load_avg(),
    }


async def _run_once(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        admin = redis.Redis.from_url(server.url)
        tenants = TenantAdmin(admin, server.url)
        urls = {name: tenants.add(TenantConfig(name)) for name in ("a", "b")}
        admin.close()
        env = {"LMQ_CACHE_WRITES": "0"}
        workers = stack.enter_context(worker_pool(
            1, model=args.real_model, backend="hf", redis_url=server.url, tag="fairness-real",
            env=env,
        ))  # fmt: skip
        await wait_for_workers(server.url, args.real_model, workers)
        clients: list[QueueLM] = []
        try:
            for name in ("a", "b"):
                settings = ClientSettings(
                    redis=RedisSettings(url=urls[name]), use_shared_cache=False,
                    local_cache_size=0, timeout_s=600, max_inflight=4096,
                )  # fmt: skip
                clients.append(await connect_client(args.real_model, settings, workers))
            await asyncio.gather(
                *(lm.next_token_logprobs([1, 2, 3, i]) for i, lm in enumerate(clients))
            )  # cold start (fairness._first_calls)
            freeze_heap()
            return await _experiment(args, clients[0], clients[1])
        finally:
            await asyncio.gather(*(lm.close() for lm in clients))


def run_real(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """`args.real_repeats` runs; each printed, then the worst and median p99 ratio."""
    runs = []
    for i in range(1, args.real_repeats + 1):
        figures = asyncio.run(_run_once(args))
        runs.append(figures)
        alone, under = figures["light_alone"], figures["light_under_flood"]
        report.figure(f"real_model.run{i}", figures, line=(
            f"real model run {i} ({args.real_model}, {args.real_programs} SMC programs x "
            f"{args.real_particles} particles vs a flood of {args.real_flood_inflight}): "
            f"B's step alone p50 {alone['p50_s'] * 1000:.0f} ms p99 {alone['p99_s'] * 1000:.0f}"
            f" ms ({alone['calls']} steps); under flood p50 {under['p50_s'] * 1000:.0f} ms p99 "
            f"{under['p99_s'] * 1000:.0f} ms p99.9 {under['p999_s'] * 1000:.0f} ms "
            f"({under['calls']} steps); p99 x{figures['p99_ratio']:.2f}, p50 "
            f"x{figures['p50_ratio']:.2f}; flood {figures['flood_calls_per_s']} calls/s "
            f"(load average {figures['load_avg']})\n"
            f"    B alone (ms): {histogram_line(alone)}\n"
            f"    B under flood: {histogram_line(under)}"
        ))  # fmt: skip
    keyed = [dataclasses.asdict(_Key(r["p99_ratio"], r["p50_ratio"], r["load_avg"])) for r in runs]
    summary = spread(keyed, {"p99_ratio": True, "p50_ratio": True})
    report.figure("real_model.spread", summary, line="\n  ".join(spread_lines(keyed, summary)))
    return {"runs": runs, "summary": summary}


@dataclasses.dataclass
class _Key:
    p99_ratio: float
    p50_ratio: float
    load_avg: str
