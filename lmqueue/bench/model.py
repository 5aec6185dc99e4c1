"""``lmq bench model``: an SMC workload on SmolLM2-135M, lmqueue against genlm-backend in-process.

Three sides run the same sampler (`workload.Workload`: 16 particles, a 100-token prompt, 24
steps, lipogram constraint with resampling), one after another in one run:

* ``genlm``: genlm-backend 0.3.1's ``AsyncTransformer`` in this process, built from the same
  model and tokenizer objects, with ``cache_kv(prompt)`` first as its documentation advises,
  on every point of `anchor_grid` (its batch size and timeout: its defaults, the particle
  count, lmqueue's); the ratios divide by the best point of the same run;
* ``inprocess``: lmqueue's own HF backend (`workers.backends.hf.AsyncTransformer`) in this
  process with the worker's batching settings, also with ``cache_kv(prompt)``: the backend's
  speed without the queue;
* ``lmqueue``: a `QueueLM` client and ONE hf worker process over Redis, defaults throughout; its
  warm-up is one call on the prompt (what ``cache_kv`` gives the others).

The worker process is started first and is idle (heartbeats only) while the in-process sides
run, so its loading never overlaps a timed run. Figures are next-token calls per second.
``--warmup`` rounds (1) of every side run first and count in no figure: a process's first run
pays one-time costs a program pays once in its life (on a GPU the worker captures its CUDA
graphs; every one of five H200 runs' worst round through the worker was its first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.settings import ClientSettings, RedisSettings, WorkerSettings

from .lib import devices
from .lib.anchor_grid import AnchorConfig, add_grid_argument, best, grid, run_genlm, run_in_process
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import CpuMeter, connect_client, redis_server, wait_for_workers, worker_pool
from .lib.workload import Workload, bench_prompt, one_torch_thread, result_figures

__all__ = ["add_arguments", "run"]

SIDES = ("genlm", "inprocess", "lmqueue")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides, comma-separated")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of all sides, each its own prompt; median"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds of every side first, own prompts"
    )
    parser.add_argument("--timeout-s", type=float, default=600, help="fail a side that hangs")
    add_grid_argument(parser)
    devices.add_device_argument(parser)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/model.json``."""
    from lmqueue.workers.models import load_causal_lm, load_tokenizer

    report = Report("model", {k: str(v) for k, v in vars(args).items()})
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        workers = []
        if "lmqueue" in sides:  # started first: it loads while this process loads its copy
            env = {"LMQ_DEVICE": args.device} if args.device != "auto" else {}
            spec = dict(model=args.model, backend="hf", redis_url=server.url, tag="model")
            workers = stack.enter_context(worker_pool(1, env=env, **spec))
        tokenizer = load_tokenizer(args.model)
        device = devices.resolve(args.device)
        model = load_causal_lm(args.model, devices.load_options(device))
        report.figure("device", device)
        workload = Workload.for_tokenizer(
            tokenizer, decode_vocab(tokenizer)[0], args.prompt_tokens,
            particles=args.particles, steps=args.steps, seed=args.seed,
        )  # fmt: skip
        report.figure("prompt_tokens", len(workload.prompt))
        if workers:
            asyncio.run(wait_for_workers(server.url, args.model, workers))
        points = grid(args.particles, args.anchor_grid) if "genlm" in sides else []
        report.figure("anchor_grid", [p.label for p in points],
                      line=f"anchor grid: {', '.join(p.label for p in points)}")  # fmt: skip
        runners: dict[str, Callable[[Workload], Awaitable[dict[str, Any]]]] = {
            point.label: _genlm_runner(model, tokenizer, point) for point in points
        }
        if "inprocess" in sides:
            runners["inprocess"] = lambda w: _inprocess(model, tokenizer, w, device)
        if "lmqueue" in sides:
            runners["lmqueue"] = lambda w: _lmqueue(args.model, server.url, workers, w)
        rounds = [
            dataclasses.replace(
                workload,
                seed=args.seed + index,
                prompt=bench_prompt(tokenizer, args.prompt_tokens, variant=index),
            )  # fmt: skip
            for index in range(args.repeats + args.warmup)
        ]
        warmups, rounds = rounds[args.repeats :], rounds[: args.repeats]
        _run_sides(runners, warmups, args, report, "warmup")
        per_s, by_round = _rounds(runners, rounds, args, report)
    ratios, summary = _ratios(per_s, points)
    spread = _round_ratios(by_round, points, report)
    if spread:
        ratios["lmqueue_over_genlm_by_round"] = spread
        summary += (f"; by round lmqueue/genlm's best worst {min(spread):.2f}x, median "
                    f"{statistics.median(spread):.2f}x of {len(spread)}")  # fmt: skip
    return report.finish(ratios, summary, args.out_dir)


def _run_sides(
    runners: dict[str, Callable[[Workload], Awaitable[dict[str, Any]]]],
    workloads: list[Workload],
    args: argparse.Namespace,
    report: Report,
    kind: str,
) -> dict[str, list[float]]:
    """Every side on each workload in turn; each side's calls/s, reported as ``<kind><i>``
    (a ``warmup`` is reported and counted in no figure)."""
    per_s: dict[str, list[float]] = {side: [] for side in runners}
    for index, workload in enumerate(workloads):
        for side, runner in runners.items():
            figures = asyncio.run(asyncio.wait_for(runner(workload), args.timeout_s))
            gc.collect()
            per_s[side].append(figures["calls_per_s"])
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in figures["cpu_ms_per_call"].items())
            gpu = devices.gpu_text(figures.get("gpu"), figures.get("gpu_in_use_bytes"))
            line = (
                f"{side:<17} {figures['calls_per_s']:7.2f} calls/s  ({figures['calls']} calls, "
                f"{figures['resamples']} resamples, {figures['elapsed_s']:.1f} s; "
                f"CPU ms/call: {cpu}; {gpu})"
            )
            if kind == "warmup":
                line += "  warm-up, not counted"
            report.figure(f"{side}.{kind}{index}", figures, line=line)
    return per_s


def _round_ratios(
    by_round: dict[str, list[float]], points: list[AnchorConfig], report: Report
) -> list[float]:
    """lmqueue over genlm's best point of the same round, for each round (interleaved runs)."""
    if not points or "lmqueue" not in by_round:
        return []
    ratios = []
    for index, lmq in enumerate(by_round["lmqueue"]):
        top = max(by_round[point.label][index] for point in points)
        ratios.append(round(lmq / top, 3) if top else 0.0)
    report.figure("lmqueue_over_genlm_best_by_round", ratios,
                  line=f"lmqueue / genlm's best point, each round: {ratios}")  # fmt: skip
    return ratios


def _rounds(
    runners: dict[str, Callable[[Workload], Awaitable[dict[str, Any]]]],
    workloads: list[Workload],
    args: argparse.Namespace,
    report: Report,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Run every side on each workload in turn, interleaved; the median calls/s of each, and
    each round's.

    Interleaving means a load spike on a shared machine slows one round of every side rather
    than every round of one side. Each round has its own prompt (sharing no prefix with the
    others) and seed: the worker and the shared cache outlive a round, and a repeated
    workload would be answered from them without a forward.
    """
    rounds = _run_sides(runners, workloads, args, report, "round")
    per_s = {side: statistics.median(values) for side, values in rounds.items()}
    if args.repeats > 1:
        for side, value in per_s.items():
            line = f"{side:<17} median {value:7.2f} calls/s"
            report.figure(f"{side}.median_calls_per_s", value, line=line)
    return per_s, rounds


def _ratios(per_s: dict[str, float], points: list[AnchorConfig]) -> tuple[dict[str, Any], str]:
    """lmqueue and the in-process backend over the anchor's best point (and its defaults)."""
    if points:
        top, default = best(per_s, points), points[0]
        per_s = {**per_s, "genlm": per_s[top.label], "genlm_defaults": per_s[default.label]}

    def ratio(a: str, b: str) -> float | None:
        return round(per_s[a] / per_s[b], 3) if a in per_s and per_s.get(b) else None

    ratios: dict[str, Any] = {
        "lmqueue_over_genlm": ratio("lmqueue", "genlm"),
        "inprocess_over_genlm": ratio("inprocess", "genlm"),
        "lmqueue_over_inprocess": ratio("lmqueue", "inprocess"),
        "lmqueue_over_genlm_defaults": ratio("lmqueue", "genlm_defaults"),
    }
    shown = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if isinstance(v, float))
    anchor = f" (genlm's best: {top.label}, {per_s['genlm']:.2f} calls/s)" if points else ""
    if points:
        ratios["genlm_best"] = top.label
    summary = f"model ratio: {shown}{anchor}  [target lmqueue/genlm >= 1.0x, aim 2x]"
    return ratios, summary


def _genlm_runner(
    model: Any, tokenizer: Any, point: AnchorConfig
) -> Callable[[Workload], Awaitable[dict[str, Any]]]:
    return lambda workload: run_genlm(model, tokenizer, workload, point)


async def _inprocess(model: Any, tokenizer: Any, workload: Workload, device: str) -> dict[str, Any]:
    from lmqueue.workers.backend_loader import backend_options, batching_for_device
    from lmqueue.workers.backends.hf import AsyncTransformer

    # The settings a worker on this device gives its backend (default settings otherwise).
    settings = batching_for_device(WorkerSettings(model="bench", device=device))
    options = backend_options(settings, AsyncTransformer.OPTIONS)
    options.pop("device", None)  # the model is placed already
    lm = AsyncTransformer(model, tokenizer, **options)
    async with lm:
        return await run_in_process(lm, workload)


async def _lmqueue(model: str, url: str, workers: Any, workload: Workload) -> dict[str, Any]:
    settings = ClientSettings(redis=RedisSettings(url=url))
    async with await connect_client(model, settings, workers) as lm:
        await lm.next_token_logprobs(workload.prompt)
        meter = CpuMeter({"client": [os.getpid()], "worker": [w.pid for w in workers]})
        with one_torch_thread():
            meter.start()
            result = await workload.run(lm)
            cpu = meter.stop()
        stats = lm.stats
    used = devices.gpu_used_bytes(w.pid for w in workers)
    return {**result_figures(result, cpu), "client_stats": stats, "gpu_in_use_bytes": used}
