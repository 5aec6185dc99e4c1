"""``lmq bench transport``: full-vocabulary replies per second, lmqueue against the raw probe.

The mock backend does no compute (``distinct_vectors``: vectors precomputed once), so what is
measured is the queue: the client, the worker's read-decode-encode-write loop and Redis. Each
dtype runs these configurations, one after another, in one run:

* ``probe``: redis-py alone moving the same payloads in the same process layout (`probe`);
* ``defaults``: lmqueue as shipped, worker writing every result to a separate LRU cache
  instance and the client looking there first (the recommended two-instance layout); fresh
  results travel as claim-checks (the cache key; the client fetches the vector there);
* ``inline``: the same workers and cache, the client asking for no claim-checks, so each
  fresh result travels inline besides its cache entry (what claim-checks save or cost);
* ``no_cache``: cache writes off (``LMQ_CACHE_WRITES=0``) and ``use_shared_cache=False``;
* ``half_results`` (float16 only): the defaults, the client handing results out as float16
  (``half_results``) instead of widening each to float32: what the float32 results cost.

``--no-resp-pipe`` makes the clients of this process receive replies and claim-checks through
redis-py instead of `producer.resp_pipe.RespPipe` (as over TLS), to measure what that
hand-written RESP client alone is worth: run it alternately with and without, same load.

``--batch-size`` is every worker's batch size (``LMQ_BATCH_SIZE``; default the worker's own,
32): a worker's loop pays a share of its CPU per batch (reads, the cache lookup, the hand-off
to its writer), so its CPU per reply depends on how many rows a batch holds, and a GPU worker
batches more rows than the CPU default (``gpu_batch_size``). The defaults' figures are the
benchmark's verdict; other sizes say how the per-batch share falls.

Prompts are all distinct, so no reply comes from a cache or from deduplication. Besides
replies per second, each window reports the CPU microseconds per reply of the client, the
worker (or probe reader) and Redis, which a loaded machine distorts far less. With both
dtypes, each process's CPU a float16 reply over its float32 one is printed too (the probe's and
the defaults'): half the bytes should cost about half the CPU. The mock converts each of its
precomputed vectors to a 16-bit dtype once (`MockAsyncLM.wire_payload`), as the probe sends
precomputed bytes and a GPU backend would narrow on its device.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from lmqueue.devstack import CACHE_POLICY
from lmqueue.shared.settings import DEFAULT_BATCH_SIZE, ClientSettings, RedisSettings

from .lib.load import (
    WIRE_BYTES,
    add_load_arguments,
    measure_distinct_calls,
    record_window,
    wire_dtypes,
)
from .lib.probe import run_probe
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import (
    CpuMeter,
    batch_size_env,
    connect_client,
    redis_server,
    server_pid,
    wait_for_workers,
    worker_pool,
)
from .lib.transport_scale import add_scale_arguments, run_scale, scale_summary

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    add_load_arguments(parser)
    add_scale_arguments(parser)
    parser.add_argument("--cache-maxmemory", default="256mb", help="of the defaults' cache Redis")
    parser.add_argument(
        "--batch-size",
        type=_positive,
        default=DEFAULT_BATCH_SIZE,
        help=f"every worker's batch size, LMQ_BATCH_SIZE (default {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--resp-pipe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="clients read replies through RespPipe (off: redis-py, as on TLS)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/transport.json``."""
    report = Report("transport", {k: str(v) for k, v in vars(args).items()})
    report.figure("batch_size", args.batch_size)
    if args.clients or args.workers:
        figures = asyncio.run(run_scale(args, report))
        return report.finish(figures, scale_summary(figures) + _batch_note(args), args.out_dir)
    with contextlib.ExitStack() as stack:
        if not args.resp_pipe:
            stack.enter_context(_without_resp_pipe())
        ratios = asyncio.run(_run(args, report))
    parts = []
    for dtype in wire_dtypes(args):
        defaults, no_cache = ratios[f"{dtype}.defaults"], ratios[f"{dtype}.no_cache"]
        inline = ratios[f"{dtype}.inline"]
        half = ratios.get(f"{dtype}.half_results")
        parts.append(f"{dtype} {defaults:.2f}x (defaults) {inline:.2f}x (inline) "
                     f"{no_cache:.2f}x (cache writes off)"
                     + (f" {half:.2f}x (half results)" if half is not None else ""))  # fmt: skip
    headline = {k: v for k, v in ratios.items() if not k.endswith(".cpu")}
    pipe = "" if args.resp_pipe else " (RespPipe off: redis-py)"
    summary = f"transport ratio lmqueue/raw-probe{pipe}: " + "; ".join(parts) + "  [target >= 0.9x]"
    halves = _half_cpu_ratios(report)
    if halves:
        summary += (f"; float16/float32 CPU a reply, defaults: {_joined(halves['defaults'])}"
                    "  [target about 0.5]")  # fmt: skip
    return report.finish({**headline, **ratios}, summary + _batch_note(args), args.out_dir)


def _batch_note(args: argparse.Namespace) -> str:
    """The last line's mark of a run whose workers did not batch as shipped."""
    if args.batch_size == DEFAULT_BATCH_SIZE:
        return ""
    return f"  (workers' batch size {args.batch_size}, not the default {DEFAULT_BATCH_SIZE})"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of rows")
    return value


def _half_cpu_ratios(report: Report) -> dict[str, dict[str, float]]:
    """Each process's CPU a float16 reply over its CPU a float32 one, for the probe and the
    defaults (printed, and kept as a figure); none unless both dtypes ran.

    A float16 reply is half the bytes: where bytes are the cost, about 0.5 in every process.
    """
    halves: dict[str, dict[str, float]] = {}
    for config in ("probe", "defaults"):
        wide = report.figures.get(f"float32.{config}")
        narrow = report.figures.get(f"float16.{config}")
        if wide is None or narrow is None:
            return {}
        wide_us, narrow_us = wide["cpu_us_per_reply"], narrow["cpu_us_per_reply"]
        halves[config] = {
            name: round(narrow_us[name] / us, 2) if us else math.nan for name, us in wide_us.items()
        }
    line = "; ".join(f"{config} {_joined(shares)}" for config, shares in halves.items())
    report.figure("float16_over_float32_cpu", halves, line=f"float16 / float32 CPU a reply: {line}")
    return halves


def _joined(shares: dict[str, float]) -> str:
    """``client 0.78, worker 0.66, redis 0.54``."""
    return ", ".join(f"{name} {share:.2f}" for name, share in shares.items())


def _without_resp_pipe() -> contextlib.AbstractContextManager[Any]:
    """Clients made meanwhile in this process take redis-py's path for replies and claims."""
    from unittest import mock

    from lmqueue.producer.resp_pipe import RespPipe

    return mock.patch.object(RespPipe, "supports", staticmethod(lambda url: False))


async def _run(args: argparse.Namespace, report: Report) -> dict[str, float]:
    with contextlib.ExitStack() as stack:
        queue_a = stack.enter_context(redis_server())
        cache_a = stack.enter_context(redis_server(args.cache_maxmemory, CACHE_POLICY))
        queue_b = stack.enter_context(redis_server())
        probe_redis = stack.enter_context(redis_server())
        common = dict(
            model=args.model,
            backend="mock",
            backend_opts={"distinct_vectors": args.distinct_vectors},
        )
        env = batch_size_env(args.batch_size)
        workers_a = stack.enter_context(
            worker_pool(
                1, redis_url=queue_a.url, cache_url=cache_a.url, tag="defaults", env=env, **common
            )
        )
        workers_b = stack.enter_context(
            worker_pool(
                1, redis_url=queue_b.url, tag="nocache", env={**env, "LMQ_CACHE_WRITES": "0"},
                **common,
            )
        )  # fmt: skip
        defaults = ClientSettings(redis=RedisSettings(url=queue_a.url, cache_url=cache_a.url))
        no_cache = ClientSettings(redis=RedisSettings(url=queue_b.url), use_shared_cache=False)
        pids_a = [server_pid(queue_a), server_pid(cache_a)]
        configs = {  # workers, Redis pids, client settings, whether it asks for claim-checks
            "defaults": (workers_a, pids_a, defaults, True),
            "inline": (workers_a, pids_a, defaults, False),
            "no_cache": (workers_b, [server_pid(queue_b)], no_cache, True),
            "half_results": (
                workers_a,
                pids_a,
                replace(defaults, wire_dtype="float16", half_results=True),
                True,
            ),
        }
        for workers, _, settings, _ in configs.values():
            await wait_for_workers(settings.redis.url, args.model, workers)
        size = await _vector_size(args.model, configs["no_cache"][2], workers_b)
        report.figure("vector_size", size)
        ratios: dict[str, float] = {}
        for salt, dtype in enumerate(wire_dtypes(args)):
            window = await run_probe(
                probe_redis.url, server_pid(probe_redis), dtype, size,
                args.concurrency, args.warmup_s, args.measure_s,
            )  # fmt: skip
            probe = record_window(report, f"{dtype}.probe", window, size * WIRE_BYTES[dtype])
            for offset, (name, config) in enumerate(configs.items()):
                workers, redis_pids, settings, claims = config
                if settings.half_results and dtype != "float16":
                    continue
                pids = {"client": [os.getpid()], "worker": [w.pid for w in workers]}
                meter = CpuMeter({**pids, "redis": redis_pids})
                lm = await connect_client(args.model, replace(settings, wire_dtype=dtype), workers)
                if not claims:
                    lm.channel.claims.disable()
                async with lm:
                    window = await measure_distinct_calls(lm, 1000 * salt + offset, args, meter)
                    report.figure(
                        f"{dtype}.{name}.client_stats", lm.stats, line=f"client stats {lm.stats}"
                    )
                ours = record_window(report, f"{dtype}.{name}", window, size * WIRE_BYTES[dtype])
                key = f"{dtype}.{name}"
                ratios[key] = round(ours[0] / probe[0], 3) if probe[0] else 0.0
                ratios[f"{key}.cpu"] = round(probe[1] / ours[1], 3) if ours[1] else 0.0
                report.figure(
                    f"{key}.vs_probe", ratios[key], line=_versus(key, ratios, ours, probe)
                )
                if name == "defaults":
                    _excess_over_probe(report, dtype, name)
    return ratios


def _excess_over_probe(report: Report, dtype: str, name: str) -> None:
    """Each process's CPU a reply over the probe's, and the kernel's part of that (printed,
    and kept as a figure): what is not in the kernel is the Python each runs per reply, what
    is in it is mostly the bytes moved (copies through sockets, page faults)."""
    ours, probe = report.figures[f"{dtype}.{name}"], report.figures[f"{dtype}.probe"]
    excess: dict[str, dict[str, float]] = {}
    for process, us in ours["cpu_us_per_reply"].items():
        kernel = ours.get("kernel_us_per_reply", {}).get(process, math.nan)
        probe_kernel = probe.get("kernel_us_per_reply", {}).get(process, math.nan)
        excess[process] = {
            "cpu": round(us - probe["cpu_us_per_reply"][process], 1),
            "kernel": round(kernel - probe_kernel, 1),
        }
    parts = ", ".join(f"{process} {e['cpu']:+.0f} (kernel {e['kernel']:+.0f})"
                      for process, e in excess.items())  # fmt: skip
    line = f"{dtype}.{name} over the probe, CPU us a reply: {parts}"
    report.figure(f"{dtype}.{name}.over_probe_us", excess, line=line)


async def _vector_size(model: str, settings: ClientSettings, workers: Any) -> int:
    async with await connect_client(model, settings, workers) as lm:
        return lm.info.vector_size


def _versus(
    key: str, ratios: dict[str, float], ours: tuple[float, float], probe: tuple[float, float]
) -> str:
    return (
        f"{key}: {ratios[key]:.2f}x the probe's replies/s, {ratios[key + '.cpu']:.2f}x its CPU "
        f"efficiency ({ours[1]:.0f} vs {probe[1]:.0f} CPU us per reply, all processes)"
    )
