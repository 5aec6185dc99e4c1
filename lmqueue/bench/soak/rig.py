"""What the soak runs on: Redis, tenants, two hf workers, a scheduler and client processes.

* the queue Redis with AOF (``appendfsync everysec``, as ``ops/redis/queue.conf``) and an ACL
  file, so a restart keeps streams, registry and tenants' users; a separate cache Redis
  (``volatile-ttl`` as ``ops/redis/cache.conf``, bounded), where workers write results and
  claim-checks point;
  on ``--cluster``, the queue is a 3-master Redis Cluster (a replica each) instead, and the
  scheduler's control plane a single instance beside it;
* three tenants made as ``lmq tenant add`` makes them (ACL users): ``alice`` and ``bob`` run
  SMC programs in client processes of their own (`client`; bob's on two LoRA adapters),
  ``carol`` runs experiments through the arq scheduler;
* two hf workers (as the ``lmq-worker`` user) on a tiny random Llama with SmolLM2's
  vocabulary, the first started with two random LoRA adapters (the second loads them from
  the registry, as any worker of the model does).

Everything lives in one work directory: the model, adapters, journals and logs.
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from lmqueue.devstack import (
    CACHE_POLICY,
    ChildProcess,
    LocalCluster,
    LocalRedis,
    SchedulerProcess,
    WorkerProcess,
    wait_live,
)
from lmqueue.shared.connections import sync_redis
from lmqueue.shared.settings import mask_secrets
from lmqueue.shared.tenants import WORKER_USER, TenantConfig
from lmqueue.tenant_admin import TenantAdmin, user_url

__all__ = ["Rig", "RigConfig", "ClientProcess"]

ADAPTERS = ("ft1", "ft2")
#: tenant -> the adapters its client process cycles through ("" is the base model)
PROGRAM_TENANTS = {"alice": ("",), "bob": ADAPTERS}
EXPERIMENT_TENANT = "carol"
#: every child's environment on top of this one's: a crash in native code (a signal) still
#: leaves the Python stacks in the child's log, for `Rig.exited`
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
#: the client processes' environment
CLIENT_ENV = {**CHILD_ENV, "LMQ_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class RigConfig:
    """The soak's sizes and settings."""

    work: Path
    cluster: bool = False
    claim_idle_ms: int = 5000
    cache_maxmemory: str = "256mb"
    particles: int = 8
    steps: int = 12
    timeout_s: float = 60.0
    #: finished experiments expire after this (the scheduler's keep_finished_s): shorter than
    #: the warm-up, so their keys reach their steady level before the series are judged
    keep_finished_s: float = 60.0


class ClientProcess(ChildProcess):
    """One tenant's `client` process; restartable (its journal is appended to).

    `stop` (SIGTERM) lets the running program finish, then the process exits; `kill` is a
    crash of the program's host.
    """

    def __init__(self, name: str, args: list[str], journal: Path, log: Path) -> None:
        argv = [sys.executable, "-m", "lmqueue.bench.soak.client", *args, "--journal", str(journal)]
        super().__init__(name, argv, log, env=CLIENT_ENV, stop_grace_s=60.0)
        self.journal = journal


class Rig:
    """Starts and stops everything, and offers the handles the faults need."""

    def __init__(self, config: RigConfig) -> None:
        self.config = config
        self.work = config.work
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model = str(self.work / "model")
        self.adapter_dirs: dict[str, str] = {}
        self.queue: LocalRedis | None = None
        self.cluster: LocalCluster | None = None
        self.control: LocalRedis | None = None
        self.cache = LocalRedis(maxmemory=config.cache_maxmemory, policy=CACHE_POLICY)
        self.urls: dict[str, str] = {}
        self.workers: list[WorkerProcess] = []
        self.clients: list[ClientProcess] = []
        self.scheduler: SchedulerProcess | None = None

    @property
    def admin_url(self) -> str:
        """The operator's URL of the queue (any node of a cluster)."""
        return self.cluster.url if self.cluster is not None else self.queue_server.url

    @property
    def queue_server(self) -> LocalRedis:
        """The single queue instance (not on a cluster)."""
        assert self.queue is not None, "the queue is a cluster"
        return self.queue

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> Rig:
        """Model and adapters, Redis, tenants, workers (waited for), scheduler, clients."""
        self._make_models()
        self.cache.start()
        if self.config.cluster:
            self.cluster = LocalCluster(acl_files=True).start()
            self.control = LocalRedis().start()
        else:
            acl = self.work / "users.acl"
            acl.write_text("user default on nopass ~* &* +@all\n")
            self.queue = LocalRedis(args=[
                "--appendonly", "yes", "--appendfsync", "everysec", "--aclfile", str(acl),
            ]).start()  # fmt: skip
        self._make_tenants()
        self._start_workers()
        self.wait_live(self.workers)
        self._start_scheduler()
        for tenant in PROGRAM_TENANTS:
            self.clients.append(self._client(tenant, len(self.clients) + 1).start())
        return self

    def _make_models(self) -> None:
        from ..lib.adapter_models import make_random_adapter
        from .tiny_model import make_tiny_model

        if not (self.work / "model" / "config.json").exists():
            make_tiny_model(self.work / "model")
        for seed, name in enumerate(ADAPTERS, start=1):
            path = self.work / "adapters" / name
            if not (path / "adapter_config.json").exists():
                make_random_adapter(self.model, path, seed, rank=4)
            self.adapter_dirs[name] = str(path)

    def _make_tenants(self) -> None:
        admin = sync_redis(self.admin_url)
        cache_admin = redis.Redis.from_url(self.cache.url)
        tenants = TenantAdmin(admin, self.admin_url, caches=[(cache_admin, self.cache.url)])
        try:
            for name in (*PROGRAM_TENANTS, EXPERIMENT_TENANT):
                self.urls[name] = tenants.add(TenantConfig(name))
            password = secrets.token_urlsafe(18)
            self.urls[WORKER_USER] = tenants.worker_user(password=password)
            self.urls["worker-cache"] = user_url(self.cache.url, WORKER_USER, password)
        finally:
            admin.close()
            cache_admin.close()

    def _start_workers(self) -> None:
        env = {
            "LMQ_CLAIM_IDLE_MS": str(self.config.claim_idle_ms), "LMQ_HEARTBEAT_S": "1",
            **CHILD_ENV, "LMQ_LOG_LEVEL": "INFO",
        }  # fmt: skip
        adapters = [
            a for name, path in self.adapter_dirs.items() for a in ("--adapter", f"{name}={path}")
        ]
        for i in range(2):
            extra = ["--cache-url", self.urls["worker-cache"], *(adapters if i == 0 else [])]
            worker = WorkerProcess(
                self.model, "hf", self.urls[WORKER_USER], f"soak-w{i}", env=env,
                log_dir=self.logs, extra_args=extra,
            )  # fmt: skip
            self.workers.append(worker.start())

    def _start_scheduler(self) -> None:
        settings: dict[str, Any] = {
            "tenant_urls": {EXPERIMENT_TENANT: self.urls[EXPERIMENT_TENANT]}, "lease_s": 10.0,
            "keep_finished_s": self.config.keep_finished_s,
        }  # fmt: skip
        if self.control is not None:
            settings["control_url"] = self.control.url
        config = self.work / "scheduler.json"
        config.write_text(json.dumps(settings))
        self.scheduler = SchedulerProcess(
            self.admin_url, "soak-scheduler", config, self.logs, env=CHILD_ENV
        ).start()

    def _client(self, tenant: str, variant: int) -> ClientProcess:
        args = ["--url", self.urls[tenant], "--model", self.model, "--variant", str(variant),
                "--particles", str(self.config.particles), "--steps", str(self.config.steps),
                "--timeout-s", str(self.config.timeout_s)]  # fmt: skip
        adapters = [a for a in PROGRAM_TENANTS[tenant] if a]
        if adapters:
            args += ["--adapters", ",".join(adapters)]
        journal = self.work / f"journal-{tenant}.jsonl"
        return ClientProcess(tenant, args, journal, self.logs / f"client-{tenant}.log")

    def wait_live(self, workers: list[WorkerProcess], timeout_s: float = 180) -> float:
        """Block until each of `workers` has beaten its heartbeat since now; the seconds taken."""
        return wait_live(self.admin_url, self.model, workers, timeout_s)

    # -- processes the monitor measures ---------------------------------------------------------
    def pids(self) -> dict[str, int]:
        """Role -> pid of every process now running (restarted ones under their role)."""
        out = {w.name: w.pid for w in self.workers if w.alive}
        out.update({f"client-{c.name}": c.pid for c in self.clients if c.process})
        if self.scheduler is not None and self.scheduler.alive:  # (a dead one: `exited`)
            out["scheduler"] = self.scheduler.pid
        for role, server in (("redis-queue", self.queue), ("redis-cache", self.cache)):
            if server is not None and server.process is not None:
                out[role] = server.process.pid
        for node in self.cluster.nodes if self.cluster is not None else []:
            if node.process is not None and node.alive:
                out[f"redis-{node.port}"] = node.process.pid
        return out

    def exited(self, tail_lines: int = 40) -> dict[str, dict[str, Any]]:
        """The scheduler and workers that ended on their own (none should, faults included:
        a killed worker is started again at once): name -> exit code and its log's last lines.
        Checked before `stop_clients`'s end, so a failed soak says who died, and why."""
        out: dict[str, dict[str, Any]] = {}
        for child in [*self.workers, *([self.scheduler] if self.scheduler else [])]:
            if child.process is not None and not child.alive:
                tail = [mask_secrets(line) for line in child.log().splitlines()[-tail_lines:]]
                out[child.name] = {"exit_code": child.process.returncode, "log_tail": tail}
        return out

    # -- stop ------------------------------------------------------------------------------------
    def stop_clients(self) -> None:
        """Let every client finish its running program and exit."""
        for client in self.clients:
            client.stop()

    def close(self) -> None:
        """Stop everything that runs; the work directory stays (journals, logs)."""
        for client in self.clients:
            client.kill()
        if self.scheduler is not None:
            self.scheduler.stop()
        for worker in self.workers:
            worker.stop(timeout_s=20)
        for server in (self.queue, self.control, self.cache):
            if server is not None:
                server.close()
        if self.cluster is not None:
            self.cluster.close()
