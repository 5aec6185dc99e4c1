"""``lmq bench cluster``: the transport benchmark on one Redis against a 3-master Redis Cluster.

The same mock worker (no compute: vectors precomputed) and the same client run against a
single redis-server and against a local Redis Cluster (3 masters; ``--replicas`` adds a replica
to each, whose CPU is counted apart), interleaved in one run, cache writes off and the shared
cache unused (like the transport benchmark's ``no_cache`` configuration). Per window it reports
replies per second and the CPU microseconds per reply of the client, the worker and the Redis
processes. On a 2-core machine several shards cannot add throughput; what this shows is the
per-reply cost of the cluster path: redis-py's cluster client instead of the in-place
`RespPipe`, the per-node pipelines of a worker's replies, and acknowledgements written after
the replies in a second round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

from lmqueue.devstack import LocalCluster
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .lib.load import (
    WIRE_BYTES,
    add_load_arguments,
    measure_distinct_calls,
    record_window,
    wire_dtypes,
)
from .lib.report import DEFAULT_OUT_DIR, Report
from .lib.stack import (
    CpuMeter,
    connect_client,
    redis_server,
    server_pid,
    wait_for_workers,
    worker_pool,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags: the transport benchmark's load, and the cluster's shape."""
    add_load_arguments(parser)
    parser.add_argument("--replicas", type=int, default=0, help="replicas per cluster master")
    parser.add_argument(
        "--vector-size", type=int, default=0,
        help="vector length (mock padding past the model's vocabulary; 0: the vocabulary's)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result written to ``<out-dir>/cluster.json``."""
    report = Report("cluster", {k: str(v) for k, v in vars(args).items()})
    ratios = asyncio.run(_run(args, report))
    parts = [
        f"{dtype} {ratios[f'{dtype}.replies']:.2f}x replies/s, "
        f"{ratios[f'{dtype}.cpu']:.2f}x CPU us per reply"
        for dtype in wire_dtypes(args)
    ]
    summary = "cluster (3 masters) / single instance: " + "; ".join(parts)
    return report.finish(ratios, summary, args.out_dir)


async def _run(args: argparse.Namespace, report: Report) -> dict[str, float]:
    with contextlib.ExitStack() as stack:
        single = stack.enter_context(redis_server())
        cluster = stack.enter_context(LocalCluster(replicas=args.replicas))
        common = dict(
            model=args.model,
            backend="mock",
            backend_opts={
                "distinct_vectors": args.distinct_vectors,
                **({"vector_size": args.vector_size} if args.vector_size else {}),
            },
            env={"LMQ_CACHE_WRITES": "0"},
        )
        urls = {"single": single.url, "cluster": cluster.url}
        pools = {
            name: stack.enter_context(worker_pool(1, redis_url=url, tag=f"cl-{name}", **common))
            for name, url in urls.items()
        }
        masters = set(cluster.master_ports())
        redis_pids = {
            "single": {"redis": [server_pid(single)]},
            "cluster": {
                "redis": [_pid(n) for n in cluster.nodes if n.port in masters],
                "replicas": [_pid(n) for n in cluster.nodes if n.port not in masters],
            },
        }
        for name, url in urls.items():
            await wait_for_workers(url, args.model, pools[name])
        ratios: dict[str, float] = {}
        for salt, dtype in enumerate(wire_dtypes(args)):
            figures = {}
            for offset, name in enumerate(urls):
                settings = ClientSettings(
                    redis=RedisSettings(url=urls[name]), use_shared_cache=False, wire_dtype=dtype
                )
                groups = {"client": [os.getpid()], "worker": [w.pid for w in pools[name]]}
                meter = CpuMeter({**groups, **redis_pids[name]})
                lm = await connect_client(args.model, settings, pools[name])
                async with lm:
                    window = await measure_distinct_calls(lm, 1000 * salt + offset, args, meter)
                    size = lm.info.vector_size
                    report.figure(f"{dtype}.{name}.client_stats", lm.stats)
                figures[name] = record_window(
                    report, f"{dtype}.{name}", window, size * WIRE_BYTES[dtype]
                )
            (one_rate, one_cpu), (many_rate, many_cpu) = figures["single"], figures["cluster"]
            ratios[f"{dtype}.replies"] = round(many_rate / one_rate, 3) if one_rate else 0.0
            ratios[f"{dtype}.cpu"] = round(many_cpu / one_cpu, 3) if one_cpu else 0.0
    return ratios


def _pid(node: Any) -> int:
    assert node.process is not None, "cluster node not started"
    return int(node.process.pid)
