"""The scheduler process: an arq worker whose one function runs experiments.

Its lifespan (arq's ``on_startup``/``on_shutdown``) holds the process's own Redis client, the
kinds, the tenant limit and the `Dispatcher` task. Cron entries of the settings become arq cron
jobs that submit a fresh experiment (id ``<name>-<UTC time>``) for their tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch
from arq import Worker, cron
from arq.connections import RedisSettings as ArqRedisSettings
from arq.cron import CronJob
from arq.worker import func

from producer.experiments import Experiments
from shared.connections import async_redis

from .dispatcher import JOB_FUNCTION, Dispatcher
from .kinds import resolve_kinds
from .limits import TenantLimit
from .run import ExperimentRun, SchedulerRuntime
from .serialization import pack, unpack
from .settings import CronEntry, SchedulerSettings

__all__ = ["build_worker", "serve"]


async def run_experiment(ctx: dict[str, Any], tenant: str, experiment_id: str) -> dict[str, Any]:
    """arq job: run one experiment of `tenant` (see `ExperimentRun`)."""
    runtime: SchedulerRuntime = ctx["lmq"]
    return await ExperimentRun(runtime, tenant, experiment_id, ctx["job_id"]).execute()


async def _startup(ctx: dict[str, Any]) -> None:
    settings: SchedulerSettings = ctx["settings"]
    # Experiments do small-vector math (one 50k-vector per particle and step) on the event
    # loop; torch's intra-op threads only contend for the cores (10x slower here, measured:
    # 5 SMC steps x 6 particles took 1.4 s with 2 threads under load, 0.14 s with 1).
    torch.set_num_threads(1)
    redis = async_redis(settings.redis_url)
    kinds = resolve_kinds(settings.kinds)
    limit = TenantLimit(redis, settings.max_running_per_tenant, settings.lease_s)
    ctx["lmq"] = SchedulerRuntime(settings, redis, kinds, limit)
    dispatcher = Dispatcher(settings, redis, ctx["redis"], set(kinds))
    ctx["dispatcher"] = asyncio.create_task(dispatcher.run(), name="lmq-dispatcher")


async def _shutdown(ctx: dict[str, Any]) -> None:
    task = ctx.get("dispatcher")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    runtime: SchedulerRuntime | None = ctx.get("lmq")
    if runtime is not None:
        await runtime.redis.aclose()


def _cron_job(entry: CronEntry) -> CronJob:
    async def submit(ctx: dict[str, Any]) -> str:
        runtime: SchedulerRuntime = ctx["lmq"]
        experiments = Experiments(runtime.redis, runtime.settings.keyspace(entry.tenant))
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return await experiments.submit(
            entry.kind, entry.params, model=entry.model, experiment_id=f"{entry.name}-{stamp}"
        )

    schedule: dict[str, Any] = {
        k: set(v) if isinstance(v, list) else v for k, v in entry.schedule.items()
    }
    return cron(submit, name=f"cron:{entry.name}", unique=True, **schedule)


def build_worker(settings: SchedulerSettings, **overrides: Any) -> Worker:
    """The arq worker of one scheduler process (msgpack jobs, the experiment function, crons)."""
    queue = settings.keyspace().scheduler_queue()
    options: dict[str, Any] = {
        "functions": [
            # retries are counted per start in the record (max_attempts); arq's tries also
            # count each wait for the tenant's limit (Retry), so they are not bounded here
            func(
                run_experiment,
                name=JOB_FUNCTION,
                max_tries=1 << 30,
                timeout=settings.job_timeout_s,
            )
        ],
        "cron_jobs": [_cron_job(entry) for entry in settings.cron],
        "redis_settings": ArqRedisSettings.from_dsn(settings.redis_url),
        "queue_name": queue,
        "job_serializer": pack,
        "job_deserializer": unpack,
        "max_jobs": settings.max_jobs,
        "poll_delay": settings.poll_delay_s,
        "keep_result": 24 * 3600,
        "on_startup": _startup,
        "on_shutdown": _shutdown,
        "ctx": {"settings": settings},
        "health_check_interval": 60,
    }
    options.update(overrides)
    return Worker(**options)


async def serve(settings: SchedulerSettings) -> None:
    """Run a scheduler process until SIGINT/SIGTERM (its experiments resume elsewhere)."""
    worker = build_worker(settings)
    try:
        await worker.async_run()
    except asyncio.CancelledError:
        pass
    finally:
        await worker.close()
