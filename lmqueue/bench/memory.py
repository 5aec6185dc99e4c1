"""``lmq bench memory``: worker and Redis memory stay under their bounds over a long model run.

One hf worker serves SmolLM2-135M with small, explicit bounds (``max_kv_tokens``, result
``cache_size``) behind two Redis instances: the queue role (``noeviction``) and the cache role
(``maxmemory`` 64mb, ``volatile-ttl``). The SMC workload runs again and again for a bounded time,
each run from a prompt variant that shares no prefix with the others and with its own seed, so
the worker's KV and result caches and the shared cache all fill past their bounds and must
evict. A thread samples the worker's RSS (psutil) and each instance's ``used_memory``; the
kernel's peak-RSS mark (VmHWM, reset after loading) catches what falls between samples.

Bounds, derived in `memory_bounds` and explained in BENCHMARKS.md: worker = its RSS after
loading (runtime + weights) + KV bound + result bound + one forward's working set; cache
instance = its maxmemory; queue instance = its idle usage + the replies one client can have
in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from lmqueue.devstack import CACHE_POLICY, WorkerProcess
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .lib.memory_bounds import MemorySampler, derive_bounds, model_figures, reset_peak_rss, vm_hwm
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import connect_client, redis_server, worker_pool
from .lib.workload import Workload, bench_prompt

__all__ = ["add_arguments", "run"]

_MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration-s", type=float, default=90.0, help="SMC runs start until then")
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-kv-tokens", type=int, default=2048, help="worker KV bound")
    parser.add_argument("--cache-size", type=int, default=256, help="worker result-cache bound")
    parser.add_argument("--cache-maxmemory", default="64mb", help="cache instance maxmemory")
    parser.add_argument("--sample-every-s", type=float, default=0.2)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/memory.json``."""
    from lmqueue.workers.models import load_causal_lm, load_tokenizer

    report = Report("memory", {k: str(v) for k, v in vars(args).items()})
    tokenizer = load_tokenizer(args.model)
    model_info = model_figures(load_causal_lm(args.model))  # weights and KV sizes, then freed
    report.figure("model", model_info, line=_model_line(model_info))
    workload = Workload.for_tokenizer(
        tokenizer, decode_vocab(tokenizer)[0], particles=args.particles, steps=args.steps
    )
    opts = {"max_kv_tokens": args.max_kv_tokens, "cache_size": args.cache_size}
    with contextlib.ExitStack() as stack:
        queue = stack.enter_context(redis_server())
        cache = stack.enter_context(redis_server(args.cache_maxmemory, CACHE_POLICY))
        spec = dict(model=args.model, backend="hf", redis_url=queue.url, cache_url=cache.url)
        (worker,) = stack.enter_context(worker_pool(1, tag="memory", backend_opts=opts, **spec))
        sampler = MemorySampler(
            worker.pid, {"queue": queue.url, "cache": cache.url}, args.sample_every_s
        )
        settings = ClientSettings(redis=RedisSettings(url=queue.url, cache_url=cache.url))
        baseline, runs = asyncio.run(_measure(args, settings, worker, sampler, workload, tokenizer))
        hwm = vm_hwm(worker.pid)
        bounds = derive_bounds(args, model_info, baseline, workload, _maxmemory_bytes(cache.url))
    peaks = sampler.peaks()
    if hwm is not None:
        peaks["worker_rss_hwm"] = hwm
    report.figure("baseline", baseline, line=_bytes_line("baseline", baseline))
    line = f"{runs['runs']} SMC runs, {runs['calls']} calls in {runs['elapsed_s']:.0f} s"
    report.figure("runs", runs, line=line)
    report.figure("demand", _demand(args, runs, workload), line=_demand_line(args, runs, workload))
    report.figure("samples", len(sampler.samples))
    report.figure("timeline", sampler.timeline(), line="timeline: in the result file")
    report.figure("bounds", bounds, line=_bytes_line("bounds", bounds))
    report.figure("peaks", peaks, line=_bytes_line("peaks", peaks))
    ratios = _ratios(peaks, bounds)
    shown = ", ".join(f"{k.removesuffix('_over_bound')} {v:.2f}x" for k, v in ratios.items() if v)
    summary = f"memory ratio peak/bound: {shown}  [target <= 1.0x each]"
    return report.finish(ratios, summary, args.out_dir)


async def _measure(
    args: argparse.Namespace,
    settings: ClientSettings,
    worker: WorkerProcess,
    sampler: MemorySampler,
    workload: Workload,
    tokenizer: Any,
) -> tuple[dict[str, int], dict[str, Any]]:
    """Warm up, take the baseline, then sample while SMC runs go on for the duration.

    The warm-up call makes the worker touch every weight page (a freshly loaded model's
    weights are not all resident yet), so the baseline holds the whole model.
    """
    async with await connect_client(args.model, settings, [worker]) as lm:
        await lm.next_token_logprobs(workload.prompt)
        await asyncio.sleep(1.0)
        baseline = sampler.sample()
        reset_peak_rss(worker.pid)
        runs = calls = 0
        started = time.monotonic()
        with sampler.running():
            while time.monotonic() - started < args.duration_s:
                runs += 1
                prompt = bench_prompt(tokenizer, len(workload.prompt), variant=runs)
                calls += (await workload.run(lm, prompt=prompt, seed=runs)).calls
        elapsed_s = round(time.monotonic() - started, 1)
        return baseline, {
            "runs": runs,
            "calls": calls,
            "elapsed_s": elapsed_s,
            "client_stats": lm.stats,
        }


def _demand(args: argparse.Namespace, runs: dict[str, Any], workload: Workload) -> dict[str, int]:
    """What the run asked the worker to hold, had nothing been evicted.

    Every request a worker computed adds one KV position (its last token) and one result; each
    run's prompt adds its length in KV. Above a bound, the worker must have evicted.
    """
    sent = int(runs["client_stats"]["sent"])
    return {
        "kv_positions": sent + runs["runs"] * len(workload.prompt),
        "results": sent,
        "max_kv_tokens": args.max_kv_tokens,
        "cache_size": args.cache_size,
    }


def _demand_line(args: argparse.Namespace, runs: dict[str, Any], workload: Workload) -> str:
    demand = _demand(args, runs, workload)
    return (
        f"demand without eviction: {demand['kv_positions']} KV positions (bound "
        f"{args.max_kv_tokens}), {demand['results']} results (bound {args.cache_size})"
    )


def _maxmemory_bytes(url: str) -> int:
    from lmqueue.shared.connections import sync_redis

    redis = sync_redis(url)
    try:
        config: dict[str, str] = redis.config_get("maxmemory")  # type: ignore[assignment]
        return int(config["maxmemory"])
    finally:
        redis.close()


def _ratios(peaks: dict[str, int], bounds: dict[str, int]) -> dict[str, float | None]:
    pairs = {
        "worker_rss": ("worker_rss_hwm" if "worker_rss_hwm" in peaks else "worker_rss", "worker"),
        "cache_redis": ("cache_used_memory", "cache_redis"),
        "queue_redis": ("queue_used_memory", "queue_redis"),
    }
    return {
        f"{name}_over_bound": round(peaks[peak] / bounds[bound], 3) if bounds.get(bound) else None
        for name, (peak, bound) in pairs.items()
    }


def _model_line(info: dict[str, Any]) -> str:
    return (
        f"model: weights {info['weights_bytes'] / _MIB:.0f} MiB, KV "
        f"{info['kv_bytes_per_token'] / 1024:.1f} KiB/token, vector "
        f"{info['vector_bytes'] / 1024:.0f} KiB"
    )


def _bytes_line(title: str, values: dict[str, Any]) -> str:
    shown = ", ".join(
        f"{k} {v / _MIB:.1f} MiB" for k, v in values.items() if isinstance(v, int | float)
    )
    return f"{title}: {shown}"
