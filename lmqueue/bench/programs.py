"""``lmq bench programs``: K sampling programs sharing one worker, or each loading its model.

The question a group asks before putting lmqueue in front of its GPUs: K people each run an
SMC program. Either every program loads its own copy of the model (genlm-backend's in-process
``AsyncTransformer``, the thing to beat), or all of them send their calls to one lmqueue worker
process. For K = 1, 2, 4, in one run, both ways:

* ``genlm``: K processes, each with its own model copy and ``cache_kv(prompt)``, torch threads
  split evenly over the machine's cores (the best setting for K copies on shared cores);
* ``lmqueue``: one hf worker process (default settings) and K client processes (one torch
  thread each, as the README advises), each a `QueueLM`.

Every program runs the workload of `workload.Workload` on its own ~100-token prompt variant
(no shared prefix) with its own seed. All K processes load first, then start together; the
aggregate rate is all programs' calls over the time until the last one finished. Memory is the
sum of every process's peak RSS (VmHWM, loading included), the worker's among them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from .memory_bounds import vm_hwm
from .program_runner import run_together
from .report import DEFAULT_OUT_DIR, Report, command_parser
from .stack import redis_server, wait_for_workers, worker_pool

__all__ = ["add_arguments", "run", "main"]

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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/programs.json``."""
    import asyncio

    report = Report("programs", {k: str(v) for k, v in vars(args).items()})
    counts = [int(k) for k in args.programs.split(",") if k.strip()]
    figures: dict[int, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        spec = dict(model=args.model, backend="hf", redis_url=server.url, tag="programs")
        workers = stack.enter_context(worker_pool(1, **spec))
        asyncio.run(wait_for_workers(server.url, args.model, workers))
        for k in counts:  # each K its own prompt variants: no round is served from a cache
            first = 1 + sum(c for c in counts if c < k)
            genlm = _round(args, "genlm", k, first, None)
            lmq = _round(args, "lmqueue", k, first, server.url)
            lmq["peak_rss_bytes"] += vm_hwm(workers[0].pid) or 0
            figures[k] = {"genlm": genlm, "lmqueue": lmq}
            for side, side_figures in figures[k].items():
                report.figure(f"k{k}.{side}", side_figures, line=_line(k, side, side_figures))
    return report.finish(*_ratios(figures), args.out_dir)


def _round(
    args: argparse.Namespace, side: str, k: int, first_variant: int, redis_url: str | None
) -> dict[str, Any]:
    """Run K programs of `side` together; their aggregate rate and summed peak RSS."""
    threads = max(1, (os.cpu_count() or 1) // k) if side == "genlm" else 1
    command = [
        sys.executable, "-m", "lmqueue.bench.program_runner", "--side", side, "--model",
        args.model, "--particles", str(args.particles), "--steps", str(args.steps),
        "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed),
        "--torch-threads", str(threads), *(["--redis-url", redis_url] if redis_url else []),
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
        "torch_threads_per_program": threads,
        "per_program": results,
    }


def _line(k: int, side: str, f: dict[str, Any]) -> str:
    mib = f["peak_rss_bytes"] / 2**20
    return (
        f"K={k} {side:<8} {f['calls_per_s']:7.2f} calls/s aggregate ({f['calls']} calls in "
        f"{f['wall_s']:.1f} s), peak RSS summed {mib:8.1f} MiB"
    )


def _ratios(figures: dict[int, dict[str, dict[str, Any]]]) -> tuple[dict[str, float], str]:
    ratios: dict[str, float] = {}
    for k, sides in figures.items():
        genlm, lmq = sides["genlm"], sides["lmqueue"]
        ratios[f"k{k}_calls_per_s"] = round(lmq["calls_per_s"] / genlm["calls_per_s"], 3)
        ratios[f"k{k}_memory"] = round(lmq["peak_rss_bytes"] / genlm["peak_rss_bytes"], 3)
    shown = ", ".join(
        f"K={k}: {ratios[f'k{k}_calls_per_s']:.2f}x calls/s, {ratios[f'k{k}_memory']:.2f}x memory"
        for k in figures
    )
    summary = (
        f"programs ratio lmqueue/genlm: {shown}  [target at K=4: calls/s >= 1.5x, memory <= 0.5x]"
    )
    return ratios, summary


def main(argv: list[str] | None = None) -> int:
    """``lmq bench programs [flags]``."""
    parser = command_parser("programs", __doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
