"""``lmq bench affinity``: do a program's calls meet their KV when two workers share the stream?

The HF backend reuses the KV of every prefix it computed (``workers/backends/prefix_cache.py``),
so an SMC particle's next call costs one new position, if it reaches the worker that computed
its prefix. With one stream that every worker reads, a call lands on either worker and the
other one recomputes the particle's tokens since its last visit. With partitioned streams and
prefix affinity, all calls of a prompt's lineage go to the partition of its leading tokens,
which one worker owns. In one run, three configurations of the same workload:

* ``single``: one worker (the reference: every prefix is computed once);
* ``off``: two workers on one stream (``--partitions 1``, today's default);
* ``on``: two workers on ``--partitions N`` streams (affinity).

Each configuration starts a fresh Redis and fresh workers (empty KV caches); one client process
runs 8 independent SMC programs at once (`workload.Workload`, 16 particles each, each on its own
~100-token prompt variant and seed). The primary figure, free of this machine's 2 shared cores,
is **prompt tokens computed per call**: the positions the workers ran through the model
(``lmq_tokens_total{kind="computed"}`` on their metrics endpoints, read before and after) over
the calls the programs made. Target: ``on`` within 1.25x of ``single``. Secondary: calls/s and
the workers' CPU seconds per call. Each worker gets the machine's cores divided by the
workers (``OMP_NUM_THREADS``): two workers with two torch threads each on two cores spin.

Why N = 16 by default: a partition is the unit a worker owns, so N bounds how evenly N
partitions split over the live workers (16 over 2 workers: 8 each, and still 5-6 each over 3),
while every partition costs one more stream in each worker's read and claim loops. 16 keeps a
small fleet's shares even at a cost of 16 keys per read; a fleet of tens of workers wants more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmqueue.devstack import free_port
from lmqueue.shared.settings import ClientSettings

from .lib.report import DEFAULT_OUT_DIR, Report, save_figure
from .lib.stack import (
    CpuMeter,
    add_workers,
    connect_client,
    redis_server,
    wait_for_workers,
    worker_pool,
)
from .lib.workload import Workload, bench_prompt

__all__ = ["add_arguments", "run", "plot", "scrape_tokens"]

#: (name, workers, whether its streams are partitioned).
CONFIGS = (("single", 1, False), ("off", 2, False), ("on", 2, True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--programs", type=int, default=8, help="independent SMC programs")
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=16, help="N of the 'on' configuration")
    parser.add_argument(
        "--steal-after-ms", type=int, help="LMQ_STEAL_AFTER_MS of the workers (their default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900, help="a call's deadline")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--docs-plot", default="docs/affinity.png", help="'' for nowhere")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/affinity.json``."""
    report = Report("affinity", {k: str(v) for k, v in vars(args).items()})
    figures: dict[str, dict[str, Any]] = {}
    for name, workers, partitioned in CONFIGS:
        partitions = args.partitions if partitioned else 1
        figures[name] = _configuration(args, name, workers, partitions)
        report.figure(name, figures[name], line=_line(name, figures[name]))
    ratios, summary = _ratios(figures)
    if args.docs_plot:
        plot(figures, Path(args.docs_plot))
    return report.finish(ratios, summary, args.out_dir)


def _configuration(
    args: argparse.Namespace, name: str, count: int, partitions: int
) -> dict[str, Any]:
    """One configuration on a fresh Redis and fresh workers: its calls, tokens and rates."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        spec = dict(model=args.model, backend="hf", redis_url=server.url, tag=f"affinity-{name}")
        workers = stack.enter_context(worker_pool(0, **spec))
        ports = []
        threads = max(1, (os.cpu_count() or 1) // count)  # the cores shared, not oversubscribed
        for _ in range(count):  # one metrics port each
            ports.append(free_port())
            env = {
                "LMQ_PARTITIONS": str(partitions),
                "LMQ_METRICS_PORT": str(ports[-1]),
                "OMP_NUM_THREADS": str(threads),
            }
            if args.steal_after_ms is not None:
                env["LMQ_STEAL_AFTER_MS"] = str(args.steal_after_ms)
            add_workers(workers, 1, env=env, **spec)
        asyncio.run(wait_for_workers(server.url, args.model, workers))
        _wait_for_ownership(ports, partitions if partitions > 1 else 0)
        before = [scrape_tokens(port) for port in ports]
        meter = CpuMeter({"workers": [w.pid for w in workers]})
        meter.start()
        figures = asyncio.run(_programs(args, server.url, workers))
        figures["worker_cpu_s"] = round(meter.stop()["workers"], 2)
        after = [scrape_tokens(port) for port in ports]
    per_worker = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before, strict=True)]
    calls = figures["calls"]
    computed = int(sum(w["computed"] for w in per_worker))
    stolen = int(sum(w["stolen"] for w in per_worker))
    reused = int(sum(w["reused"] for w in per_worker))
    return {
        **figures,
        "workers": count,
        "partitions": partitions,
        "computed_tokens": computed,
        "reused_tokens": reused,
        "computed_per_call": round(computed / calls, 3),
        "stolen_entries": stolen,
        "worker_cpu_ms_per_call": round(figures["worker_cpu_s"] * 1000 / calls, 2),
        "per_worker": per_worker,
    }


async def _programs(
    args: argparse.Namespace, redis_url: str, workers: Sequence[Any]
) -> dict[str, Any]:
    """Run every program at once through one client; their calls and wall time."""
    settings = ClientSettings.resolve(None, redis_url, timeout_s=args.timeout_s)
    lm = await connect_client(args.model, settings, workers)
    try:
        byte_vocab = [bytes(t) for t in lm.byte_vocab]
        base = Workload.for_tokenizer(
            lm.tokenizer, byte_vocab, args.prompt_tokens, particles=args.particles,
            steps=args.steps, seed=args.seed,
        )  # fmt: skip
        programs = [
            dataclasses.replace(
                base,
                prompt=bench_prompt(lm.tokenizer, args.prompt_tokens, variant=i),
                seed=args.seed + i,
            )
            for i in range(1, args.programs + 1)
        ]
        started = time.monotonic()
        results = await asyncio.gather(*(p.run(lm) for p in programs))
        wall_s = time.monotonic() - started
        partitions_seen = getattr(lm.info, "partitions", None)
    finally:
        await lm.close()
    calls = sum(r.calls for r in results)
    return {
        "programs": len(programs),
        "calls": calls,
        "wall_s": round(wall_s, 2),
        "calls_per_s": round(calls / wall_s, 2),
        "partitions_in_registry": partitions_seen,
    }


def scrape_tokens(port: int, timeout_s: float = 30.0) -> dict[str, float]:
    """A worker's prompt positions so far (computed, reused) and requests answered.

    Read from its ``/metrics`` endpoint, retried until it answers (it starts with the worker).
    """
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                text = answer.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    out = {"computed": 0.0, "reused": 0.0, "requests": 0.0, "stolen": 0.0, "owned": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lmq_tokens_total" and sample.labels.get("kind") in out:
                out[sample.labels["kind"]] += sample.value
            elif sample.name == "lmq_requests_total":
                out["requests"] += sample.value
            elif sample.name == "lmq_stolen_entries_total":
                out["stolen"] += sample.value
            elif sample.name == "lmq_partitions_owned":
                out["owned"] = sample.value
    return out


def _wait_for_ownership(ports: Sequence[int], partitions: int, timeout_s: float = 30) -> None:
    """Wait until the workers' owned partitions add up to `partitions` (0: nothing to wait
    for): a worker that started alone owns everything until its next refresh sees the other,
    and calls sent meanwhile would start lineages on either."""
    deadline = time.monotonic() + timeout_s
    while partitions and sum(scrape_tokens(port)["owned"] for port in ports) != partitions:
        if time.monotonic() > deadline:
            raise TimeoutError(f"partition ownership did not settle in {timeout_s} s")
        time.sleep(0.2)


def _line(name: str, f: dict[str, Any]) -> str:
    shares = "/".join(f"{w['requests']:.0f}" for w in f["per_worker"])
    return (
        f"{name:<6} {f['workers']} worker(s), {f['partitions']:>2} partition(s): "
        f"{f['computed_per_call']:6.2f} prompt tokens computed per call ({f['computed_tokens']} "
        f"computed, {f['reused_tokens']} reused, {f['calls']} calls), {f['calls_per_s']:6.1f} "
        f"calls/s, worker CPU {f['worker_cpu_ms_per_call']:.1f} ms/call, requests by worker "
        f"{shares}, {f['stolen_entries']} stolen"
    )


def _ratios(figures: dict[str, dict[str, Any]]) -> tuple[dict[str, float], str]:
    single = figures["single"]
    ratios: dict[str, float] = {}
    for name in ("on", "off"):
        f = figures[name]
        ratios[f"{name}_tokens"] = round(f["computed_per_call"] / single["computed_per_call"], 3)
        ratios[f"{name}_calls_per_s"] = round(f["calls_per_s"] / single["calls_per_s"], 3)
    summary = (
        f"affinity ratio 2 workers/1 worker, prompt tokens computed per call: "
        f"on {ratios['on_tokens']:.2f}x, off {ratios['off_tokens']:.2f}x; calls/s: "
        f"on {ratios['on_calls_per_s']:.2f}x, off {ratios['off_calls_per_s']:.2f}x  "
        f"[target: on <= 1.25x tokens]"
    )
    return ratios, summary


def plot(figures: dict[str, dict[str, Any]], path: Path) -> Path:
    """Tokens computed per call and calls/s of the three configurations, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, _, _ in CONFIGS]
    labels = [f"{n}\n{figures[n]['workers']} w x {figures[n]['partitions']} p" for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.5), dpi=120)
    for ax, key, title in (
        (left, "computed_per_call", "prompt tokens computed per call"),
        (right, "calls_per_s", "calls/s (2 shared cores)"),
    ):
        bars = ax.bar(labels, [figures[name][key] for name in names], color=["C0", "C3", "C2"])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("8 SMC programs x 16 particles on SmolLM2-135M (hf): affinity on/off", fontsize=9)
    return save_figure(fig, path)
