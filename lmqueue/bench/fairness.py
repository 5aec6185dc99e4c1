"""``lmq bench fairness``: one worker shared by tenants, against plain FIFO on one stream.

One mock worker whose batches cost in proportion to their tokens (``token_delay_s`` per prompt
token plus ``batch_delay_s`` per batch) is the bottleneck. In one run:

1. tenant B alone, a closed loop of 16 calls in flight: B's p50/p99 latency;
2. tenant A floods (2,000 calls in flight): A's throughput alone;
3. A keeps flooding while B runs its loop again: B's p99 under flood / alone (target <= 2.0),
   and the worker's throughput under flood / A's alone (work-conserving: >= 0.95);
4. the same two clients as *one* tenant, sharing one stream (today's FIFO): B's p99 ratio;
5. tenants C and D of weights 1 and 2, both backlogged: their served tokens (target 1:2
   within 10%).

Every client connects with its tenant's URL (ACL users made by `TenantAdmin`), so the figures
include what tenancy costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from lmqueue.producer import QueueLM
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

from .load import distinct_prompt, percentile
from .report import DEFAULT_OUT_DIR, Report, command_parser, save_figure
from .stack import connect_client, redis_server, wait_for_workers, worker_pool

__all__ = ["add_arguments", "run", "main", "plot"]

PROMPT_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m", help="whose vocabulary sizes vectors")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-delay-s", type=float, default=0.02, help="fixed cost a batch")
    parser.add_argument("--token-delay-s", type=float, default=0.0003, help="cost a prompt token")
    parser.add_argument("--light-inflight", type=int, default=16, help="tenant B's closed loop")
    parser.add_argument("--flood-inflight", type=int, default=2000, help="tenant A's flood")
    parser.add_argument("--weighted-inflight", type=int, default=300, help="C's and D's loops")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--docs-plot", default="docs/fairness.png", help="'' for nowhere")


@dataclass
class Loop:
    """A closed loop of calls on one client; latencies and completion times recorded."""

    lm: QueueLM
    concurrency: int
    salt: int
    done: list[tuple[float, float]] = field(default_factory=list)  # (finished at, latency)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False

    def start(self) -> Loop:
        counter = iter(range(1 << 62))

        async def one() -> None:
            while not self._stopping:
                prompt = distinct_prompt(next(counter), self.salt, PROMPT_TOKENS)
                started = time.perf_counter()
                await self.lm.next_token_logprobs(prompt)
                now = time.perf_counter()
                self.done.append((now, now - started))

        self._tasks = [asyncio.create_task(one()) for _ in range(self.concurrency)]
        return self

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the calls that finished in [start, end)."""
        return [latency for at, latency in self.done if start <= at < end]

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _window(args: argparse.Namespace) -> tuple[float, float]:
    await asyncio.sleep(args.warmup_s)
    start = time.perf_counter()
    await asyncio.sleep(args.measure_s)
    return start, time.perf_counter()


def _latencies(values: list[float]) -> dict[str, float]:
    return {
        "calls": len(values),
        "p50_s": round(percentile(values, 50), 4),
        "p99_s": round(percentile(values, 99), 4),
    }


async def _flood_and_light(
    args: argparse.Namespace, flood: QueueLM, light: QueueLM, salt: int
) -> dict[str, Any]:
    """B alone; A alone; A and B together: latencies and tokens per second."""
    b = Loop(light, args.light_inflight, salt).start()
    start, end = await _window(args)
    await b.stop()
    alone = _latencies(b.between(start, end))
    a = Loop(flood, args.flood_inflight, salt + 1).start()
    start, end = await _window(args)
    a_alone_per_s = len(a.between(start, end)) / (end - start)
    b = Loop(light, args.light_inflight, salt + 2).start()
    start, end = await _window(args)
    under = _latencies(b.between(start, end))
    both_per_s = (len(a.between(start, end)) + len(b.between(start, end))) / (end - start)
    await asyncio.gather(a.stop(), b.stop())
    return {
        "light_alone": alone,
        "light_under_flood": under,
        "p99_ratio": round(under["p99_s"] / alone["p99_s"], 3),
        "tokens_per_s_flood_alone": round(a_alone_per_s * PROMPT_TOKENS, 1),
        "tokens_per_s_flood_and_light": round(both_per_s * PROMPT_TOKENS, 1),
        "throughput_ratio": round(both_per_s / a_alone_per_s, 3) if a_alone_per_s else 0.0,
    }


async def _weighted(args: argparse.Namespace, c: QueueLM, d: QueueLM) -> dict[str, Any]:
    loops = [Loop(c, args.weighted_inflight, 50).start(), Loop(d, args.weighted_inflight, 51)]
    loops[1].start()
    start, end = await _window(args)
    await asyncio.gather(*(loop.stop() for loop in loops))
    served = [len(loop.between(start, end)) * PROMPT_TOKENS for loop in loops]
    return {
        "tokens_weight_1": served[0],
        "tokens_weight_2": served[1],
        "ratio_2_over_1": round(served[1] / served[0], 3) if served[0] else 0.0,
    }


async def _run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    opts = {
        "distinct_vectors": 64,
        "batch_delay_s": args.batch_delay_s,
        "token_delay_s": args.token_delay_s,
    }
    env = {"LMQ_CACHE_WRITES": "0", "LMQ_BATCH_SIZE": str(args.batch_size)}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        admin = redis.Redis.from_url(server.url)
        tenants = TenantAdmin(admin, server.url)
        configs = [TenantConfig("a"), TenantConfig("b"), TenantConfig("fifo"),
                   TenantConfig("c", weight=1), TenantConfig("d", weight=2)]  # fmt: skip
        urls = {config.name: tenants.add(config) for config in configs}
        admin.close()
        spec: dict[str, Any] = dict(model=args.model, backend="mock", redis_url=server.url,
                                    tag="fairness", backend_opts=opts, env=env)  # fmt: skip
        workers = stack.enter_context(worker_pool(1, **spec))
        await wait_for_workers(server.url, args.model, workers)
        clients: dict[str, QueueLM] = {}
        try:
            for name in ("a", "b", "fifo-a", "fifo-b", "c", "d"):
                url = urls[name.split("-")[0]]
                settings = ClientSettings(
                    redis=RedisSettings(url=url), wire_dtype="float16", use_shared_cache=False,
                    local_cache_size=0, timeout_s=600, max_inflight=4096,
                )  # fmt: skip
                clients[name] = await connect_client(args.model, settings, workers)
            fair = await _flood_and_light(args, clients["a"], clients["b"], salt=10)
            report.figure("fair_share", fair, line=_line("fair share", fair))
            fifo = await _flood_and_light(args, clients["fifo-a"], clients["fifo-b"], salt=20)
            report.figure("fifo", fifo, line=_line("FIFO (one stream)", fifo))
            weighted = await _weighted(args, clients["c"], clients["d"])
            report.figure("weights", weighted, line=f"weights 1:2: served tokens "
                          f"{weighted['tokens_weight_1']} : {weighted['tokens_weight_2']} = "
                          f"1 : {weighted['ratio_2_over_1']:.2f}")  # fmt: skip
        finally:
            await asyncio.gather(*(lm.close() for lm in clients.values()))
    return {"fair": fair, "fifo": fifo, "weights": weighted}


def _line(label: str, figures: dict[str, Any]) -> str:
    alone, under = figures["light_alone"], figures["light_under_flood"]
    return (
        f"{label}: B alone p50 {alone['p50_s'] * 1000:.0f} ms p99 {alone['p99_s'] * 1000:.0f} ms;"
        f" under flood p50 {under['p50_s'] * 1000:.0f} ms p99 {under['p99_s'] * 1000:.0f} ms"
        f" (x{figures['p99_ratio']:.2f}); throughput flood+B / flood alone "
        f"{figures['throughput_ratio']:.3f}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/fairness.json``."""
    logging.getLogger("lmqueue.tenant_admin").setLevel(logging.ERROR)  # no aclfile: expected
    report = Report("fairness", {k: str(v) for k, v in vars(args).items()})
    results = asyncio.run(_run(args, report))
    png = plot(results, args.out_dir / "fairness.png")
    if args.docs_plot:
        Path(args.docs_plot).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, args.docs_plot)
    report.figure("plot", str(png), line=f"plot: {png}")
    fair, fifo, weights = results["fair"], results["fifo"], results["weights"]
    ratios = {
        "p99_under_flood_over_alone": fair["p99_ratio"],
        "p99_under_flood_over_alone_fifo": fifo["p99_ratio"],
        "weighted_tokens_2_over_1": weights["ratio_2_over_1"],
        "throughput_under_flood_over_alone": fair["throughput_ratio"],
    }
    summary = (
        f"fairness: B's p99 under flood / alone {fair['p99_ratio']:.2f} (FIFO "
        f"{fifo['p99_ratio']:.2f}) [target <= 2.0]; weights 1:2 served "
        f"1:{weights['ratio_2_over_1']:.2f} [within 10%]; throughput under flood / alone "
        f"{fair['throughput_ratio']:.3f} [>= 0.95]"
    )
    return report.finish(ratios, summary, args.out_dir)


def plot(results: dict[str, Any], path: Path) -> Path:
    """B's p50/p99 alone and under flood, fair share beside FIFO, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    labels = ["B alone", "B under flood"]
    width = 0.2
    for i, (name, label) in enumerate((("fair", "fair share"), ("fifo", "FIFO (one stream)"))):
        figures = results[name]
        for j, q in enumerate(("p50_s", "p99_s")):
            values = [figures["light_alone"][q] * 1000, figures["light_under_flood"][q] * 1000]
            xs = [x + (2 * i + j - 1.5) * width for x in range(len(labels))]
            bars = ax.bar(xs, values, width, label=f"{label} {q[:3]}")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("latency of tenant B's calls (ms)")
    ax.set_yscale("log")
    ax.set_title("One worker, tenant A flooding (2,000 in flight), B with 16 in flight", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``lmq bench fairness [flags]``."""
    parser = command_parser("fairness", __doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
