"""`SchedulerSettings`: what one ``lmq scheduler`` process needs, from flags and a JSON file.

The configuration file (``--config FILE.json``) holds what does not fit on a command line::

    {
      "tenant_urls": {"alice": "redis://alice:secret@redis:6379/0"},
      "kinds": {"sweep": "mylab.experiments:sweep"},
      "max_running_per_tenant": 2,
      "cron": [{"name": "nightly-score", "tenant": "alice", "kind": "score",
                "model": "smollm2-135m", "params": {"rows": []}, "hour": 3, "minute": 0}]
    }

`tenant_urls` names the tenants this scheduler serves and the identity their experiments use
to call the model (their own ACL user, so their quotas and fair share apply); the `default`
tenant is always served, with the scheduler's own URL.

Two Redis roles: `redis_url` is the data plane, where tenants' experiment keys (inbox, index,
record, results) live beside their request streams, a single instance or a Redis Cluster;
`control_url` is the control plane, a single instance holding arq's keys (``arq:*``) and the
scheduler's own (``<prefix>:_sched:*``). arq has no cluster client and its keys span slots, so
a cluster data plane needs a control URL; on a single instance it defaults to the data URL.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lmqueue.shared.errors import InvalidName, SettingsError
from lmqueue.shared.keys import KeySpace, validate_name
from lmqueue.shared.settings import DEFAULT_REDIS_URL

__all__ = ["SchedulerSettings", "CronEntry"]

_CRON_FIELDS = ("month", "day", "weekday", "hour", "minute", "second")


@dataclass(frozen=True)
class CronEntry:
    """A recurring experiment: submitted for `tenant` at the times arq's `cron` matches."""

    name: str
    kind: str
    tenant: str = "default"
    model: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    #: arq cron fields (month, day, weekday, hour, minute, second): an int or a list of ints.
    schedule: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CronEntry:
        """Parse one entry of the configuration's ``cron`` list."""
        try:
            schedule = {k: raw[k] for k in _CRON_FIELDS if k in raw}
            others = {k: v for k, v in raw.items() if k not in _CRON_FIELDS}
            entry = cls(schedule=schedule, **others)
            validate_name("cron entry", entry.name)
        except (TypeError, InvalidName) as exc:
            raise SettingsError(f"cron entry {dict(raw)!r}: {exc}") from None
        return entry


@dataclass(frozen=True)
class SchedulerSettings:
    """Everything a scheduler process needs."""

    redis_url: str = DEFAULT_REDIS_URL
    #: the single instance for arq's and the scheduler's own keys (None: `redis_url`, which
    #: must then be a single instance; see `scheduler.planes`)
    control_url: str | None = None
    prefix: str = "lmq"
    #: tenant -> the Redis URL (that tenant's ACL user) its experiments call the model with.
    tenant_urls: dict[str, str] = field(default_factory=dict)
    #: custom kinds: name -> "module:function" of an async ``(ctx, lm, params) -> rows``.
    kinds: dict[str, str] = field(default_factory=dict)
    cron: tuple[CronEntry, ...] = ()
    #: experiments one process runs at once (arq's max_jobs)
    max_jobs: int = 4
    #: experiments of one tenant running at once over all processes; the rest wait queued
    max_running_per_tenant: int = 2
    #: a dead process's experiments are retried this long after its last renewal
    lease_s: float = 15.0
    #: starts of one experiment before it is marked failed (a clean SIGTERM hand-over: none)
    max_attempts: int = 3
    #: the longest an experiment may run
    job_timeout_s: int = 7 * 24 * 3600
    #: a finished experiment's record and results are kept this long, then expire (0: kept
    #: forever, and the queue Redis grows with every experiment)
    keep_finished_s: float = 30 * 24 * 3600
    poll_delay_s: float = 0.5
    #: how often an experiment waiting for its tenant's limit asks again
    limit_retry_s: float = 1.0
    #: how long `QueueLM.connect` waits for the experiment's model
    connect_timeout_s: float = 60.0
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        for tenant in self.tenant_urls:
            try:
                KeySpace(self.prefix, tenant)
            except InvalidName as exc:
                raise SettingsError(f"tenant_urls: {exc.message}") from None
        for name in ("max_jobs", "max_running_per_tenant", "lease_s", "max_attempts"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name}={getattr(self, name)!r}: must be > 0")
        if self.keep_finished_s < 0:
            raise SettingsError(f"keep_finished_s={self.keep_finished_s!r}: must be >= 0")
        for name, spec in self.kinds.items():
            if ":" not in spec:
                raise SettingsError(f"kinds.{name}={spec!r}: expected 'module:function'")

    @property
    def tenants(self) -> tuple[str, ...]:
        """The tenants served: ``default`` and those with a URL."""
        return ("default", *(t for t in self.tenant_urls if t != "default"))

    def url_of(self, tenant: str) -> str:
        """The Redis URL experiments of `tenant` call the model with."""
        return self.tenant_urls.get(tenant, self.redis_url)

    def keyspace(self, tenant: str = "default") -> KeySpace:
        """The key layout of `tenant`."""
        return KeySpace(self.prefix, tenant)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> SchedulerSettings:
        """Settings from the JSON file at `path` (if any), `overrides` (not None) on top."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                values = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise SettingsError(f"--config {path}: {exc}") from None
            if not isinstance(values, dict):
                raise SettingsError(f"--config {path}: expected a JSON object")
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise SettingsError(f"unknown scheduler settings: {', '.join(sorted(unknown))}")
        entries = values.get("cron", ())
        values["cron"] = tuple(
            e if isinstance(e, CronEntry) else CronEntry.from_json(e) for e in entries
        )
        try:
            return cls(**values)
        except TypeError as exc:
            raise SettingsError(f"scheduler settings: {exc}") from None
