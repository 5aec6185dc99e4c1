"""``lmq bench programs``: K sampling programs sharing one worker, or each loading its model.

The question a group asks before putting lmqueue in front of its GPUs: K people each run an
SMC program. Either every program loads its own copy of the model (genlm-backend's in-process
``AsyncTransformer``, the thing to beat), or all of them send their calls to one lmqueue worker
process. For K = 1, 2, 4, in one run, both ways:

* ``genlm``: K processes, each with its own model copy and ``cache_kv(prompt)``, torch threads
  split evenly over the machine's cores (the best setting for K copies on shared cores), on
  every point of `anchor_grid` (batch size, timeout); the ratios divide by the best point;
* ``lmqueue``: one hf worker process (default settings) and K client processes (one torch
  thread each, as the README advises), each a `QueueLM`.

Every program runs the workload of `workload.Workload` on its own ~100-token prompt variant
(no shared prefix) with its own seed. All K processes load first, then start together; the
aggregate rate is all programs' calls over the time until the last one finished. Memory is the
sum of every process's peak RSS (VmHWM, loading included), the worker's among them; on a GPU
also the GPU memory the driver reports in use by each side's processes (`devices`), which is
what K model copies cost there (RSS then holds little of it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from .lib import devices
from .lib.anchor_grid import AnchorConfig, add_grid_argument, best, grid
from .lib.memory_bounds import vm_hwm
from .lib.program_runner import run_together
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import redis_server, wait_for_workers, worker_pool

__all__ = ["add_arguments", "run"]

SIDES = ("genlm", "lmqueue")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--programs", default="1,2,4", help="values of K, comma-separated")
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900, help="fail a round that hangs")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    add_grid_argument(parser)
    devices.add_device_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/programs.json``."""
    import asyncio

    report = Report("programs", {k: str(v) for k, v in vars(args).items()})
    counts = [int(k) for k in args.programs.split(",") if k.strip()]
    figures: dict[int, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        spec = dict(model=args.model, backend="hf", redis_url=server.url, tag="programs")
        env = {"LMQ_DEVICE": args.device} if args.device != "auto" else {}
        workers = stack.enter_context(worker_pool(1, env=env, **spec))
        asyncio.run(wait_for_workers(server.url, args.model, workers))
        points = grid(args.particles, args.anchor_grid)
        report.figure("anchor_grid", [p.label for p in points],
                      line=f"anchor grid: {', '.join(p.label for p in points)}")  # fmt: skip
        for k in counts:  # each K its own prompt variants: no round is served from a cache
            first = 1 + sum(c for c in counts if c < k)
            figures[k] = _both_sides(args, k, first, points, server.url, workers[0].pid, report)
    return report.finish(*_ratios(figures), args.out_dir)


def _both_sides(
    args: argparse.Namespace,
    k: int,
    first: int,
    points: list[AnchorConfig],
    redis_url: str,
    worker_pid: int,
    report: Report,
) -> dict[str, dict[str, Any]]:
    """K programs of genlm at every grid point, then of lmqueue; genlm's best point kept."""
    on_grid = {}
    for point in points:
        on_grid[point.label] = _round(args, "genlm", k, first, None, point)
        line = _line(k, point.label, on_grid[point.label])
        report.figure(f"k{k}.{point.label}", on_grid[point.label], line=line)
    top = best({label: f["calls_per_s"] for label, f in on_grid.items()}, points)
    genlm = {**on_grid[top.label], "anchor": top.label}
    report.figure(f"k{k}.genlm", genlm, line=f"K={k} genlm's best point: {top.label}")
    lmq = _round(args, "lmqueue", k, first, redis_url)
    lmq["peak_rss_bytes"] += vm_hwm(worker_pid) or 0
    lmq["gpu_in_use_bytes"] = devices.gpu_used_bytes([worker_pid])
    report.figure(f"k{k}.lmqueue", lmq, line=_line(k, "lmqueue", lmq))
    return {"genlm": genlm, "lmqueue": lmq}


def _round(
    args: argparse.Namespace,
    side: str,
    k: int,
    first_variant: int,
    redis_url: str | None,
    point: AnchorConfig | None = None,
) -> dict[str, Any]:
    """Run K programs of `side` together; their aggregate rate and summed peak RSS."""
    threads = max(1, (os.cpu_count() or 1) // k) if side == "genlm" else 1
    command = [
        sys.executable, "-m", "lmqueue.bench.lib.program_runner", "--side", side, "--model",
        args.model, "--particles", str(args.particles), "--steps", str(args.steps),
        "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed),
        "--torch-threads", str(threads), *(["--redis-url", redis_url] if redis_url else []),
        "--device", args.device,
        *(["--batch-size", str(point.batch_size), "--timeout", str(point.timeout_s)]
          if point else []),
    ]  # fmt: skip
    commands = [[*command, "--variant", str(first_variant + i)] for i in range(k)]
    results, wall_s = run_together(commands, args.timeout_s)
    calls = sum(r["calls"] for r in results)
    return {
        "programs": k,
        "calls": calls,
        "wall_s": round(wall_s, 2),
        "calls_per_s": round(calls / wall_s, 2),
        "peak_rss_bytes": sum(r["peak_rss_bytes"] or 0 for r in results),
        "gpu_in_use_bytes": _summed(r.get("gpu_in_use_bytes") for r in results),
        "torch_threads_per_program": threads,
        "per_program": results,
    }


def _summed(values: Any) -> int | None:
    """The sum of the values that are known; None if none is (no GPU)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _line(k: int, side: str, f: dict[str, Any]) -> str:
    mib = f["peak_rss_bytes"] / 2**20
    gpu = f.get("gpu_in_use_bytes")
    return (
        f"K={k} {side:<8} {f['calls_per_s']:7.2f} calls/s aggregate ({f['calls']} calls in "
        f"{f['wall_s']:.1f} s), peak RSS summed {mib:8.1f} MiB"
        + (f", GPU in use summed {gpu / 2**20:8.1f} MiB" if gpu is not None else "")
    )


def _ratios(figures: dict[int, dict[str, dict[str, Any]]]) -> tuple[dict[str, float], str]:
    ratios: dict[str, float] = {}
    for k, sides in figures.items():
        genlm, lmq = sides["genlm"], sides["lmqueue"]
        ratios[f"k{k}_calls_per_s"] = round(lmq["calls_per_s"] / genlm["calls_per_s"], 3)
        ratios[f"k{k}_memory"] = round(lmq["peak_rss_bytes"] / genlm["peak_rss_bytes"], 3)
        if lmq.get("gpu_in_use_bytes") and genlm.get("gpu_in_use_bytes"):
            gpu = lmq["gpu_in_use_bytes"] / genlm["gpu_in_use_bytes"]
            ratios[f"k{k}_gpu_memory"] = round(gpu, 3)
    shown = ", ".join(
        f"K={k}: {ratios[f'k{k}_calls_per_s']:.2f}x calls/s, {ratios[f'k{k}_memory']:.2f}x memory"
        + (
            f" ({ratios[f'k{k}_gpu_memory']:.2f}x GPU memory)"
            if f"k{k}_gpu_memory" in ratios
            else ""
        )
        for k in figures
    )
    summary = (
        f"programs ratio lmqueue/genlm (genlm at its best grid point): {shown}  "
        "[target at K=4: calls/s >= 1.5x, memory <= 0.5x]"
    )
    return ratios, summary


def _shown(k: int, ratios: dict[str, float]) -> str:
    text = (
        f"K={k}: {ratios[f'k{k}_calls_per_s']:.2f}x calls/s, {ratios[f'k{k}_memory']:.2f}x memory"
    )
    gpu = ratios.get(f"k{k}_gpu_memory")
    return text + (f" ({gpu:.2f}x GPU memory)" if gpu is not None else "")
