"""``lmq bench adapters``: fine-tunes as LoRA adapters on one worker, or as merged models on four.

The question of a lab comparing fine-tunes: run the same SMC program against a base model and
three fine-tunes of it. Either each fine-tune is merged into a model of its own, served by its
own worker (what lmqueue offered before adapters), or one worker serves the base model and the
three as LoRA adapters, and requests of all four share its batches. In one run, both ways:

* ``merged``: 4 hf worker processes, one per model (the base, and each adapter merged into a
  copy of the base with PEFT's ``merge_and_unload``, saved to a directory); program i connects
  to model i;
* ``adapters``: 1 hf worker process with ``--adapter`` x 3; program i connects to the base
  model bound to adapter i (the base for i = 0).

Each side gets the machine's cores: a worker runs ``cores // workers`` torch threads (at least
one; ``OMP_NUM_THREADS``), so each of the four merged workers runs one, and the adapters worker
runs as many forwards at once as it has threads, one thread each (the hf backend's
``parallel_forwards``: on a CPU two single-threaded forwards of a small model get more done
than one forward on two threads; ``--parallel-forwards 1`` runs one forward on all of them).
``--worker-threads N`` gives every worker N instead: on a machine loaded by other work an
OpenMP team spins against the load (a forward took ~25x longer with two threads than with one
at load ~9 here), and one thread each is the steadier comparison there.

Four client processes run the workload of `workload.Workload` (own prompt variant each) at
once, as in ``lmq bench programs``; reported: aggregate calls/s, the workers' summed peak RSS
(the serving cost the comparison is about: four workers against one; the ``memory`` ratio)
and, beside it, the sum over every process, clients included (``memory_with_clients``: the
four clients are the same processes on both sides, ~160 MiB each, so they pull that ratio
toward 1). ``--batch-size`` is every worker's batch size (the worker's default: 32 rows).
Then, on the adapters worker, a **mixed batch** (the same number of prompts for each of the
four, all sent at once) against the **same requests one adapter at a time** (each adapter's
prompts sent and awaited before the next): calls/s. The prompts are SMC-like steps: each
adapter's own ``--prompt-tokens`` stem (computed once, before timing, so its KV is cached per
adapter) plus one fresh token, never asked before, so no result cache answers any of them and
each row computes one token.

The adapters are random (PEFT, ``init_lora_weights=False``) on attention and MLP projections:
the compute per token is that of a real rank-`rank` LoRA; their outputs mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmqueue.shared.settings import DEFAULT_BATCH_SIZE

from .lib import devices
from .lib.memory_bounds import vm_hwm
from .lib.program_runner import run_together
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import QUIET, redis_server, wait_for_workers

__all__ = ["add_arguments", "run"]

ADAPTERS = ("ft1", "ft2", "ft3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the adapters")
    parser.add_argument(
        "--worker-threads", type=int, default=None,
        help="torch threads of every worker (default: cores // workers of the side, >= 1)",
    )  # fmt: skip
    parser.add_argument(
        "--parallel-forwards", type=int, default=None,
        help="forwards the adapters worker runs at once (default: one per torch thread)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=None, help="every worker's batch size (default: 32)"
    )
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--mixed-prompts", type=int, default=8, help="per adapter, per round")
    parser.add_argument("--mixed-rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900, help="fail a round that hangs")
    devices.add_device_argument(parser)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/adapters.json``."""
    from lmqueue.workers.models import hf_directory

    report = Report("adapters", {k: str(v) for k, v in vars(args).items()})
    with tempfile.TemporaryDirectory(prefix="lmq-bench-adapters-") as tmp:
        base_dir = hf_directory(args.model)
        adapters, merged = _make_models(base_dir, Path(tmp), args.rank, args.seed)
        report.figure("setup", {"adapters": list(adapters)}, line="adapters made and merged")
        with redis_server() as server:
            merged_side = _merged_round(args, server.url, [args.model, *merged])
            report.figure("merged", merged_side, line=_line("merged", merged_side))
            adapter_side, mixed = _adapters_round(args, server.url, adapters)
            report.figure("adapters", adapter_side, line=_line("adapters", adapter_side))
            report.figure("mixed_batch", mixed, line=_mixed_line(mixed))
    ratios = {
        "calls_per_s": round(adapter_side["calls_per_s"] / merged_side["calls_per_s"], 3),
        "memory": round(
            adapter_side["workers_peak_rss_bytes"] / merged_side["workers_peak_rss_bytes"], 3
        ),
        "memory_with_clients": round(
            adapter_side["peak_rss_bytes"] / merged_side["peak_rss_bytes"], 3
        ),
        "mixed_over_sequential": round(
            mixed["mixed_calls_per_s"] / mixed["sequential_calls_per_s"], 3
        ),
    }
    gpu = (adapter_side["workers_gpu_in_use_bytes"], merged_side["workers_gpu_in_use_bytes"])
    if all(gpu):
        ratios["gpu_memory"] = round(gpu[0] / gpu[1], 3)
    summary = (
        f"adapters ratio 1 worker + 3 adapters / 4 merged workers: {ratios['calls_per_s']:.2f}x "
        f"calls/s, {ratios['memory']:.2f}x workers' memory ({ratios['memory_with_clients']:.2f}x "
        "with the clients); mixed batch / one adapter at a time: "
        f"{ratios['mixed_over_sequential']:.2f}x calls/s  "
        "[target: calls/s >= 1.0x, memory <= 0.35x]"
    )
    return report.finish(ratios, summary, args.out_dir)


def _make_models(
    base_dir: str, tmp: Path, rank: int, seed: int
) -> tuple[dict[str, str], list[str]]:
    """The adapters (name -> directory) and the merged models' directories, made here."""
    from .lib.adapter_models import make_random_adapter, merge_adapter

    adapters, merged = {}, []
    for i, name in enumerate(ADAPTERS):
        path = make_random_adapter(base_dir, tmp / name, seed + 1 + i, rank)
        adapters[name] = str(path)
        merged.append(str(merge_adapter(base_dir, path, tmp / f"merged-{name}")))
    return adapters, merged


def _merged_round(args: argparse.Namespace, url: str, models: list[str]) -> dict[str, Any]:
    """Program i against its own worker serving model i."""
    threads = _threads(args, len(models))
    extra = [*_batch_args(args), *devices.worker_args(args.device)]
    workers = [_worker(m, url, f"merged-{i}", threads, extra) for i, m in enumerate(models)]
    try:
        for worker, model in zip(workers, models, strict=True):
            asyncio.run(wait_for_workers(url, model, [worker]))
        commands = [_program(args, url, model, i + 1, None) for i, model in enumerate(models)]
        return _figures(commands, workers, threads, args.timeout_s)
    finally:
        for worker in workers:
            worker.stop(timeout_s=15)


def _adapters_round(
    args: argparse.Namespace, url: str, adapters: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Program i against one worker, bound to adapter i; then the mixed-batch comparison."""
    specs = [arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}")]
    threads = _threads(args, 1)
    forwards = args.parallel_forwards or threads
    opts = ["--backend-opts", json.dumps({"parallel_forwards": forwards})]
    batch = args.batch_size or max(DEFAULT_BATCH_SIZE // forwards, 1)  # as many rows in flight
    worker = _worker(
        args.model, url, "adapters", threads,
        [*specs, *opts, "--batch-size", str(batch), *devices.worker_args(args.device)],
    )  # fmt: skip
    try:
        asyncio.run(wait_for_workers(url, args.model, [worker]))
        names: list[str | None] = [None, *adapters]
        commands = [_program(args, url, args.model, 11 + i, n) for i, n in enumerate(names)]
        figures = _figures(commands, [worker], threads, args.timeout_s)
        figures.update(forwards=forwards, batch_size=batch)
        mixed = asyncio.run(_mixed_batches(args, url, names))
        return figures, mixed
    finally:
        worker.stop(timeout_s=15)


def _threads(args: argparse.Namespace, workers: int) -> int:
    """Torch threads of each of a side's `workers`: the machine's cores split over them."""
    if args.worker_threads is not None:
        return int(args.worker_threads)
    return max(1, len(os.sched_getaffinity(0)) // workers)


def _batch_args(args: argparse.Namespace) -> list[str]:
    return [] if args.batch_size is None else ["--batch-size", str(args.batch_size)]


def _worker(model: str, url: str, name: str, threads: int, extra: list[str] | None = None) -> Any:
    from lmqueue.devstack import WorkerProcess

    log_dir = Path(tempfile.gettempdir()) / "lmq-bench-adapters-logs"
    log_dir.mkdir(exist_ok=True)
    env = {**QUIET, "OMP_NUM_THREADS": str(threads)}
    process = WorkerProcess(
        model, "hf", url, f"bench-{name}", env=env, log_dir=log_dir, extra_args=extra or []
    )
    return process.start()


def _program(
    args: argparse.Namespace, url: str, model: str, variant: int, adapter: str | None
) -> list[str]:
    return [
        sys.executable, "-m", "lmqueue.bench.lib.program_runner", "--side", "lmqueue",
        "--model", model, "--redis-url", url, "--particles", str(args.particles),
        "--steps", str(args.steps), "--prompt-tokens", str(args.prompt_tokens),
        "--seed", str(args.seed), "--variant", str(variant),
        *(["--adapter", adapter] if adapter else []),
    ]  # fmt: skip


def _figures(
    commands: list[list[str]], workers: list[Any], threads: int, timeout_s: float
) -> dict[str, Any]:
    results, wall_s = run_together(commands, timeout_s)
    calls = sum(r["calls"] for r in results)
    clients = sum(r["peak_rss_bytes"] or 0 for r in results)
    served = sum(vm_hwm(w.pid) or 0 for w in workers)
    return {
        "workers_gpu_in_use_bytes": devices.gpu_used_bytes(w.pid for w in workers),
        "programs": len(commands), "workers": len(workers), "calls": calls,
        "wall_s": round(wall_s, 2), "calls_per_s": round(calls / wall_s, 2),
        "peak_rss_bytes": clients + served, "workers_peak_rss_bytes": served,
        "torch_threads_per_worker": threads,
    }  # fmt: skip


async def _mixed_batches(
    args: argparse.Namespace, url: str, names: list[str | None]
) -> dict[str, Any]:
    """Alternate rounds: all adapters' prompts at once, then the same number one at a time."""
    from lmqueue.producer import QueueLM

    rng = np.random.default_rng(args.seed)
    seconds = {"mixed": 0.0, "sequential": 0.0}
    calls = {"mixed": 0, "sequential": 0}
    async with await QueueLM.connect(args.model, redis_url=url, timeout_s=600) as lm:
        stem = rng.integers(0, lm.vocab_size, args.prompt_tokens).tolist()
        await asyncio.gather(*(_ask(lm, name, [stem]) for name in names))  # each one's KV
        wanted = 2 * args.mixed_rounds * args.mixed_prompts
        steps = iter(rng.permutation(lm.vocab_size)[:wanted].tolist())  # never one twice

        def fresh() -> list[list[int]]:
            return [stem + [next(steps)] for _ in range(args.mixed_prompts)]

        for _ in range(args.mixed_rounds):
            for mode in ("mixed", "sequential"):
                batch = fresh()  # the same prompts for every adapter, as an SMC comparison has
                work = [(name, batch) for name in names]
                started = time.monotonic()
                if mode == "mixed":
                    await asyncio.gather(*(_ask(lm, n, p) for n, p in work))
                else:
                    for name, prompts in work:
                        await _ask(lm, name, prompts)
                seconds[mode] += time.monotonic() - started
                calls[mode] += sum(len(p) for _, p in work)
    return {
        "prompt_tokens": args.prompt_tokens, "prompts_per_adapter": args.mixed_prompts,
        "rounds": args.mixed_rounds, "calls": calls,
        "mixed_calls_per_s": round(calls["mixed"] / seconds["mixed"], 2),
        "sequential_calls_per_s": round(calls["sequential"] / seconds["sequential"], 2),
    }  # fmt: skip


async def _ask(lm: Any, name: str | None, prompts: list[list[int]]) -> None:
    await asyncio.gather(*(lm.next_token_logprobs_numpy(p, lora_name=name) for p in prompts))


def _line(side: str, f: dict[str, Any]) -> str:
    mib, workers_mib = f["peak_rss_bytes"] / 2**20, f["workers_peak_rss_bytes"] / 2**20
    gpu = f.get("workers_gpu_in_use_bytes")
    return (
        f"{side:<8} {f['workers']} worker(s): {f['calls_per_s']:7.2f} calls/s aggregate "
        f"({f['calls']} calls in {f['wall_s']:.1f} s), peak RSS summed: workers "
        f"{workers_mib:8.1f} MiB, with the clients {mib:8.1f} MiB"
        + (f"; workers' GPU memory {gpu / 2**20:8.1f} MiB" if gpu is not None else "")
    )


def _mixed_line(f: dict[str, Any]) -> str:
    return (
        f"mixed batch {f['mixed_calls_per_s']:.2f} calls/s, one adapter at a time "
        f"{f['sequential_calls_per_s']:.2f} calls/s ({f['prompts_per_adapter']} prompts of "
        f"{f['prompt_tokens']} tokens per adapter, {f['rounds']} rounds each)"
    )
