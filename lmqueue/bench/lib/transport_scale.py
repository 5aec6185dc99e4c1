"""``lmq bench transport --clients N --workers M``: replies/s of one worker and of M workers
with N client processes, on one Redis and on a 3-master Redis Cluster.

The worker is the mock with precomputed vectors, so what is measured is the queue. Each
client is a process of its own (`transport_client`), keeping ``--concurrency / N`` calls
outstanding; every prompt is distinct. Clients are as shipped: they look each request up in
the shared cache before sending it (``use_shared_cache``), and the worker does not look it up
again (`workers.recent_writes`); before 2026-12-07 they did not look, and the worker did.
Two deployments, interleaved in one run:

* ``single``: one redis-server holds the queue and the shared cache (claim-checks on);
* ``cluster``: a local Redis Cluster of 3 masters (`LocalCluster`, no replicas) holds both,
  the model's request streams in 3 partitions (``LMQ_PARTITIONS=3``: one slot each) and
  claim-check keys spread over the masters by their hash.

Both hold the cache as the shared layout does: entries bounded by their TTL, here
`CACHE_TTL_S` (``LMQ_CACHE_TTL_S`` of the workers). With the default hour every reply's vector
stayed in memory: the single instance grew by ~0.5 GB a second, and its CPU per reply was
mostly the kernel handing it fresh pages, which made one Redis look 2-3x slower than it is
(and a long run would exhaust the machine's memory). Each window reports the masters' RSS at
its end.

For each, one worker, then M (the others added), each window with the CPU microseconds per
reply of every process: each client, the workers split into their event loops' threads and
their other threads (the writer thread), and each Redis master. One Redis moves every vector
in and out once, so its CPU per reply bounds what one instance carries; the cluster target
(one worker's replies/s >= 2x its rate on one Redis) needs a worker whose own CPU is not the
cap: its event loop's CPU per reply against one Redis's. On a 2-core machine the processes
share two cores and wall-clock scaling cannot show; the CPU figures say what would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from lmqueue.devstack import LocalCluster

from .report import Report
from .stack import (
    add_workers,
    batch_size_env,
    redis_server,
    server_pid,
    wait_for_workers,
    worker_pool,
)
from .transport_client import ClientProcess, ThreadMeter

__all__ = ["add_scale_arguments", "run_scale", "scale_summary"]

#: Cluster masters, and the request-stream partitions spread over them.
MASTERS = 3
#: The scale runs' cache TTL: a claim-check is fetched within milliseconds, and the memory
#: the cache holds stays about replies/s x vector bytes x this (~1-2 GB at this machine's rates).
CACHE_TTL_S = 2
#: The deployments a scale run knows, in the order they run by default.
DEPLOYMENTS = ("single", "cluster")


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that turn the transport benchmark into this one."""
    parser.add_argument("--clients", type=int, default=0, help="client processes (scale mode)")
    parser.add_argument("--workers", type=int, default=0, help="workers (scale mode)")
    parser.add_argument(
        "--deployments",
        default=",".join(DEPLOYMENTS),
        type=_deployment_names,
        help="scale mode: single, cluster, or both (the default; also 'single,cluster')",
    )


def _deployment_names(text: str) -> list[str]:
    """``--deployments``: known names, comma-separated, or ``both`` (an unknown one is refused:
    it used to run as a cluster under its own name)."""
    if text.strip() == "both":
        return list(DEPLOYMENTS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DEPLOYMENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected {', '.join(DEPLOYMENTS)} (comma-separated) or both"
        )
    return names


@dataclass
class _Deployment:
    """Where a scale run's Redis is: its URL, the masters' pids, the workers' environment."""

    name: str
    url: str
    redis_pids: list[int]
    env: dict[str, str]


@contextlib.contextmanager
def _deployment(name: str) -> Iterator[_Deployment]:
    env = {"LMQ_CACHE_TTL_S": str(CACHE_TTL_S)}
    if name == "single":
        with redis_server() as server:
            yield _Deployment(name, server.url, [server_pid(server)], env)
        return
    with LocalCluster(masters=MASTERS, replicas=0) as cluster:
        pids = [int(node.process.pid) for node in cluster.nodes if node.process is not None]
        yield _Deployment(name, cluster.url, pids, {**env, "LMQ_PARTITIONS": str(MASTERS)})


async def run_scale(args: argparse.Namespace, report: Report) -> dict[str, float]:
    """Run every deployment, worker count and dtype; the figures the summary line names."""
    clients, most = max(args.clients, 1), max(args.workers, 1)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    rates: dict[str, float] = {}
    for name in args.deployments:
        with _deployment(name) as deployment:
            rates.update(await _run_deployment(args, report, deployment, clients, most, dtypes))
    return _verdicts(report, rates, dtypes, most)


async def _run_deployment(
    args: argparse.Namespace,
    report: Report,
    deployment: _Deployment,
    clients: int,
    most: int,
    dtypes: list[str],
) -> dict[str, float]:
    spec = dict(
        model=args.model, backend="mock", redis_url=deployment.url,
        env={**deployment.env, **batch_size_env(args.batch_size)},
        backend_opts={"distinct_vectors": args.distinct_vectors},
    )  # fmt: skip
    figures: dict[str, float] = {}
    with worker_pool(1, tag=f"scale-{deployment.name}", **spec) as workers:
        for count in sorted({1, most}):
            if count > len(workers):
                add_workers(workers, count - len(workers), tag=f"scale-{deployment.name}", **spec)
            await wait_for_workers(deployment.url, args.model, workers)
            for salt, dtype in enumerate(dtypes):
                key = f"{dtype}.{deployment.name}.{count}w"
                async with _clients(args, deployment, clients, dtype) as procs:
                    window = await _window(
                        procs, [w.pid for w in workers], deployment.redis_pids,
                        1000 * count + salt, args,
                    )  # fmt: skip
                figures.update(_record(report, key, window, clients))
    return figures


@contextlib.asynccontextmanager
async def _clients(
    args: argparse.Namespace, deployment: _Deployment, count: int, dtype: str
) -> AsyncIterator[list[ClientProcess]]:
    settings = {"url": deployment.url, "model": args.model, "dtype": dtype,
                "concurrency": max(args.concurrency // count, 1),
                "use_shared_cache": True}  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        procs = [ClientProcess(settings) for _ in range(count)]
        await asyncio.gather(*(stack.enter_async_context(p) for p in procs))
        yield procs


async def _window(
    procs: list[ClientProcess],
    worker_pids: list[int],
    redis_pids: list[int],
    salt: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One window: the clients' own figures, and the workers' and Redis's CPU meanwhile."""
    meter = ThreadMeter({"worker": worker_pids, "redis": redis_pids}, worker_pids)
    each = [p.window(salt * 100 + i, args.warmup_s, args.measure_s) for i, p in enumerate(procs)]

    async def metered() -> dict[str, float]:
        await asyncio.sleep(args.warmup_s)
        meter.start()
        await asyncio.sleep(args.measure_s)
        return meter.stop()

    *client_windows, spent = await asyncio.gather(*each, metered())
    return {
        "clients": client_windows,
        "servers": spent,
        "worker_threads": meter.threads,
        "redis_rss_mib": round(sum(_rss_mib(pid) for pid in redis_pids), 1),
    }


def _rss_mib(pid: int) -> float:
    """A process's resident memory now, MiB (0 where it is gone)."""
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0


def _record(report: Report, key: str, window: dict[str, Any], clients: int) -> dict[str, float]:
    """Print one window; its replies/s and CPU us per reply by process kind."""
    replies = sum(int(c["replies"]) for c in window["clients"])
    elapsed = max(float(c["elapsed_s"]) for c in window["clients"])
    per_s = replies / elapsed if elapsed else 0.0
    per_reply = 1e6 / replies if replies else 0.0
    client_us = [float(c["cpu_s"]["client"]) * per_reply for c in window["clients"]]
    threads = window["worker_threads"].values()
    loop_us = sum(t["main"] for t in threads) * per_reply
    other_us = sum(t["other"] for t in threads) * per_reply
    redis_us = float(window["servers"]["redis"]) * per_reply
    line = (
        f"{key:<22} {per_s:8.1f} replies/s  CPU us/reply: clients {sum(client_us):.0f} "
        f"({clients} processes), workers {loop_us + other_us:.0f} (event loop {loop_us:.0f}, "
        f"other threads {other_us:.0f}), redis {redis_us:.0f} (RSS at the end "
        f"{window['redis_rss_mib']:,.0f} MiB)"
    )
    report.figure(key, {**window, "replies_per_s": round(per_s, 1)}, line=line)
    return {
        f"{key}.replies_per_s": round(per_s, 1),
        f"{key}.loop_us": round(loop_us, 1),
        f"{key}.worker_us": round(loop_us + other_us, 1),
        f"{key}.redis_us": round(redis_us, 1),
        f"{key}.client_us": round(sum(client_us), 1),
    }


def scale_summary(figures: dict[str, float]) -> str:
    """The run's last line: the cluster verdicts, or one worker's replies/s on one Redis."""
    verdicts = [f"{k.split('.')[0]} {v:.2f}x" for k, v in figures.items()
                if k.endswith(".loop_cap_vs_one_redis")]  # fmt: skip
    if verdicts:
        return ("transport scale: one worker's event loop could carry, against one Redis: "
                + "; ".join(verdicts) + "  [target >= 2x]")  # fmt: skip
    rates = [f"{k.rsplit('.', 1)[0]} {v:,.0f}/s" for k, v in figures.items()
             if k.endswith(".replies_per_s")]  # fmt: skip
    return "transport scale (no cluster run): replies/s " + "; ".join(rates)


def _verdicts(
    report: Report, rates: dict[str, float], dtypes: list[str], most: int
) -> dict[str, float]:
    """The figures behind the cluster target, per dtype."""
    out = dict(rates)
    for dtype in dtypes:
        single, cluster = f"{dtype}.single.1w", f"{dtype}.cluster.1w"
        if f"{single}.replies_per_s" not in rates or f"{cluster}.replies_per_s" not in rates:
            continue
        ratio = rates[f"{cluster}.replies_per_s"] / max(rates[f"{single}.replies_per_s"], 1e-9)
        # one worker's ceiling: its event loop's thread; one instance's: its CPU per reply
        loop_cap = 1e6 / max(rates[f"{cluster}.loop_us"], 1e-9)
        worker_cap = 1e6 / max(rates[f"{cluster}.worker_us"], 1e-9)
        redis_cap = 1e6 / max(rates[f"{single}.redis_us"], 1e-9)
        out[f"{dtype}.cluster_vs_single"] = round(ratio, 3)
        out[f"{dtype}.loop_cap_vs_one_redis"] = round(loop_cap / redis_cap, 3)
        out[f"{dtype}.worker_cap_vs_one_redis"] = round(worker_cap / redis_cap, 3)
        report.figure(
            f"{dtype}.cluster_target", out[f"{dtype}.loop_cap_vs_one_redis"],
            line=(f"{dtype}: one worker on the cluster {ratio:.2f}x its replies/s on one Redis "
                  f"(2 cores shared); its event loop could carry {loop_cap:,.0f} replies/s, "
                  f"all its threads in series {worker_cap:,.0f}, one Redis {redis_cap:,.0f}: "
                  f"{loop_cap / redis_cap:.2f}x / {worker_cap / redis_cap:.2f}x one Redis "
                  f"[target >= 2x]"),
        )  # fmt: skip
    return out
