"""`ExperimentRun`: one start of one experiment inside an arq job, start to final status.

    queued ──(tenant below its limit)──> running ──> complete | failed | cancelled
      ^  └──(at its limit: arq Retry, deferred)──┘      │
      └──────(scheduler stopped or killed: arq runs the job again, from the checkpoint)

A run that meets `LostOwnership` (its checkpoint refused) steps aside only for another live
run: when Redis came back without some of the writes it had acknowledged (an ``everysec``
AOF, a snapshot) the record may still carry this run's token with fewer rows, or an earlier
run's token with nobody behind it; the job then goes back to arq's queue (`Retry`) and the
next run resumes from what Redis kept, instead of leaving the experiment running forever.

While it runs, a watchdog renews the run's leases (the tenant slot, and arq's in-progress key,
shortened to `lease_s` so that a killed process's job is retried seconds later instead of after
the job timeout), writes progress, and cancels the kind's task when the tenant asks: the
kind's awaits on the model are cancelled, and closing the `QueueLM` withdraws the requests.

The experiment's record and results are on the data plane (`data`, maybe a cluster: every
command here names one key, and the two scripts name one key or one ``{tenant:id}`` slot);
arq's in-progress key and the tenant's leases are on the control plane (`control`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from arq import Retry

from lmqueue.producer import QueueLM
from lmqueue.producer.experiments import ExperimentStatus
from lmqueue.shared.errors import BadRequest
from lmqueue.shared.keys import arq_in_progress
from lmqueue.shared.redis_errors import REDIS_TROUBLE
from lmqueue.shared.settings import ClientSettings, RedisSettings

from .context import ExperimentContext, LostOwnership
from .kinds import Kind
from .limits import TenantLimit
from .outage import retrying
from .settings import SchedulerSettings

#: Old index entries looked at per finished experiment (each finish prunes some: it keeps up).
_PRUNED = 64

__all__ = ["ExperimentRun", "SchedulerRuntime"]

logger = logging.getLogger(__name__)

_WATCH_S = 0.25
_INTERRUPTED = """
redis.call('HSET', KEYS[1], 'status', 'queued', 'waiting', 'interrupted; resumes')
return redis.call('HINCRBY', KEYS[1], 'attempts', -1)
"""
#: After a refused checkpoint: 0 if another run owns the experiment (its token, running, seen
#: within the lease) or it has finished; else 1, having put it back to queued (no attempt
#: spent: the refusal was Redis's loss, not the kind's).
_STEP_ASIDE = """
local record = KEYS[1]
local status = redis.call('HGET', record, 'status')
if status == 'queued' then return 1 end  -- put back already: its attempt given back
if status ~= 'running' then return 0 end
if redis.call('HGET', record, 'run_token') ~= ARGV[1] then
  local seen = math.max(tonumber(redis.call('HGET', record, 'updated_ms')) or 0,
                        tonumber(redis.call('HGET', record, 'started_ms')) or 0)
  if tonumber(ARGV[2]) - seen < tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', record, 'status', 'queued', 'waiting', 'Redis lost writes of its run; resumes')
redis.call('HINCRBY', record, 'attempts', -1)
return 1
"""


@dataclass
class SchedulerRuntime:
    """What every job of one scheduler process shares."""

    settings: SchedulerSettings
    #: the data plane: tenants' experiment keys (a single instance or a cluster client)
    data: Any
    #: the control plane: arq's keys and the leases (a single instance)
    control: Any
    kinds: dict[str, Kind]
    limit: TenantLimit


class ExperimentRun:
    """Run experiment `experiment_id` of `tenant` as arq job `job_id`."""

    def __init__(self, runtime: SchedulerRuntime, tenant: str, experiment_id: str, job_id: str):
        self.rt = runtime
        self.settings = runtime.settings
        self.redis = runtime.data
        self.control = runtime.control
        self.keys = runtime.settings.keyspace(tenant)
        self.tenant = tenant
        self.id = experiment_id
        self.job_id = job_id
        self.record = self.keys.experiment_record(experiment_id)
        self.slot = (self.keys.experiments_running(), experiment_id)
        self.cancelled_by_tenant = False
        self.superseded = False

    async def execute(self) -> dict[str, Any]:
        """Run it (or decline to); the final status, as arq's (msgpack) job result."""
        raw = await retrying(lambda: self.redis.hgetall(self.record), f"experiment {self.id}")
        if not raw:
            return {"status": "missing"}
        status = ExperimentStatus.from_record(self.tenant, self.id, raw)
        if status.finished:
            return {"status": status.status}
        if status.cancel_requested:
            return await self._finish("cancelled")
        if not await retrying(lambda: self.rt.limit.acquire(*self.slot), "tenant limit"):
            waiting = f"tenant limit: {self.settings.max_running_per_tenant} running"
            await retrying(lambda: self.redis.hset(self.record, "waiting", waiting), "waiting")
            raise Retry(defer=self.settings.limit_retry_s)
        try:
            return await self._run(raw)
        finally:
            await asyncio.shield(retrying(lambda: self.rt.limit.release(*self.slot), "release"))

    async def _run(self, raw: dict[bytes, bytes]) -> dict[str, Any]:
        # arq's in-progress key first: until it is shortened to the lease, a run cut short
        # here would keep its job from running again for the job timeout (days)
        in_progress = arq_in_progress(self.job_id)
        await retrying(lambda: self.control.pexpire(in_progress, self._lease_ms), "lease")
        # (a reply lost with the connection may count this start twice: attempts only bound
        # how often a run starts, and an outage spent one)
        attempts = await retrying(lambda: self.redis.hincrby(self.record, "attempts", 1), "start")
        if attempts > self.settings.max_attempts:
            error = f"gave up after {attempts - 1} starts (the scheduler stopped during each)"
            return await self._finish("failed", error)
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        kind = self.rt.kinds.get(fields.get("kind", ""))
        if kind is None:
            return await self._finish("failed", f"unknown kind {fields.get('kind')!r}")
        context = await self._start(fields)
        task = asyncio.create_task(self._call(kind, context, fields))
        watchdog = asyncio.create_task(self._watch(task, context))
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.superseded and current is not None and not current.cancelling():
                return await self._lost_ownership(context)
            if self.cancelled_by_tenant and current is not None and not current.cancelling():
                return await self._finish("cancelled", context=context)
            await asyncio.shield(self._interrupted())
            raise  # arq runs the job again (retry_jobs)
        except LostOwnership:
            return await self._lost_ownership(context)
        except Exception as exc:
            logger.info("experiment %s of %s failed: %r", self.id, self.tenant, exc)
            return await self._finish("failed", f"{type(exc).__name__}: {exc}", context)
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        return await self._finish("complete", context=context)

    async def _lost_ownership(self, context: ExperimentContext) -> dict[str, Any]:
        """A checkpoint was refused: superseded if another live run owns the experiment;
        otherwise Redis lost some of this run's acknowledged writes, and the job runs again
        from what Redis kept (raises `Retry`)."""
        args = [context.run_token, int(time.time() * 1000), self._lease_ms]
        what = f"experiment {self.id}"
        if not await retrying(lambda: self.redis.eval(_STEP_ASIDE, 1, self.record, *args), what):
            logger.warning("experiment %s of %s: another run took it over", self.id, self.tenant)
            return {"status": "superseded"}
        logger.warning(
            "experiment %s of %s: Redis lost writes of this run; it resumes from what Redis kept",
            self.id, self.tenant,
        )  # fmt: skip
        raise Retry(defer=self.settings.limit_retry_s)

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.lease_s * 1000)

    async def _start(self, fields: dict[str, str]) -> ExperimentContext:
        token = secrets.token_hex(8)
        now_ms = int(time.time() * 1000)
        mapping = {
            "status": "running",
            "run_token": token,
            "started_ms": now_ms,
            "waiting": "",
            "scheduler": self.settings.name,
        }
        await retrying(lambda: self.redis.hset(self.record, mapping=mapping), "starting")
        rows = await retrying(
            lambda: self.redis.llen(self.keys.experiment_results(self.id)), "starting"
        )
        state = json.loads(fields.get("state") or "{}")
        done, total = int(fields.get("done") or 0), int(fields.get("total") or 0)
        return ExperimentContext(
            self.redis, self.keys, self.id, fields.get("model", ""), token, state, rows, done, total
        )

    async def _call(self, kind: Kind, context: ExperimentContext, fields: dict[str, str]) -> None:
        params = json.loads(fields.get("params") or "{}")
        if not context.model:
            rows = await kind(context, None, params)
        else:
            settings = ClientSettings(
                redis=RedisSettings(
                    url=self.settings.url_of(self.tenant),
                    prefix=self.settings.prefix,
                    tenant=self.tenant,
                ),
                connect_timeout_s=self.settings.connect_timeout_s,
                # a client per experiment, dropped after it: with the collector's young
                # threshold raised, dropped clients' memory waited for rare full passes (the
                # soak's scheduler RSS +58-60 MiB in 5 minutes), so this process keeps 700
                gc_young_threshold=0,
            )
            lm = await QueueLM.connect(
                context.model, settings=settings, adapter=_adapter_param(params)
            )
            try:
                rows = await kind(context, lm, params)
            finally:
                await asyncio.shield(lm.close())
        if rows:
            await context.checkpoint(list(rows), context.state)

    async def _watch(self, task: asyncio.Task[None], context: ExperimentContext) -> None:
        """Renew leases, write progress, and cancel `task` when the tenant asks."""
        while not task.done():
            await asyncio.sleep(_WATCH_S)
            try:  # renewed every tick: a lease survives a loop stalled for most of `lease_s`;
                # set, not only extended: a Redis back from a restart may have lost the claim
                claim = arq_in_progress(self.job_id)
                await self.control.set(claim, b"1", px=self._lease_ms)
                await self.rt.limit.renew(*self.slot)
                if await self.redis.hget(self.record, "cancel_requested") == b"1":
                    self.cancelled_by_tenant = True
                    task.cancel()
                    return
                await context.flush_progress()
            except LostOwnership:
                self.superseded = True
                task.cancel()
                return
            except REDIS_TROUBLE as exc:  # the kind's own calls will say if Redis is gone
                logger.warning("experiment %s: watchdog: %r", self.id, exc)

    async def _interrupted(self) -> None:
        """The scheduler is stopping: back to queued; a clean hand-over costs no attempt.

        One script on the record (a cluster client has no MULTI; one key is one slot).
        """
        await self.redis.eval(_INTERRUPTED, 1, self.record)

    async def _finish(
        self, status: str, error: str = "", context: ExperimentContext | None = None
    ) -> dict[str, Any]:
        mapping: dict[str, Any] = {
            "status": status,
            "error": error,
            "finished_ms": int(time.time() * 1000),
            "waiting": "",
        }
        if context is not None:
            mapping.update(done=context.done, total=context.total, rate=f"{context.rate:.6g}")
        await asyncio.shield(
            retrying(lambda: self.redis.hset(self.record, mapping=mapping), f"finishing {self.id}")
        )
        await asyncio.shield(retrying(self._keep_for_a_while, f"expiring {self.id}"))
        logger.info("experiment %s of %s: %s %s", self.id, self.tenant, status, error)
        return {"status": status, "error": error}

    async def _keep_for_a_while(self) -> None:
        """A finished experiment's record and results expire after ``keep_finished_s``, and
        the tenant's index forgets the ids whose record has gone: kept forever, every
        experiment would grow the queue Redis (``noeviction``) for good (``lmq bench soak``)."""
        keep_ms = int(self.settings.keep_finished_s * 1000)
        if keep_ms <= 0:
            return
        await self.redis.pexpire(self.record, keep_ms)
        await self.redis.pexpire(self.keys.experiment_results(self.id), keep_ms)
        index = self.keys.experiment_index()
        cutoff_ms = int(time.time() * 1000) - keep_ms
        old = await self.redis.zrangebyscore(index, "-inf", cutoff_ms, start=0, num=_PRUNED)
        gone = []
        for raw in old:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if not await self.redis.exists(self.keys.experiment_record(name)):
                gone.append(raw)
        if gone:
            await self.redis.zrem(index, *gone)


def _adapter_param(params: dict[str, Any]) -> str | None:
    """The ``adapter`` parameter every model kind takes: the LoRA adapter its calls use."""
    adapter = params.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise BadRequest(f"adapter={adapter!r}: expected an adapter's name")
    return adapter
