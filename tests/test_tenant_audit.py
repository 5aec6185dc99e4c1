"""What one tenant's credentials reach of another tenant's data: nothing (docs/SECURITY.md).

Two tenants, acme and globex, each with a private LoRA adapter, calls of each answered by a
worker (cache rows, reply streams, quota mirrors) and an experiment each. Then, with one
tenant's credentials only:

- every command its ACL rules grant (read from what `tenant_acl_rules` generates, so this
  test follows the rules as they change), on every key holding the other tenant's data, is
  refused by Redis itself (NOPERM);
- every key in Redis, read with every read command it is granted, and every keyless
  command it is granted, answers nothing of the other tenant (its name, its adapter's name,
  directory or revision, its experiment);
- ``lmq adapter list``, ``lmq status`` and a worker's ``/metrics`` show nothing of the other
  tenant's private adapter.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError
from test_adapters import _retry_unknown, fake_adapter

from lmqueue.devstack import LocalRedis
from lmqueue.producer import Experiments, QueueLM
from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, adapter_revision
from lmqueue.shared.admission_script import ADMISSION_SHA
from lmqueue.shared.experiment_kinds import KindSpec, encode_catalog
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.tenants import WORKER_USER, TenantConfig, tenant_acl_rules
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.health import HealthServer, HealthState
from workers_in_threads import ThreadedWorker

MODEL = "mock"
KEYS = KeySpace()
TENANTS = ("acme", "globex")
#: Each tenant's private adapter: its name says what the tenant works on.
SECRET = {"acme": "acme-merger-q7", "globex": "globex-takeover-q7"}
PROMPTS = {"acme": [11, 12, 13], "globex": [21, 22, 23]}
EXPERIMENT = "exp-audit"
#: A client of each tenant whose reply stream holds a reply not read yet (clients delete
#: their streams when they close).
HELD = "held"


@dataclass
class Fleet:
    """The operator's URL and connection, each party's URL, the worker, what each tenant
    owns that no other may see (markers), and what its private adapter is (markers too)."""

    admin_url: str
    admin: Any
    urls: dict[str, str]
    worker: ThreadedWorker
    markers: dict[str, list[bytes]]
    adapter_markers: dict[str, list[bytes]]


@pytest.fixture(scope="module")
def fleet(
    redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any
) -> Iterator[Fleet]:
    """Set up once for the module: every test here only reads."""
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()
    tenant_admin = TenantAdmin(admin, redis_server.url)
    admin.sadd(KEYS.models(), MODEL)  # quotas are mirrored for a model already listed
    urls = {tenant: tenant_admin.add(TenantConfig(tenant)) for tenant in TENANTS}
    urls["worker"] = tenant_admin.worker_user()
    admin.set(KEYS.experiment_kinds(), encode_catalog({"noop": KindSpec(None, needs_model=False)}))
    tmp = tmp_path_factory.mktemp("audit")
    records = [_record(tmp, "pub", None)] + [_record(tmp, SECRET[t], t) for t in TENANTS]
    asyncio.run(_publish(redis_server.url, records))
    worker = ThreadedWorker(MockAsyncLM(smol_tokenizer), urls["worker"]).start()
    try:
        asyncio.run(_traffic(urls))
        markers = {r.tenant: [r.tenant.encode(), r.name.encode(), r.revision.encode()]
                   for r in records if r.tenant}  # fmt: skip
        adapter_markers = {r.tenant: [r.name.encode(), r.revision.encode(), r.path.encode()]
                           for r in records if r.tenant}  # fmt: skip
        yield Fleet(redis_server.url, admin, urls, worker, markers, adapter_markers)
    finally:
        worker.stop()
        admin.execute_command("ACL", "DELUSER", *TENANTS, WORKER_USER)
        admin.close()


def _record(tmp: Path, name: str, tenant: str | None) -> AdapterRecord:
    path = fake_adapter(tmp / name, name.encode() * 4)
    return AdapterRecord(name, str(path), adapter_revision(path), tenant)


async def _publish(admin_url: str, records: list[AdapterRecord]) -> None:
    admin = aioredis.Redis.from_url(admin_url)
    try:
        for record in records:
            await AdapterRegistry(admin, KEYS, MODEL).add(record)
    finally:
        await admin.aclose()


async def _traffic(urls: dict[str, str]) -> None:
    """Each tenant: calls under its private adapter, the public one and the base model (cache
    rows, replies), and an experiment naming its adapter."""
    for tenant in TENANTS:
        settings = ClientSettings(timeout_s=20)
        async with await QueueLM.connect(MODEL, redis_url=urls[tenant], settings=settings) as lm:
            for adapter in (SECRET[tenant], "pub", None):
                await _retry_unknown(
                    lambda lm=lm, t=tenant, a=adapter: lm.next_token_logprobs(
                        PROMPTS[t], lora_name=a
                    )
                )
        worker = aioredis.Redis.from_url(urls["worker"])
        try:
            await worker.xadd(KEYS.for_tenant(tenant).replies(HELD), {"r": b"unread reply"})
        finally:
            await worker.aclose()
        async with Experiments.connect(urls[tenant]) as experiments:
            await experiments.submit(
                "noop", {"rows": []}, experiment_id=EXPERIMENT, adapter=SECRET[tenant]
            )


# -- what the rules grant --------------------------------------------------------------------------
def _granted(tenant: str) -> set[str]:
    """Every command name (``info|server`` for a subcommand) the tenant's rules grant."""
    names = set()
    for rule in tenant_acl_rules(TenantConfig(tenant)):
        names.update(token[1:].lower() for token in rule.strip("()").split() if token[0] == "+")
    return names


def _command_info(admin: Any, name: str) -> dict[str, Any]:
    base = name.partition("|")[0]
    return admin.execute_command("COMMAND", "INFO", base)[base]


def _keyed(admin: Any, names: set[str]) -> set[str]:
    """The commands among `names` that take keys (the others cannot touch any data)."""
    return {name for name in names if _command_info(admin, name)["key_specifications"]}


#: One invocation of each key-taking command a tenant may be granted, on key `k`.
TEMPLATES = {
    "get": lambda k: ("GET", k),
    "mget": lambda k: ("MGET", k),
    "exists": lambda k: ("EXISTS", k),
    "smembers": lambda k: ("SMEMBERS", k),
    "hgetall": lambda k: ("HGETALL", k),
    "hmget": lambda k: ("HMGET", k, "max_inflight"),
    "hset": lambda k: ("HSET", k, "f", "v"),
    "hsetnx": lambda k: ("HSETNX", k, "f", "v"),
    "pexpire": lambda k: ("PEXPIRE", k, 60_000),
    "del": lambda k: ("DEL", k),
    "xadd": lambda k: ("XADD", k, "*", "m", "x"),
    "xlen": lambda k: ("XLEN", k),
    "xread": lambda k: ("XREAD", "STREAMS", k, "0"),
    "xtrim": lambda k: ("XTRIM", k, "MAXLEN", "0"),
    "zadd": lambda k: ("ZADD", k, 1, "m"),
    "zrange": lambda k: ("ZRANGE", k, 0, -1),
    "lrange": lambda k: ("LRANGE", k, 0, -1),
    "evalsha": lambda k: ("EVALSHA", ADMISSION_SHA, 1, k),
}


def test_every_key_taking_command_a_tenant_is_granted_has_an_invocation_here(
    fleet: Fleet,
) -> None:
    """If the rules grant a new command, the refusal matrix below must try it too."""
    for tenant in TENANTS:
        assert _keyed(fleet.admin, _granted(tenant)) == set(TEMPLATES)


def _victim_keys(fleet: Fleet, victim: str) -> dict[str, str]:
    """Every key pattern of the victim's data, and every key in Redis that names it."""
    own = KEYS.for_tenant(victim)
    admin = fleet.admin
    keys = {
        "its private adapters' records": own.private_adapters(MODEL),
        "every adapter's records, its private one among them": own.model_adapters(MODEL),
        "its request stream": own.requests(MODEL),
        "its request stream of a partition": own.requests(MODEL, 0),
        "its quota": own.quota(MODEL),
        "its rate bucket": own.rate(MODEL),
        "its dead letters": own.dead_letters(MODEL),
        "its experiment inbox": own.experiment_inbox(),
        "its experiment index": own.experiment_index(),
        "its experiment's record": own.experiment_record(EXPERIMENT),
        "its experiment's results": own.experiment_results(EXPERIMENT),
        "its running experiments": own.experiments_running(),
        "its reply stream": own.replies(HELD),
        "worker stats (they name every tenant served)": own.worker_stats(MODEL, "t-worker"),
        "the tenants hash": own.tenants(),
    }
    named = [k.decode() for k in admin.keys(f"*{victim}*")]
    rows = [k for k in named if f"~{SECRET[victim]}@" in k]  # its private adapter's rows
    assert rows and all(k.startswith(f"lmq:{victim}:cache:") for k in rows)
    assert len([k for k in named if ":cache:" in k]) >= 3  # and the public one's, the base's
    keys.update({f"key {k}": k for k in named})
    return keys


@pytest.mark.parametrize(("tenant", "victim"), [TENANTS, TENANTS[::-1]])
def test_every_granted_command_on_every_key_of_another_tenant_is_refused_by_redis(
    fleet: Fleet, tenant: str, victim: str
) -> None:
    client = redis.Redis.from_url(fleet.urls[tenant])
    keys = _victim_keys(fleet, victim)
    allowed = []
    try:
        for command in sorted(_keyed(fleet.admin, _granted(tenant))):
            for what, key in keys.items():
                try:
                    client.execute_command(*TEMPLATES[command](key))
                except NoPermissionError as refused:
                    assert str(refused).startswith("this user has no permissions"), refused
                    continue
                allowed.append(f"{command} on {what}")
    finally:
        client.close()
    assert allowed == []
    assert len(keys) >= 18


# -- what a tenant can read at all -----------------------------------------------------------------
def _invoke(name: str) -> tuple[str, ...]:
    """A keyless command by its ACL name (``info|server`` -> INFO server)."""
    return tuple(part.upper() if n == 0 else part for n, part in enumerate(name.split("|")))


def _readable(fleet: Fleet, client: Any, tenant: str) -> dict[str, Any]:
    """What `client` reads: every key in Redis with every read command it is granted, and
    every keyless command it is granted; refused ones are left out."""
    granted = _granted(tenant)
    keyed = _keyed(fleet.admin, granted)
    reads = sorted(c for c in keyed if "readonly" in _command_info(fleet.admin, c)["flags"])
    assert set(reads) <= set(TEMPLATES) and "hgetall" in reads and "get" in reads
    answers: dict[str, Any] = {}
    for key in sorted(k.decode() for k in fleet.admin.keys("*")):
        for command in reads:
            try:
                answers[f"{command} {key}"] = client.execute_command(*TEMPLATES[command](key))
            except ResponseError:  # NOPERM, or a command of another type than the key's
                continue
    for command in sorted(granted - keyed):
        try:
            answers[command] = client.execute_command(*_invoke(command))
        except ResponseError:  # e.g. CLUSTER SLOTS on a single instance
            continue
    return answers


def _mentions(answers: dict[str, Any], markers: list[bytes]) -> list[str]:
    """The answers (key and command, or the reply) that contain a marker."""
    return [what for what, reply in answers.items()
            if any(m in f"{what} {reply!r}".encode() for m in markers)]  # fmt: skip


@pytest.mark.parametrize(("tenant", "victim"), [TENANTS, TENANTS[::-1]])
def test_nothing_a_tenant_can_read_names_another_tenant_or_its_adapter(
    fleet: Fleet, tenant: str, victim: str
) -> None:
    client = redis.Redis.from_url(fleet.urls[tenant])
    try:
        answers = _readable(fleet, client, tenant)
    finally:
        client.close()
    assert _mentions(answers, fleet.markers[victim]) == []
    # what it reads is real: its own private adapter, replies, quota, experiment, registry
    own = KEYS.for_tenant(tenant)
    assert f"hgetall {own.private_adapters(MODEL)}" in _mentions(answers, [SECRET[tenant].encode()])
    for key in (own.private_adapters(MODEL), KEYS.public_adapters(MODEL), own.quota(MODEL),
                own.experiment_record(EXPERIMENT), KEYS.model_info(MODEL)):  # fmt: skip
        assert [what for what in answers if what.endswith(f" {key}")], key
    assert [what for what in answers if what.startswith(f"xread lmq:{tenant}:client:")]
    # and the markers do find the victim where the operator looks
    operator = redis.Redis.from_url(fleet.admin_url)
    try:
        everything = _readable(fleet, operator, tenant)
    finally:
        operator.close()
    found = _mentions(everything, fleet.markers[victim])
    assert f"hgetall {KEYS.model_adapters(MODEL)}" in found
    assert f"hgetall {KEYS.for_tenant(victim).private_adapters(MODEL)}" in found


# -- commands --------------------------------------------------------------------------------------
def test_lmq_adapter_list_as_a_tenant_shows_nothing_of_another_tenants_private_adapter(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.cli import main

    for tenant, victim in (TENANTS, TENANTS[::-1]):
        assert main(["adapter", "--redis-url", fleet.urls[tenant], "list", MODEL]) == 0
        listed = capsys.readouterr().out
        assert SECRET[tenant] in listed and "pub\tpublic" in listed
        assert not [m for m in fleet.markers[victim] if m.decode() in listed]
    assert main(["adapter", "--redis-url", fleet.admin_url, "list", MODEL]) == 0
    listed = capsys.readouterr().out
    assert all(SECRET[t] in listed for t in TENANTS)  # the operator sees them all


def test_lmq_status_as_a_tenant_is_refused_and_shows_nothing_of_another_tenant(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmq status` reads the tenants hash, the live workers and their stats: operator's
    keys, which Redis refuses a tenant, even with --tenant naming only itself."""
    from lmqueue.cli import main

    for tenant, victim in (TENANTS, TENANTS[::-1]):
        for extra in ([], ["--tenant", tenant]):
            assert main(["status", "--redis-url", fleet.urls[tenant], *extra]) == 2
            shown = capsys.readouterr()
            assert "Forbidden" in shown.err
            assert not [m for m in fleet.markers[victim] if m.decode() in shown.out + shown.err]


def test_a_workers_metrics_name_no_adapter(fleet: Fleet) -> None:
    """/metrics is the operator's (labels: model, tenant, outcome, ...): it counts each
    tenant's requests, and names no adapter, private or public."""
    assert fleet.worker.worker is not None
    registry = fleet.worker.worker.metrics.registry

    async def scrape() -> str:
        async with HealthServer(HealthState(), registry, port=0) as server:
            url = f"http://127.0.0.1:{server.port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())

    text = asyncio.run(scrape())
    for tenant in TENANTS:
        assert f'tenant="{tenant}"' in text  # its requests were counted
        assert not [m for m in fleet.adapter_markers[tenant] if m.decode() in text]
