"""``lmq bench scaling``: the queue's overhead with fixed-latency workers (1, 2, 4, 8 of them).

What this measures is how close lmqueue's queue (client, Redis, reading and replying) comes to
n times one worker when the workers themselves cost nothing, not how a model scales. Each
worker runs the mock backend with a fixed time per batch (``batch_delay_s``, a GPU busy on a
forward pass: the worker's CPU is idle meanwhile) and precomputed vectors, so one worker's
ceiling is ``batch_size / batch_delay_s`` replies per second and n workers should reach n times
that, as long as the client, Redis and the machine's cores are not the bottleneck. The defaults
(float16 wire, 0.4 s per batch of 32: 80 replies/s a worker, 640 at 8) keep 8 workers at a third
of what lmqueue moves in float16 on a loaded 2-core machine (``lmq bench transport``), so the
figure measures the queue's overhead, not transport (BENCHMARKS.md explains the choice). Workers
are added in one run (1, then 1 more, then 2 more, ...); each count is measured once all its
workers send heartbeats.

With real work the machine's cores bound it instead: ``--hf`` (on by default) adds the figure
of `scaling_hf`, hf workers serving SmolLM2-135M, two workers on two cores against one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from lmqueue.producer import QueueLM
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .lib.load import Window, closed_loop, distinct_prompt
from .lib.report import DEFAULT_OUT_DIR, Report, save_figure
from .lib.stack import (
    CpuMeter,
    add_workers,
    connect_client,
    redis_server,
    server_pid,
    wait_for_workers,
    worker_pool,
)

__all__ = ["add_arguments", "run", "plot"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m", help="whose vocabulary sizes vectors")
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts, ascending")
    parser.add_argument("--batch-delay-s", type=float, default=0.4, help="simulated forward time")
    parser.add_argument("--batch-size", type=int, default=32, help="entries a worker reads")
    parser.add_argument("--dtype", default="float16", choices=["float32", "float16"])
    parser.add_argument(
        "--inflight-per-worker",
        type=int,
        default=128,
        help="calls outstanding per worker (4 batches of 32)",
    )
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also hf workers with real work, two against one (scaling_hf)",
    )
    parser.add_argument("--hf-model", default="smollm2-135m")
    parser.add_argument("--hf-measure-s", type=float, default=15.0)
    parser.add_argument(
        "--docs-plot", default="docs/scaling.png", help="where to copy the plot ('' for nowhere)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/scaling.json``."""
    report = Report("scaling", {k: str(v) for k, v in vars(args).items()})
    counts = [int(n) for n in args.workers.split(",")]
    per_s = asyncio.run(_run(args, counts, report))
    ceiling = args.batch_size / args.batch_delay_s
    report.figure(
        "ceiling_per_worker",
        round(ceiling, 1),
        line=f"mock ceiling: {ceiling:.1f} replies/s per worker",
    )
    png = plot(per_s, ceiling, args.out_dir / "scaling.png")
    if args.docs_plot:
        Path(args.docs_plot).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, args.docs_plot)
    report.figure(
        "plot",
        str(png),
        line=f"plot: {png}" + (f" (copied to {args.docs_plot})" if args.docs_plot else ""),
    )
    low, high = counts[0], counts[-1]
    speedup = per_s[high] / per_s[low] if per_s[low] else 0.0
    ratios = {
        f"{high}_over_{low}": round(speedup, 3),
        f"{high}_over_ideal": round(per_s[high] / (ceiling * high), 3),
    }
    summary = (
        f"scaling ratio (queue overhead, fixed-latency mock workers): {high} workers / {low} = "
        f"{speedup:.2f}x ({per_s[low]:.0f} -> {per_s[high]:.0f} replies/s)  "
        f"[target >= {0.875 * high:g}x]"
    )
    if args.hf:
        from .lib.scaling_hf import run_hf

        hf = run_hf(args.hf_model, args.warmup_s, args.hf_measure_s, report)
        ratios["hf_two_workers_over_one"] = hf["two_workers_over_one"]
        summary += f"; real work (hf, 1 thread each): 2 workers / 1 = {hf['two_workers_over_one']}x"
    return report.finish(ratios, summary, args.out_dir)


async def _run(args: argparse.Namespace, counts: list[int], report: Report) -> dict[int, float]:
    opts = {"distinct_vectors": 64, "batch_delay_s": args.batch_delay_s}
    env = {"LMQ_CACHE_WRITES": "0", "LMQ_BATCH_SIZE": str(args.batch_size)}
    per_s: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        spec: dict[str, Any] = dict(
            model=args.model,
            backend="mock",
            redis_url=server.url,
            tag="scaling",
            backend_opts=opts,
            env=env,
        )
        workers = stack.enter_context(worker_pool(0, **spec))
        settings = ClientSettings(
            redis=RedisSettings(url=server.url),
            wire_dtype=args.dtype,
            use_shared_cache=False,
            local_cache_size=0,
        )
        lm: QueueLM | None = None
        try:
            for n in counts:
                add_workers(workers, n - len(workers), **spec)
                await wait_for_workers(server.url, args.model, workers)
                lm = lm or await connect_client(args.model, settings, workers)
                pids = {
                    "client": [os.getpid()],
                    "workers": [w.pid for w in workers],
                    "redis": [server_pid(server)],
                }
                window = await _measure(lm, n, args, CpuMeter(pids))
                per_s[n] = window.fitted_per_s
                cpu = ", ".join(f"{k} {v:.0f}" for k, v in window.cpu_us_per_reply().items())
                line = f"{n} worker(s): {per_s[n]:7.1f} replies/s  CPU us/reply: {cpu}"
                report.figure(f"workers_{n}", window.as_dict(), line=line)
        finally:
            if lm is not None:
                await lm.close()
    return per_s


async def _measure(lm: QueueLM, n: int, args: argparse.Namespace, meter: CpuMeter) -> Window:
    """One window with `n` workers, keeping enough calls outstanding to keep them all busy."""

    async def call(index: int) -> None:
        await lm.next_token_logprobs(distinct_prompt(index, salt=n))

    inflight = args.inflight_per_worker * n
    return await closed_loop(call, inflight, args.warmup_s, args.measure_s, meter)


def plot(per_s: dict[int, float], ceiling_per_worker: float, path: Path) -> Path:
    """Throughput against workers, with the ideal line, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(per_s)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(counts, [per_s[n] for n in counts], "o-", label="lmqueue (measured)")
    ax.plot(
        counts,
        [per_s[counts[0]] * n / counts[0] for n in counts],
        "--",
        label="linear from the first point",
    )
    ax.plot(counts, [ceiling_per_worker * n for n in counts], ":", label="mock ceiling")
    ax.set_xlabel("worker processes")
    ax.set_ylabel("replies per second")
    ax.set_xticks(counts)
    for n in counts:
        ax.annotate(f"{per_s[n]:.0f}", (n, per_s[n]), textcoords="offset points", xytext=(-8, 8))
    ax.set_title(
        "Queue overhead: replies/s against worker processes\n"
        "(mock backend, fixed time per batch: no real work)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
