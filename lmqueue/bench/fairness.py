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
include what tenancy costs. The flooding client runs in a process of its own (`LoopProcess`),
as a tenant's program would: sharing this one's event loop, its 2,000 calls delayed the light
tenant's next calls after each reply. ``--repeats N`` runs it all N times (a fresh Redis and
worker each) and prints every run's figures, then the worst and the median; B's latencies are
printed as p50/p99/p99.9/max and a histogram, and plotted as a CDF, so a tail shows at a
glance. ``--real-repeats`` adds the same question on a real model (`fairness_model`).
``--forward-ms`` scales the mock's costs so that a full batch takes that long (3: a GPU
forward; the default is ~97 ms, a CPU one), and ``--workers N`` shares every tenant, B's closed
loop included, between N workers.

The other tenants' clients live in this one process, whose heap (torch; the flood's 2,000
calls in flight, before it had a process of its own) made Python's full garbage collections
take 250-800 ms here: one landing in B's window holds B's replies like a held forward would.
So this process and the flood's freeze their start-up heaps before measuring (as the worker
does, see ``Worker``), and this one reports the pauses it still saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import redis

from lmqueue.producer import QueueLM
from lmqueue.shared import stage_trace
from lmqueue.shared.heap_freeze import freeze_heap
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

from .lib.call_loop import PROMPT_TOKENS, Loop, fairness_client_settings
from .lib.fairness_model import add_arguments as add_real_model_arguments
from .lib.fairness_model import run_real
from .lib.fairness_plot import plot
from .lib.load import distinct_prompt
from .lib.loop_process import LoopProcess
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import connect_client, redis_server, wait_for_workers, worker_pool
from .lib.stage_report import idle_gaps, read_marks, report_lines, round_trips, spread_of
from .lib.tails import GcPauses, histogram_line, latency_figures, load_avg, spread, spread_lines

__all__ = ["add_arguments", "mock_costs", "run", "plot"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m", help="whose vocabulary sizes vectors")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-delay-s", type=float, default=0.02, help="fixed cost a batch")
    parser.add_argument("--token-delay-s", type=float, default=0.0003, help="cost a prompt token")
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=None,
        help="a full batch's simulated forward, in ms (both costs scaled in their default "
        "proportion; default: the two delays above, ~97 ms for 32 rows)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="workers sharing every tenant (B's loop too)"
    )
    parser.add_argument("--light-inflight", type=int, default=16, help="tenant B's closed loop")
    parser.add_argument("--flood-inflight", type=int, default=2000, help="tenant A's flood")
    parser.add_argument("--weighted-inflight", type=int, default=300, help="C's and D's loops")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=1, help="runs; worst and median printed")
    parser.add_argument(
        "--real-repeats",
        type=int,
        default=0,
        help="runs of the real-model experiment (fairness_model; 0: none)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    add_real_model_arguments(parser)
    parser.add_argument("--docs-plot", default="docs/fairness.png", help="'' for nowhere")
    parser.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="record stage marks of the worker and B's client here (one folder a run) and "
        "print B's round trip stage by stage (`stage_report`)",
    )


def mock_costs(args: argparse.Namespace) -> tuple[float, float]:
    """The mock's cost of a batch and of a prompt token: the flags', or with ``--forward-ms``
    both scaled so that a full batch of 8-token prompts takes that long (a 3 ms GPU forward,
    a 100 ms CPU one), split between the two as the flags split it."""
    batch_s, token_s = args.batch_delay_s, args.token_delay_s
    if args.forward_ms is None:
        return batch_s, token_s
    full_s = batch_s + token_s * args.batch_size * PROMPT_TOKENS
    scale = args.forward_ms / 1000 / full_s
    return batch_s * scale, token_s * scale


def _full_forward_s(args: argparse.Namespace) -> float:
    """How long the mock takes for a full batch of the benchmark's prompts."""
    batch_s, token_s = mock_costs(args)
    return batch_s + token_s * args.batch_size * PROMPT_TOKENS


async def _window(args: argparse.Namespace) -> tuple[float, float]:
    await asyncio.sleep(args.warmup_s)
    start = time.monotonic()
    await asyncio.sleep(args.measure_s)
    return start, time.monotonic()


def _ms(values: list[float]) -> list[float]:
    return [round(v * 1000, 1) for v in values]


async def _flood_and_light(
    args: argparse.Namespace, flood: LoopProcess, light: QueueLM, salt: int, pauses: GcPauses
) -> dict[str, Any]:
    """B alone; A alone; A and B together: latencies and tokens per second."""
    b = Loop(light, args.light_inflight, salt).start()
    start, end = await _window(args)
    await b.stop()
    alone_s = b.between(start, end)
    await flood.start(salt + 1)
    a_alone = await _window(args)
    b = Loop(light, args.light_inflight, salt + 2).start()
    start, end = await _window(args)
    await b.stop()
    a_done = await flood.stop()
    a_alone_per_s = _count(a_done, *a_alone) / (a_alone[1] - a_alone[0])
    under_s = b.between(start, end)
    both_window = (start, end)
    both_per_s = (_count(a_done, start, end) + len(under_s)) / (end - start)
    alone, under = latency_figures(alone_s), latency_figures(under_s)
    return {
        "light_alone": alone,
        "light_under_flood": under,
        "light_alone_ms": _ms(alone_s),
        "light_under_flood_ms": _ms(under_s),
        "client_gc_pauses_under_flood": pauses.between(start, end),
        "p99_ratio": round(under["p99_s"] / alone["p99_s"], 3),
        "p999_ratio": round(under["p999_s"] / alone["p999_s"], 3),
        "tokens_per_s_flood_alone": round(a_alone_per_s * PROMPT_TOKENS, 1),
        "tokens_per_s_flood_and_light": round(both_per_s * PROMPT_TOKENS, 1),
        "throughput_ratio": round(both_per_s / a_alone_per_s, 3) if a_alone_per_s else 0.0,
        "flood_and_light_window_s": both_window,
    }


def _count(done: list[tuple[float, float]], start: float, end: float) -> int:
    return sum(1 for at, _ in done if start <= at < end)


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


async def _run(args: argparse.Namespace, report: Report, prefix: str) -> dict[str, Any]:
    """One run on a fresh Redis and worker; figures recorded under `prefix`."""
    batch_delay_s, token_delay_s = mock_costs(args)
    opts = {"distinct_vectors": 64, "batch_delay_s": batch_delay_s, "token_delay_s": token_delay_s}
    env = {"LMQ_CACHE_WRITES": "0", "LMQ_BATCH_SIZE": str(args.batch_size)}
    trace_dir = args.trace_dir / (prefix.rstrip(".") or "run1") if args.trace_dir else None
    own_marks = None
    if trace_dir is not None:
        env["LMQ_STAGE_TRACE_DIR"] = str(trace_dir)
        own_marks = stage_trace.start(trace_dir, "bench")  # B's client is this process's
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
        workers = stack.enter_context(worker_pool(args.workers, **spec))
        await wait_for_workers(server.url, args.model, workers)
        clients: dict[str, QueueLM] = {}
        pauses = stack.enter_context(GcPauses())
        try:
            for name in ("b", "fifo-b", "c", "d"):
                settings = fairness_client_settings(urls[name.split("-")[0]])
                clients[name] = await connect_client(args.model, settings, workers)
            await _first_calls(clients, report, prefix)
            floods = {name: LoopProcess(args.model, urls[name], args.flood_inflight)
                      for name in ("a", "fifo")}  # fmt: skip
            freeze_heap()
            async with floods["a"] as flood:
                fair = await _flood_and_light(args, flood, clients["b"], 10, pauses)
            report.figure(f"{prefix}fair_share", fair, line=_line("fair share", fair))
            async with floods["fifo"] as flood:
                fifo = await _flood_and_light(args, flood, clients["fifo-b"], 20, pauses)
            report.figure(f"{prefix}fifo", fifo, line=_line("FIFO (one stream)", fifo))
            weighted = await _weighted(args, clients["c"], clients["d"])
            report.figure(f"{prefix}weights", weighted, line=f"weights 1:2: served tokens "
                          f"{weighted['tokens_weight_1']} : {weighted['tokens_weight_2']} = "
                          f"1 : {weighted['ratio_2_over_1']:.2f}")  # fmt: skip
        finally:
            await asyncio.gather(*(lm.close() for lm in clients.values()))
            stage_trace.stop()
    if trace_dir is not None and own_marks is not None:  # the workers stopped: marks written
        _report_round_trip(report, prefix, trace_dir, own_marks, fair["flood_and_light_window_s"])
    return {"fair": fair, "fifo": fifo, "weights": weighted, "load_avg": load_avg()}


def _report_round_trip(
    report: Report, prefix: str, trace_dir: Path, own: Path, window: tuple[float, float]
) -> None:
    """B's round trip under the flood, stage by stage, from each worker's marks."""
    client = read_marks(own)
    for path in sorted(trace_dir.glob("worker-*.txt")):
        worker = read_marks(path)
        stages = round_trips(worker, client, "b", *window)
        lines = report_lines(stages, idle_gaps(worker, *window), "B")
        figures = {stage: spread_of(values) for stage, values in stages.items()}
        report.figure(f"{prefix}round_trip.{path.stem}", figures,
                      line=f"{path.stem}: " + "\n".join(lines))  # fmt: skip


async def _first_calls(clients: dict[str, QueueLM], report: Report, prefix: str) -> None:
    """One call of each client before any window: a fresh worker's first calls of a tenant
    took 3.9-4.9 s here (with or without the heap freezes; not investigated further), a cold
    start that a 3 s warm-up did not always absorb on a loaded machine, not a tail."""
    started = time.monotonic()
    await asyncio.gather(*(lm.next_token_logprobs(distinct_prompt(i, 99, PROMPT_TOKENS))
                           for i, lm in enumerate(clients.values())))  # fmt: skip
    took_s = round(time.monotonic() - started, 2)
    report.figure(f"{prefix}first_calls_s", took_s, line=f"first call of every client: {took_s} s")


def _line(label: str, figures: dict[str, Any]) -> str:
    alone, under = figures["light_alone"], figures["light_under_flood"]
    pauses = figures.get("client_gc_pauses_under_flood") or []
    return (
        f"{label}: B alone p50 {alone['p50_s'] * 1000:.0f} ms p99 {alone['p99_s'] * 1000:.0f} ms"
        f" p99.9 {alone['p999_s'] * 1000:.0f} ms; under flood p50 {under['p50_s'] * 1000:.0f}"
        f" ms p99 {under['p99_s'] * 1000:.0f} ms p99.9 {under['p999_s'] * 1000:.0f} ms"
        f" (x{figures['p99_ratio']:.2f}; p99.9 x{figures['p999_ratio']:.2f}); throughput"
        f" flood+B / flood alone {figures['throughput_ratio']:.3f}\n"
        f"    B alone, calls by latency (ms): {histogram_line(alone)}\n"
        f"    B under flood:                  {histogram_line(under)}\n"
        f"    this process's GC pauses >= 10 ms in the flood window: "
        f"{[p['ms'] for p in pauses] or 'none'}"
    )


#: The figures compared across runs, and whether a higher value is the worse one.
_HIGHER_IS_WORSE = {
    "p99_ratio": True, "p999_ratio": True, "throughput_ratio": False, "weights_ratio": False,
    "fifo_p99_ratio": True,
}  # fmt: skip


def _run_figures(result: dict[str, Any]) -> dict[str, Any]:
    fair = result["fair"]
    return {
        "p99_ratio": fair["p99_ratio"],
        "p999_ratio": fair["p999_ratio"],
        "throughput_ratio": fair["throughput_ratio"],
        "weights_ratio": result["weights"]["ratio_2_over_1"],
        "fifo_p99_ratio": result["fifo"]["p99_ratio"],
        "meets_targets": _meets(
            fair["p99_ratio"], fair["throughput_ratio"], result["weights"]["ratio_2_over_1"]
        ),  # fmt: skip
        "load_avg": result["load_avg"],
    }


def _meets(p99_ratio: float, throughput_ratio: float, weights_ratio: float) -> bool:
    return p99_ratio <= 2.0 and throughput_ratio >= 0.95 and abs(weights_ratio / 2 - 1) <= 0.1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/fairness.json``."""
    logging.getLogger("lmqueue.tenant_admin").setLevel(logging.ERROR)  # no aclfile: expected
    report = Report("fairness", {k: str(v) for k, v in vars(args).items()})
    results, runs = [], []
    for i in range(1, args.repeats + 1):
        prefix = f"run{i}." if args.repeats > 1 else ""
        results.append(asyncio.run(_run(args, report, prefix)))
        runs.append(_run_figures(results[-1]))
        report.figure(f"{prefix}summary", runs[-1], line=f"run {i}: {runs[-1]}")
    summary = spread(runs, _HIGHER_IS_WORSE)
    report.figure("spread", {"runs": runs, "summary": summary},
                  line="\n  ".join(spread_lines(runs, summary)))  # fmt: skip
    real = _real_model(args, report)
    worst = max(range(len(runs)), key=lambda i: runs[i]["p99_ratio"])
    png = plot(results[worst], real, args.out_dir / "fairness.png", run=worst + 1)
    if args.docs_plot:
        Path(args.docs_plot).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, args.docs_plot)
    report.figure("plot", str(png), line=f"plot: {png} (run {worst + 1}, the worst p99 ratio)")
    line = _summary(runs, summary, real, _full_forward_s(args), args.workers)
    return report.finish(_ratios(summary, real), line, args.out_dir)


def _real_model(args: argparse.Namespace, report: Report) -> dict[str, Any] | None:
    if not args.real_repeats:
        return None
    return run_real(args, report)


def _ratios(summary: dict[str, Any], real: dict[str, Any] | None) -> dict[str, Any]:
    ratios = {
        "p99_under_flood_over_alone": summary["p99_ratio"]["worst"],
        "p99_under_flood_over_alone_median": summary["p99_ratio"]["median"],
        "p999_under_flood_over_alone": summary["p999_ratio"]["worst"],
        "p99_under_flood_over_alone_fifo": summary["fifo_p99_ratio"]["worst"],
        "weighted_tokens_2_over_1": summary["weights_ratio"]["worst"],
        "throughput_under_flood_over_alone": summary["throughput_ratio"]["worst"],
    }
    if real is not None:
        ratios["real_model_p99_under_flood_over_alone"] = real["summary"]["p99_ratio"]["worst"]
    return ratios


def _summary(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    real: Any,
    forward_s: float | None = None,
    workers: int = 1,
) -> str:
    worst = {key: values["worst"] for key, values in summary.items()}
    med = {key: values["median"] for key, values in summary.items()}
    met = sum(run["meets_targets"] for run in runs)
    line = (
        f"fairness ({len(runs)} run(s), worst / median): B's p99 under flood / alone "
        f"{worst['p99_ratio']:.2f} / {med['p99_ratio']:.2f} (p99.9 {worst['p999_ratio']:.2f}; "
        f"FIFO {med['fifo_p99_ratio']:.2f}) [target <= 2.0]; weights 1:2 served "
        f"1:{worst['weights_ratio']:.2f} [within 10%]; throughput under flood / alone "
        f"{worst['throughput_ratio']:.3f} / {med['throughput_ratio']:.3f} [>= 0.95]; "
        f"all three met in {met} of {len(runs)}"
    )
    if forward_s is not None:
        line += f"; a full batch's forward {forward_s * 1000:.0f} ms, {workers} worker(s)"
    if real is not None:
        r = real["summary"]["p99_ratio"]
        line += f"; real model (SmolLM2-135M) p99 ratio {r['worst']:.2f} / {r['median']:.2f}"
    return line
