"""The scheduler process: an arq worker whose one function runs experiments.

`serve` opens the process's two Redis roles (`scheduler.planes`: tenants' experiment keys on
the data plane, arq and the leases on the control plane) around the arq worker, whose pool is
the control plane's. Its lifespan (arq's ``on_startup``/``on_shutdown``) holds the kinds, the
tenant limit and the `Dispatcher` task. Cron entries of the settings become arq cron jobs that
submit a fresh experiment (id ``<name>-<UTC time>``) for their tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from arq import Retry, cron
from arq.cron import CronJob
from arq.worker import func

from lmqueue.producer.experiments import Experiments
from lmqueue.shared.experiment_kinds import encode_catalog
from lmqueue.shared.redis_errors import REDIS_AUTH, REDIS_DOWN

from .dispatcher import JOB_FUNCTION, Dispatcher
from .kinds import kind_specs, resolve_kinds
from .limits import TenantLimit
from .outage import ResilientWorker, retrying
from .planes import Planes, arq_settings, open_planes
from .run import ExperimentRun, SchedulerRuntime
from .serialization import pack, unpack
from .settings import CronEntry, SchedulerSettings

__all__ = ["build_worker", "run_experiment", "serve"]

logger = logging.getLogger(__name__)

#: An experiment whose run an outage cut short is tried again this long after.
_OUTAGE_RETRY_S = 1.0
#: arq keeps a job's result at most this long (the experiment's record says the same).
_ARQ_RESULT_S = 24 * 3600


async def run_experiment(ctx: dict[str, Any], tenant: str, experiment_id: str) -> dict[str, Any]:
    """arq job: run one experiment of `tenant` (see `ExperimentRun`)."""
    runtime: SchedulerRuntime = ctx["lmq"]
    try:
        return await ExperimentRun(runtime, tenant, experiment_id, ctx["job_id"]).execute()
    except REDIS_AUTH:
        raise
    except REDIS_DOWN as exc:
        # arq fails a job on any other exception, and its record would stay "running" with no
        # job left to finish it: an outage that escaped the run's own retries runs it again
        logger.warning("experiment %s of %s: %r; it runs again", experiment_id, tenant, exc)
        raise Retry(defer=_OUTAGE_RETRY_S) from exc


async def _startup(ctx: dict[str, Any]) -> None:
    settings: SchedulerSettings = ctx["settings"]
    # Experiments do small-vector math (one 50k-vector per particle and step) on the event
    # loop; torch's intra-op threads only contend for the cores (10x slower here, measured:
    # 5 SMC steps x 6 particles took 1.4 s with 2 threads under load, 0.14 s with 1).
    # Imported here: importing `lmqueue.scheduler` (as the demo does, for the sampler) needs no
    # torch.
    import torch

    torch.set_num_threads(1)
    planes: Planes = ctx["planes"]
    kinds = resolve_kinds(settings.kinds)
    limit = TenantLimit(planes.control, settings.max_running_per_tenant, settings.lease_s)
    ctx["lmq"] = SchedulerRuntime(settings, planes.data, planes.control, kinds, limit)
    # tenants' clients check submissions against it (kind, parameters): see Experiments.check
    catalog = encode_catalog(kind_specs(kinds))
    await retrying(lambda: planes.data.set(settings.keyspace().experiment_kinds(), catalog),
                   "publishing the experiment kinds")  # fmt: skip
    dispatcher = Dispatcher(settings, planes.data, ctx["redis"], set(kinds))
    ctx["dispatcher"] = asyncio.create_task(dispatcher.run(), name="lmq-dispatcher")


async def _shutdown(ctx: dict[str, Any]) -> None:
    task = ctx.get("dispatcher")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _cron_job(entry: CronEntry) -> CronJob:
    async def submit(ctx: dict[str, Any]) -> str:
        runtime: SchedulerRuntime = ctx["lmq"]
        experiments = Experiments(runtime.data, runtime.settings.keyspace(entry.tenant))
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return await experiments.submit(
            entry.kind, entry.params, model=entry.model, experiment_id=f"{entry.name}-{stamp}"
        )

    schedule: dict[str, Any] = {
        k: set(v) if isinstance(v, list) else v for k, v in entry.schedule.items()
    }
    return cron(submit, name=f"cron:{entry.name}", unique=True, **schedule)


def build_worker(settings: SchedulerSettings, planes: Planes, **overrides: Any) -> ResilientWorker:
    """The arq worker of one scheduler process (msgpack jobs, the experiment function, crons),
    its queue on the control plane of `planes`."""
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
        "redis_settings": arq_settings(planes.control_url),
        "queue_name": queue,
        "job_serializer": pack,
        "job_deserializer": unpack,
        "max_jobs": settings.max_jobs,
        "poll_delay": settings.poll_delay_s,
        # arq's result only repeats the record's final status: kept no longer than the record
        "keep_result": min(settings.keep_finished_s or _ARQ_RESULT_S, _ARQ_RESULT_S),
        "on_startup": _startup,
        "on_shutdown": _shutdown,
        "ctx": {"settings": settings, "planes": planes},
        "health_check_interval": 60,
        "claim_lease_s": settings.lease_s,
    }
    options.update(overrides)
    return ResilientWorker(**options)


async def serve(settings: SchedulerSettings) -> None:
    """Run a scheduler process until SIGINT/SIGTERM (its experiments resume elsewhere).

    Raises:
        SettingsError: if the control plane is not a single instance (`open_planes`).
    """
    async with open_planes(settings) as planes:
        worker = build_worker(settings, planes)
        try:
            await worker.async_run()
        except asyncio.CancelledError:
            pass
        finally:
            await worker.close()
