"""``lmq bench cache``: latency of a call answered from the shared cache.

A mock worker answers a set of distinct prompts once, writing each result to the shared cache;
then one client with its local LRU off (``local_cache_size=0``) awaits those prompts again one
after another, so every call is a shared-cache hit: validate, MGET, resolve, convert to a float32
tensor. Its p50 and p99 are set against a bare redis-py GET of the same keys on the same
connection settings (the floor any client pays), for both wire dtypes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from lmqueue.shared.connections import async_redis
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.shared.wire import ids_to_bytes

from .lib.load import distinct_prompt, percentile
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import connect_client, redis_server, worker_pool

__all__ = ["add_arguments", "run"]

_TARGET_P50_MS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--model", default="smollm2-135m", help="whose vocabulary sizes vectors")
    parser.add_argument("--dtypes", default="float32,float16", help="wire dtypes, comma-separated")
    parser.add_argument("--calls", type=int, default=2000, help="sequential awaits per dtype")
    parser.add_argument("--prompts", type=int, default=256, help="distinct cached prompts")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/cache.json``."""
    report = Report("cache", {k: str(v) for k, v in vars(args).items()})
    p50s = asyncio.run(_run(args, report))
    ratios = {
        f"{dtype}.p50_over_target": round(ms / _TARGET_P50_MS, 3) for dtype, ms in p50s.items()
    }
    parts = [f"{dtype} p50 {ms:.3f} ms" for dtype, ms in p50s.items()]
    summary = (
        f"cache hit latency: {'; '.join(parts)}  [target p50 < {_TARGET_P50_MS:g} ms; "
        f"ratio to target {max(ratios.values()):.2f}x]"
    )
    return report.finish(ratios, summary, args.out_dir)


async def _run(args: argparse.Namespace, report: Report) -> dict[str, float]:
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        workers = stack.enter_context(
            worker_pool(
                1,
                model=args.model,
                backend="mock",
                redis_url=server.url,
                tag="cache",
                backend_opts={"distinct_vectors": 64},
            )
        )
        p50s = {}
        for salt, dtype in enumerate(d.strip() for d in args.dtypes.split(",") if d.strip()):
            settings = ClientSettings(
                redis=RedisSettings(url=server.url), wire_dtype=dtype, local_cache_size=0
            )
            async with await connect_client(args.model, settings, workers) as lm:
                prompts = [distinct_prompt(i, salt) for i in range(args.prompts)]
                await lm.batch_next_token_logprobs(prompts)  # computed once, written to the cache
                before = dict(lm.stats)
                client_ms = await _sequential(lm.next_token_logprobs, prompts, args.calls)
                after = lm.stats
                assert lm.channel.submitter.cache is not None
                keys = [lm.channel.submitter.cache.key(dtype, ids_to_bytes(p)) for p in prompts]
            raw_ms = await _raw_gets(server.url, keys, args.calls)
            hits = after["cache_hits"] - before["cache_hits"]
            sent = after["sent"] - before["sent"]
            p50s[dtype] = _record(report, dtype, client_ms, raw_ms, hits, sent)
    return p50s


async def _sequential(call: Any, prompts: list[list[int]], calls: int) -> list[float]:
    """Milliseconds of each of `calls` awaits, one after another, cycling through `prompts`."""
    latencies = []
    for i in range(calls):
        started = time.perf_counter()
        await call(prompts[i % len(prompts)])
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


async def _raw_gets(url: str, keys: list[str], calls: int) -> list[float]:
    """The floor: a bare redis-py GET of the same cached vectors."""
    redis = async_redis(url)
    try:
        await redis.get(keys[0])  # connect outside the timing
        return await _sequential(redis.get, keys, calls)  # type: ignore[arg-type]
    finally:
        await redis.aclose()


def _record(
    report: Report, dtype: str, client_ms: list[float], raw_ms: list[float], hits: int, sent: int
) -> float:
    figures = {
        "calls": len(client_ms),
        "shared_cache_hits": hits,
        "sent_to_workers": sent,
        "p50_ms": round(percentile(client_ms, 50), 4),
        "p90_ms": round(percentile(client_ms, 90), 4),
        "p99_ms": round(percentile(client_ms, 99), 4),
        "mean_ms": round(sum(client_ms) / len(client_ms), 4),
        "raw_get_p50_ms": round(percentile(raw_ms, 50), 4),
        "raw_get_p99_ms": round(percentile(raw_ms, 99), 4),
    }
    line = (
        f"{dtype:<8} hit p50 {figures['p50_ms']:.3f} ms  p99 {figures['p99_ms']:.3f} ms  "
        f"(raw GET p50 {figures['raw_get_p50_ms']:.3f} ms, p99 {figures['raw_get_p99_ms']:.3f}"
        f" ms; {hits} hits, {sent} sent to workers)"
    )
    report.figure(dtype, figures, line=line)
    return float(figures["p50_ms"])
