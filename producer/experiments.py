"""`Experiments`: submit, watch, cancel and collect a tenant's experiments (the scheduler's API).

An experiment is a named run of a *kind* (``score``, ``sample``, ``smc`` or a custom
``module:function`` the scheduler registers) on a model with JSON parameters. This client only
ever touches its own tenant's keys (see `shared.keys`): it writes the experiment's record (a
hash), indexes it, and posts a submission order on the tenant's inbox stream; a scheduler
process (``lmq scheduler``) reads the inbox, enqueues an arq job and writes status, progress
and result rows back into the tenant's keys. arq's own keys are never touched by a tenant.

The tenant is the user name of the Redis URL (``redis://alice:pw@host/0``), else the settings'
tenant (``default``). Redis ACLs then confine each tenant to its own keys (`scheduler.acl`).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit

from lmqueue.shared.adapters import validate_adapter_name
from lmqueue.shared.connections import async_redis, connect_async_redis
from lmqueue.shared.errors import BadRequest, InvalidName, UnknownExperiment
from lmqueue.shared.experiment_kinds import BUILTIN_KIND_SPECS, check_params, decode_catalog
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.redis_errors import redis_boundary
from lmqueue.shared.registry import ModelRegistry
from lmqueue.shared.settings import RedisSettings

__all__ = [
    "Experiments",
    "ExperimentStatus",
    "TERMINAL",
    "tenant_of_url",
    "validate_experiment_id",
    "new_experiment_id",
]

#: Statuses an experiment never leaves.
TERMINAL = frozenset({"complete", "failed", "cancelled"})
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_KIND = re.compile(r"^[A-Za-z0-9_.:]{1,200}$")
#: The record's fields that claim an id for one submission (a digest of what it asks) and
#: say that the submission was posted whole (see `Experiments.submit`).
_ORDER, _POSTED = "order", "posted"
_INT_FIELDS = ("done", "total", "attempts", "submitted_ms", "started_ms", "finished_ms")


def _order_digest(kind: str, model: str, params: str, start_after_ms: int) -> str:
    """What a submission asks for, in 16 hex digits: a retry of it has the same."""
    text = json.dumps([kind, model, params, start_after_ms], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def validate_experiment_id(experiment_id: str) -> str:
    """Return `experiment_id` if it may name an experiment's keys, else raise `InvalidName`."""
    if not isinstance(experiment_id, str) or not _ID.match(experiment_id):
        raise InvalidName(
            f"invalid experiment id {experiment_id!r}: use 1-100 of A-Z a-z 0-9 _ . - "
            "(starting with a letter or digit)"
        )
    return experiment_id


def new_experiment_id(kind: str) -> str:
    """A fresh id: the kind's last name, the UTC time and 6 random hex digits."""
    name = re.sub(r"[^A-Za-z0-9]", "-", kind.rsplit(":", 1)[-1])[:40] or "exp"
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def tenant_of_url(url: str, default: str = "default") -> str:
    """The tenant a Redis URL acts for: its user name, else `default`."""
    user = urlsplit(url).username
    return unquote(user) if user else default


@dataclass(frozen=True)
class ExperimentStatus:
    """One experiment as its record says now."""

    id: str
    tenant: str
    kind: str
    model: str
    status: str
    done: int = 0
    total: int = 0
    #: Units of progress per second over the current run.
    rate: float = 0.0
    error: str = ""
    attempts: int = 0
    submitted_ms: int = 0
    started_ms: int = 0
    finished_ms: int = 0
    #: Deferred start (epoch ms), 0 for "as soon as possible".
    start_after_ms: int = 0
    cancel_requested: bool = False
    #: Why a queued experiment waits (e.g. the tenant's running limit).
    waiting: str = ""

    @property
    def finished(self) -> bool:
        """Whether the experiment reached a final status."""
        return self.status in TERMINAL

    @classmethod
    def from_record(cls, tenant: str, experiment_id: str, raw: Mapping[bytes, bytes]) -> Any:
        """Parse a record hash as read from Redis."""
        fields = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        values: dict[str, Any] = {
            "id": experiment_id,
            "tenant": tenant,
            "kind": fields.get("kind", ""),
            "model": fields.get("model", ""),
            "status": fields.get("status", "queued"),
            "error": fields.get("error", ""),
            "waiting": fields.get("waiting", ""),
            "cancel_requested": fields.get("cancel_requested") == "1",
            "rate": _number(fields.get("rate"), float),
            "start_after_ms": _number(fields.get("start_after_ms"), int),
        }
        values.update({name: _number(fields.get(name), int) for name in _INT_FIELDS})
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able map of every field."""
        return dict(self.__dict__)

    def line(self) -> str:
        """One human line: id, status, progress, rate, error."""
        text = f"{self.id}  {self.kind}  {self.status}"
        if self.total:
            text += f"  {self.done}/{self.total}"
        if self.status == "running" and self.rate:
            text += f"  {self.rate:.3g}/s"
        if self.status == "queued" and self.start_after_ms > time.time() * 1000:
            start = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.start_after_ms / 1000))
            text += f"  (starts {start} UTC)"
        elif self.waiting and self.status == "queued":
            text += f"  (waiting: {self.waiting})"
        if self.error:
            text += f"  error: {self.error}"
        return text


def _number(raw: str | None, kind: type) -> Any:
    try:
        return kind(raw) if raw else kind(0)
    except ValueError:
        return kind(0)


class Experiments:
    """A tenant's experiments: ``submit``, ``status``, ``list``, ``cancel``, ``results``.

    Create with ``Experiments.connect(redis_url)``; close with ``await close()`` (or use
    ``async with``). Every method raises `Forbidden` when Redis refuses this user the keys
    (another tenant's experiment), `Unavailable` when Redis cannot be reached.
    """

    def __init__(
        self,
        redis: Any,
        keyspace: KeySpace,
        *,
        url: str | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.redis = redis
        self.keys = keyspace
        self.tenant = keyspace.tenant
        #: Set by `connect`: on first use, ask the server whether it is a cluster node.
        self._url = url
        #: Named (password masked) in errors.
        self.url = url
        self._connect_timeout_s = connect_timeout_s
        self._connecting = asyncio.Lock()

    @classmethod
    def connect(
        cls,
        redis_url: str | None = None,
        *,
        tenant: str | None = None,
        settings: RedisSettings | None = None,
    ) -> Experiments:
        """A client of the Redis at `redis_url` acting for `tenant` (default: the URL's user).

        A Redis Cluster node's URL works too: the first command asks the node (`_connected`).
        """
        settings = settings or RedisSettings.from_env()
        if redis_url is not None:
            settings = replace(settings, url=redis_url)
        tenant = tenant or tenant_of_url(settings.url, settings.tenant)
        keyspace = KeySpace(settings.prefix, tenant)
        client = async_redis(settings.url, settings.connect_timeout_s)
        return cls(client, keyspace, url=settings.url, connect_timeout_s=settings.connect_timeout_s)

    async def _connected(self) -> None:
        """Once, before the first command: the cluster client instead if the URL names a
        Redis Cluster node (`connect` stays synchronous, so the question is asked here)."""
        if self._url is None:
            return
        async with self._connecting:
            if self._url is None:
                return
            client = await connect_async_redis(self._url, self._connect_timeout_s)
            plain, self.redis, self._url = self.redis, client, None
            await plain.aclose()

    def _boundary(self, what: str) -> Any:
        """`redis_boundary` naming this client's URL."""
        return redis_boundary(what, self.url)

    async def close(self) -> None:
        """Close the connection pool."""
        await self.redis.aclose()

    async def __aenter__(self) -> Experiments:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- verbs -------------------------------------------------------------------------------------
    async def submit(
        self,
        kind: str,
        params: Mapping[str, Any] | None = None,
        *,
        model: str = "",
        experiment_id: str | None = None,
        start_after_s: float | None = None,
        adapter: str | None = None,
    ) -> str:
        """Submit an experiment; return its id. An id submitted before is not submitted again.

        Args:
            kind: ``score``, ``sample``, ``smc`` or a custom kind the scheduler registers.
            params: the kind's JSON parameters.
            model: the model the experiment calls ("" for kinds that need none).
            start_after_s: an epoch time (seconds) before which it does not start.
            adapter: the LoRA adapter of `model` every call uses (the ``adapter`` parameter,
                which every model kind takes; None: the base model).
        """
        if adapter is not None:
            params = {**(params or {}), "adapter": validate_adapter_name(adapter)}
        if not _KIND.match(kind):
            raise BadRequest(f"invalid kind {kind!r}")
        experiment_id = validate_experiment_id(experiment_id or new_experiment_id(kind))
        record = self.keys.experiment_record(experiment_id)
        now_ms = int(time.time() * 1000)
        encoded = json.dumps(dict(params or {}), separators=(",", ":"))
        with self._boundary(f"submitting experiment {experiment_id!r}"):
            await self._connected()
            await self.check(kind, params or {}, model)
            start_after_ms = int((start_after_s or 0) * 1000)
            order = _order_digest(kind, model, encoded, start_after_ms)
            if not await self.redis.hsetnx(record, _ORDER, order):
                existing = await self.redis.hgetall(record)
                if _POSTED.encode() in existing or existing.get(_ORDER.encode()) != order.encode():
                    return experiment_id  # the same id runs once, as first submitted
            # A first try, or the same submission again after an outage cut it short (the
            # record claimed, not posted): what is missing is written. In this order every
            # prefix that lands is safe: the order is posted only once the record says what to
            # run, the status is set only if no run has set it yet, and the marker last (a
            # second order of one id enqueues no second job: `scheduler.dispatcher`).
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(
                    record,
                    mapping={
                        "kind": kind,
                        "model": model,
                        "params": encoded,
                        "start_after_ms": start_after_ms,
                    },
                )
                pipe.hsetnx(record, "submitted_ms", now_ms)
                pipe.hsetnx(record, "status", "queued")
                pipe.zadd(self.keys.experiment_index(), {experiment_id: now_ms}, nx=True)
                pipe.xadd(self.keys.experiment_inbox(), {"id": experiment_id})
                pipe.hset(record, _POSTED, 1)
                await pipe.execute()
        return experiment_id

    async def check(self, kind: str, params: Mapping[str, Any], model: str = "") -> None:
        """Refuse what cannot run: a kind no scheduler runs, parameters it does not take (by
        name and type), a model no worker publishes.

        Raises:
            BadRequest: naming the kind or parameter.
            UnknownModel: naming the models served.
        """
        raw = await self.redis.get(self.keys.experiment_kinds())
        catalog = decode_catalog(raw) if raw else BUILTIN_KIND_SPECS
        spec = catalog.get(kind)
        if spec is None:
            known = ", ".join(sorted(catalog))
            where = "the schedulers run" if raw else "known before any scheduler started"
            raise BadRequest(
                f"unknown experiment kind {kind!r}; kinds {where}: {known}",
                remedy="pick one of those, or ask the operator to register it (lmq scheduler "
                "--kind NAME=module:function)",
            )
        check_params(kind, spec, params)
        if spec.needs_model and not model:
            raise BadRequest(f"kind {kind!r} calls a model: give one (--model NAME)")
        if model:
            await ModelRegistry(self.redis, self.keys).info(model)  # UnknownModel

    async def status(self, experiment_id: str) -> ExperimentStatus:
        """The experiment's status, progress, rate and error.

        Raises:
            UnknownExperiment: if this tenant has no experiment of that id.
        """
        validate_experiment_id(experiment_id)
        with self._boundary(f"reading experiment {experiment_id!r}"):
            await self._connected()
            raw = await self.redis.hgetall(self.keys.experiment_record(experiment_id))
        if not raw:
            raise UnknownExperiment(
                f"tenant {self.tenant!r} has no experiment {experiment_id!r}", id=experiment_id
            )
        return ExperimentStatus.from_record(self.tenant, experiment_id, raw)

    async def list(self) -> builtins.list[ExperimentStatus]:
        """Every experiment of this tenant, oldest first."""
        with self._boundary("listing experiments"):
            await self._connected()
            ids = await self.redis.zrange(self.keys.experiment_index(), 0, -1)
        statuses = []
        for raw_id in ids:
            try:
                statuses.append(await self.status(raw_id.decode()))
            except UnknownExperiment:
                continue  # indexed, record deleted since
        return statuses

    async def cancel(self, experiment_id: str) -> ExperimentStatus:
        """Ask the scheduler to stop the experiment (a queued one never starts); its status.

        A running experiment stops within about a second of the scheduler seeing the request.
        """
        record = self.keys.experiment_record(experiment_id)
        status = await self.status(experiment_id)  # UnknownExperiment, Forbidden
        if status.finished:
            return status
        with self._boundary(f"cancelling experiment {experiment_id!r}"):
            await self.redis.hset(record, "cancel_requested", "1")
            if status.status == "queued":
                # not started (or deferred): it never will (the scheduler checks the request
                # before starting and while running), so it reads cancelled at once
                now_ms = int(time.time() * 1000)
                await self.redis.hset(
                    record, mapping={"status": "cancelled", "finished_ms": now_ms, "waiting": ""}
                )
        return await self.status(experiment_id)

    async def results(self, experiment_id: str, start: int = 0) -> builtins.list[dict[str, Any]]:
        """The result rows written so far, from row `start` on."""
        await self.status(experiment_id)
        with self._boundary(f"reading results of {experiment_id!r}"):
            rows = await self.redis.lrange(self.keys.experiment_results(experiment_id), start, -1)
        return [json.loads(row) for row in rows]

    async def follow(
        self, experiment_id: str, interval_s: float = 0.5
    ) -> AsyncIterator[ExperimentStatus]:
        """Yield the status every `interval_s` until the experiment finishes (the last one too)."""
        while True:
            status = await self.status(experiment_id)
            yield status
            if status.finished:
                return
            await asyncio.sleep(interval_s)

    async def wait(self, experiment_id: str, timeout_s: float = 600.0) -> ExperimentStatus:
        """Wait until the experiment finishes; its final status.

        Raises:
            TimeoutError: if it is not finished after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s  # not asyncio.timeout: see shared.connections
        while True:
            status = await self.status(experiment_id)
            if status.finished:
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"experiment {experiment_id!r} is still {status.status}")
            await asyncio.sleep(0.2)
