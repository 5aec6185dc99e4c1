"""The worker process: ``lmq worker`` / ``python -m lmqueue.workers``.

Settings come from ``LMQ_*`` environment variables, overridden by command-line flags. SIGTERM
and SIGINT set the stop event: the worker stops reading, finishes in-flight batches within
``shutdown_grace_s``, leaves the live-worker set and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from lmqueue.shared import stage_trace
from lmqueue.shared.adapters import parse_adapter_spec
from lmqueue.shared.errors import InvalidName, SettingsError
from lmqueue.shared.failures import ArgumentParser, configure_logging, report_failure
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.redis_roles import connect_redis_roles
from lmqueue.shared.redis_version import check_redis_version
from lmqueue.shared.settings import BACKENDS, RedisSettings, WorkerSettings

from .backend_loader import batching_for_device, load_backend, one_torch_team
from .event_loop import loop_name, run_on
from .health import HealthServer, HealthState
from .metrics import WorkerMetrics
from .startup_line import startup_line
from .upkeep import health_state
from .worker import Worker

__all__ = ["main", "build_parser", "run_worker", "settings_from_args"]

logger = logging.getLogger(__name__)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The worker's flags; each overrides the LMQ_* variable of the same name."""
    parser = parser or ArgumentParser(prog="lmq worker", description=__doc__)
    parser.add_argument("--model", help="model alias, directory or hub id (LMQ_MODEL)")
    parser.add_argument("--backend", choices=list(BACKENDS), help="(LMQ_BACKEND)")
    parser.add_argument("--redis-url", help="queue Redis (LMQ_REDIS_URL or REDIS_URL)")
    parser.add_argument(
        "--cache-url", help="shared-cache Redis, default: the queue's (LMQ_CACHE_URL)"
    )
    parser.add_argument("--name", help="stable consumer name (LMQ_NAME), default host-pid")
    parser.add_argument("--batch-size", type=int, help="entries per read (LMQ_BATCH_SIZE)")
    parser.add_argument("--max-wait-ms", type=int, help="wait to fill a batch (LMQ_MAX_WAIT_MS)")
    parser.add_argument(
        "--anticipate-ms", type=int,
        help="hold a busy worker's next batch for a returning tenant (LMQ_ANTICIPATE_MS; 0: off)",
    )  # fmt: skip
    parser.add_argument("--device", help="torch device for hf, e.g. cuda:0 (LMQ_DEVICE)")
    parser.add_argument("--backend-opts", help="JSON object of backend options (LMQ_BACKEND_OPTS)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... (LMQ_LOG_LEVEL)")
    parser.add_argument(
        "--metrics-port", type=int,
        help="serve /metrics, /healthz and /readyz on this port (LMQ_METRICS_PORT; 0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-host",
        help="address of that server (LMQ_METRICS_HOST; default 127.0.0.1, 0.0.0.0: all)",
    )
    parser.add_argument(
        "--partitions", type=int,
        help="request stream partitions for prefix affinity, the same on every worker of the "
        "model (LMQ_PARTITIONS; 1: one stream)",
    )  # fmt: skip
    parser.add_argument(
        "--adapter", action="append", metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in directory PATH as NAME (public; repeatable)",
    )  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="show tracebacks of failures")
    return parser


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> WorkerSettings:
    """Settings from the environment (`environ`, default the process's) with the flags on top."""
    redis = RedisSettings.from_env(environ)
    if args.redis_url:
        redis = replace(redis, url=args.redis_url)
    if args.cache_url:
        redis = replace(redis, cache_url=args.cache_url)
    overrides: dict[str, Any] = {"redis": redis}
    names = ("model", "backend", "name", "batch_size", "max_wait_ms", "anticipate_ms", "device",
             "log_level", "metrics_port", "metrics_host", "partitions")  # fmt: skip
    for name in names:
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    if args.backend_opts:
        try:
            overrides["backend_opts"] = json.loads(args.backend_opts)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"--backend-opts={args.backend_opts!r}: {exc}") from None
        if not isinstance(overrides["backend_opts"], dict):
            raise SettingsError(f"--backend-opts={args.backend_opts!r}: expected a JSON object")
    if getattr(args, "adapter", None):
        try:
            overrides["adapters"] = dict(parse_adapter_spec(spec) for spec in args.adapter)
        except InvalidName as exc:
            raise SettingsError(f"--adapter: {exc.message}") from None
    return WorkerSettings.from_env(environ, **overrides)


async def run_worker(settings: WorkerSettings, stop: asyncio.Event | None = None) -> None:
    """Load the backend, serve until `stop` (or SIGTERM/SIGINT), then release everything."""
    stop = stop or asyncio.Event()
    if settings.stage_trace_dir:
        stage_trace.start(settings.stage_trace_dir, "worker")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics, health = WorkerMetrics(settings.model), health_state(settings)
    try:
        async with _probes(settings, metrics, health):  # answering while the model loads
            await _serve(settings, stop, metrics, health)
    finally:
        stage_trace.stop()


@contextlib.asynccontextmanager
async def _probes(
    settings: WorkerSettings, metrics: WorkerMetrics, health: HealthState
) -> AsyncIterator[None]:
    """The metrics and probe server on `settings.metrics_port`, if one is set."""
    if not settings.metrics_port:
        yield
        return
    server = HealthServer(health, metrics.registry, settings.metrics_host, settings.metrics_port)
    async with server:
        yield


async def _serve(
    settings: WorkerSettings, stop: asyncio.Event, metrics: WorkerMetrics, health: HealthState
) -> None:
    roles = await connect_redis_roles(settings.redis)  # first: a wrong password fails at once
    try:  # then a Redis too old to serve from, before minutes of model loading
        await _check_versions(settings, roles)
        logger.info("loading %s backend for %s", settings.backend, settings.model)
        settings = one_torch_team(batching_for_device(settings))
        backend = await asyncio.to_thread(load_backend, settings)
    except BaseException:
        await roles.aclose()
        raise
    loop = loop_name(asyncio.get_running_loop())
    logger.info(startup_line(settings.name, settings.model, backend, loop))
    try:
        with redis_boundary(f"worker {settings.name}", settings.redis.url):
            worker = Worker(
                settings, backend, roles.queue, roles.cache if roles.separate else None,
                masses=_masses(backend), metrics=metrics, health=health,
            )  # fmt: skip
            await worker.serve(stop)
    finally:
        await backend.aclose()
        await roles.aclose()
        logger.info("worker %s stopped", settings.name)


async def _check_versions(settings: WorkerSettings, roles: Any) -> None:
    """Refuse a queue or cache Redis older than lmqueue's minimum (`shared.redis_version`)."""
    timeout_s = settings.redis.connect_timeout_s
    await check_redis_version(roles.queue, settings.redis.url, "queue", timeout_s)
    if roles.separate and roles.cache is not None:
        await check_redis_version(roles.cache, roles.cache_url or "", "cache", timeout_s)


def _masses(backend: Any) -> Any:
    """The trie-mass computer over the backend's vocabulary."""
    from .masses import TrieMasses

    return TrieMasses(backend.byte_vocab)


def _return_freed_memory_to_the_os(
    threshold_bytes: int = 128 << 10, keep_free_bytes: int = 32 << 20
) -> bool:
    """Serve allocations above `threshold_bytes` by mmap, so freeing them shrinks the process.

    A forward allocates and frees tens of MB of padded KV every step, and every reply a
    vector of ~200 KB. glibc raises its mmap threshold after each large free (up to 32 MB),
    after which such blocks come from the heap, which fragments and rarely shrinks: the
    worker's RSS creeps past every configured bound. A fixed threshold below one vector stops
    that, for a few syscalls per batch.

    Fixing the threshold also fixes glibc's trim threshold at 128 KB, so the heap gave its top
    back to the OS after every batch and faulted it in again for the next: float16 payloads
    (96 KB, below the mmap threshold) then cost 103 CPU us each to produce instead of 32
    (measured on 64 vectors made and freed together). Up to `keep_free_bytes` of free heap top
    stay mapped instead; that memory was in use a moment before, so the peak does not grow.
    Returns False where glibc's ``mallopt`` is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    trimmed = libc.mallopt(m_trim_threshold, keep_free_bytes)
    return bool(libc.mallopt(m_mmap_threshold, threshold_bytes) and trimmed)


def main(argv: list[str] | None = None, verbose: bool = False) -> int:
    """Run a worker; returns the process exit code (a failure is reported as one line)."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_level.upper())
        if settings.malloc_mmap_threshold:  # before the model's weights are allocated
            _return_freed_memory_to_the_os(settings.malloc_mmap_threshold)
        run_on(settings.event_loop, run_worker(settings))
    except (Exception, KeyboardInterrupt) as exc:
        return report_failure("lmq worker", exc, verbose or args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
