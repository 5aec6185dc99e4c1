"""Private adapters' records: only their tenant, the workers and the operator can read them.

A real redis-server with the ACL users `lmq tenant` makes; each party reads with its own
credentials, so what a tenant is shown is what Redis lets it read. The records are moved
between public and private while readers read, with no moment at which a reader misses one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError
from test_adapters import _retry_unknown, fake_adapter

from lmqueue.devstack import LocalCluster
from lmqueue.producer import QueueLM
from lmqueue.shared.adapter_views import MOVE_LUA
from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, adapter_revision
from lmqueue.shared.connections import connect_async_redis, sync_redis
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.tenants import WORKER_USER, TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

MODEL = "mock"
KEYS = KeySpace()
PUBLIC = AdapterRecord("pub", "/models/shared/pub", "0123456789abcdef")
ACME = AdapterRecord("acme-merger", "/models/acme/merger", "aaaaaaaaaaaaaaaa", "acme")
GLOBEX = AdapterRecord("globex-tune", "/models/globex/tune", "bbbbbbbbbbbbbbbb", "globex")


@dataclass
class Parties:
    """Async clients of the operator, two tenants and the workers' user, and their URLs."""

    admin: Any
    acme: Any
    globex: Any
    worker: Any
    urls: dict[str, str]

    def registry(self, party: str, tenant: str = "default") -> AdapterRegistry:
        return AdapterRegistry(getattr(self, party), KEYS.for_tenant(tenant), MODEL)


def _make_users(admin_url: str) -> tuple[TenantAdmin, dict[str, str]]:
    tenant_admin = TenantAdmin(sync_redis(admin_url), admin_url)
    urls = {
        "acme": tenant_admin.add(TenantConfig("acme")),
        "globex": tenant_admin.add(TenantConfig("globex")),
        "worker": tenant_admin.worker_user(),
    }
    return tenant_admin, urls


def _drop_users(tenant_admin: TenantAdmin) -> None:
    tenant_admin.remove("acme")
    tenant_admin.remove("globex")
    client = tenant_admin.redis
    routing = {"target_nodes": client.ALL_NODES} if hasattr(client, "ALL_NODES") else {}
    client.execute_command("ACL", "DELUSER", WORKER_USER, **routing)
    client.close()


@pytest.fixture
async def parties(redis_url: str) -> AsyncIterator[Parties]:
    tenant_admin, urls = _make_users(redis_url)
    clients = {name: aioredis.Redis.from_url(url) for name, url in urls.items()}
    admin = aioredis.Redis.from_url(redis_url)
    yield Parties(admin, clients["acme"], clients["globex"], clients["worker"], urls)
    for client in (admin, *clients.values()):
        await client.aclose()
    _drop_users(tenant_admin)


async def _publish_three(registry: AdapterRegistry) -> None:
    for record in (PUBLIC, ACME, GLOBEX):
        await registry.add(record)


async def test_each_tenant_reads_the_public_records_and_its_own_private_ones_only(
    parties: Parties,
) -> None:
    await _publish_three(parties.registry("admin"))
    assert await parties.registry("acme", "acme").records() == {"pub": PUBLIC, ACME.name: ACME}
    assert await parties.registry("globex", "globex").records() == {
        "pub": PUBLIC, GLOBEX.name: GLOBEX,
    }  # fmt: skip
    everything = {"pub": PUBLIC, ACME.name: ACME, GLOBEX.name: GLOBEX}
    assert await parties.registry("worker").all_records() == everything
    assert await parties.registry("admin").all_records() == everything
    for key in (KEYS.model_adapters(MODEL), KEYS.for_tenant("globex").private_adapters(MODEL)):
        with pytest.raises(NoPermissionError):  # Redis itself refuses acme the records
            await parties.acme.hgetall(key)
    with pytest.raises(NoPermissionError):  # naming globex as her tenant does not help
        await parties.registry("acme", "globex").records()


async def test_a_record_is_in_the_full_hash_and_in_exactly_one_view_after_every_change(
    parties: Parties,
) -> None:
    registry = parties.registry("admin")
    views = {
        None: KEYS.public_adapters(MODEL),
        "acme": KEYS.for_tenant("acme").private_adapters(MODEL),
        "globex": KEYS.for_tenant("globex").private_adapters(MODEL),
    }

    async def listed_in() -> list[str | None]:
        return [owner for owner, key in views.items() if await parties.admin.hexists(key, "x")]

    for owner in (None, "acme", "globex", None, "acme"):
        await registry.add(AdapterRecord("x", "/p", "r1", owner))
        assert (await registry.all_records())["x"].tenant == owner
        assert await listed_in() == [owner]
    assert await registry.remove("x") is True
    assert await registry.remove("x") is False
    assert await listed_in() == [] and "x" not in await registry.all_records()


async def test_a_move_does_nothing_when_another_writer_came_between(parties: Parties) -> None:
    """The script checks the record its caller read: a stale caller changes nothing (and
    `AdapterRegistry` reads again and retries)."""
    await parties.registry("admin").add(ACME)
    move = parties.admin.register_script(MOVE_LUA)
    full, public = KEYS.model_adapters(MODEL), KEYS.public_adapters(MODEL)
    own = KEYS.for_tenant("acme").private_adapters(MODEL)
    stale = AdapterRecord(ACME.name, ACME.path, "0" * 16, "acme").to_bytes()
    moved = await move(keys=[full, own, public], args=[ACME.name, stale, PUBLIC.to_bytes()])
    assert moved == 0
    assert await parties.admin.hget(full, ACME.name) == ACME.to_bytes()
    assert await parties.admin.hget(own, ACME.name) == ACME.to_bytes()
    assert not await parties.admin.exists(public)


class _Stepped:
    """A real client whose pipelines send one command at a time and run `between` before
    the command numbered `gap`: another writer's change lands between two reads, which a
    pipeline sent at once (Redis runs a client's buffered commands back to back) cannot
    show reliably."""

    def __init__(self, client: Any, gap: int, between: Callable[[], Awaitable[None]]) -> None:
        self.client, self.gap, self.between = client, gap, between
        self.keys: list[str] = []

    def register_script(self, script: str) -> Any:
        return self.client.register_script(script)

    def pipeline(self, transaction: bool = True) -> _Stepped:
        assert not transaction  # a tenant may not MULTI: the reads must not need it
        return self

    async def __aenter__(self) -> _Stepped:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    def hgetall(self, key: str) -> None:
        self.keys.append(key)

    async def execute(self) -> list[Any]:
        results = []
        for n, key in enumerate(self.keys):
            if n == self.gap:
                await self.between()
            results.append(await self.client.hgetall(key))
        return results


@pytest.mark.parametrize("gap", [0, 1, 2])
@pytest.mark.parametrize(
    ("before", "after"), [(None, "acme"), ("acme", None)], ids=["to-private", "to-public"]
)
async def test_a_tenant_never_misses_an_adapter_made_public_or_private_while_it_reads(
    parties: Parties, gap: int, before: str | None, after: str | None
) -> None:
    admin = parties.registry("admin")
    await admin.add(AdapterRecord("flip", "/p", "r1", before))

    async def move() -> None:
        await admin.add(AdapterRecord("flip", "/p", "r1", after))

    stepped = _Stepped(parties.acme, gap, move)
    records = await AdapterRegistry(stepped, KEYS.for_tenant("acme"), MODEL).records()
    assert len(stepped.keys) == 3  # the move came between two of its reads
    assert "flip" in records
    assert (await parties.registry("admin").all_records())["flip"].tenant == after


async def test_views_are_rebuilt_from_records_written_before_they_existed(
    parties: Parties,
) -> None:
    """What a version with one hash left (or an operator wrote by hand): the full hash alone,
    and a stale public view. A worker rebuilds the views (it does at start)."""
    full = KEYS.model_adapters(MODEL)
    for record in (PUBLIC, ACME, GLOBEX):
        await parties.admin.hset(full, record.name, record.to_bytes())
    await parties.admin.hset(full, "broken", b"\xc1 not msgpack")
    await parties.admin.hset(KEYS.public_adapters(MODEL), GLOBEX.name, GLOBEX.to_bytes())
    assert await parties.registry("acme", "acme").records() == {GLOBEX.name: GLOBEX}  # stale

    await parties.registry("worker").rebuild_views()
    assert await parties.registry("acme", "acme").records() == {"pub": PUBLIC, ACME.name: ACME}
    assert await parties.registry("globex", "globex").records() == {
        "pub": PUBLIC, GLOBEX.name: GLOBEX,
    }  # fmt: skip
    assert await parties.admin.hkeys(KEYS.public_adapters(MODEL)) == [b"pub"]


def test_lmq_adapter_list_shows_a_tenant_its_own_and_the_public_adapters_and_the_operator_all(
    parties: Parties, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmqueue.cli import main

    asyncio.run(_publish_as_operator(redis_url))

    def listed(url: str) -> str:
        assert main(["adapter", "--redis-url", url, "list", MODEL]) == 0
        return capsys.readouterr().out

    operator = listed(redis_url)
    acme = listed(parties.urls["acme"])
    assert all(r.path in operator for r in (PUBLIC, ACME, GLOBEX))
    assert f"{ACME.name}\tacme\t{ACME.revision}\t{ACME.path}" in acme and PUBLIC.path in acme
    assert "globex" not in acme
    assert "acme" not in listed(parties.urls["globex"])
    assert main(["adapter", "--redis-url", parties.urls["acme"], "remove", MODEL, "pub"]) == 2
    assert "pub" in listed(redis_url)  # refused by Redis: nothing removed


async def _publish_as_operator(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        await _publish_three(AdapterRegistry(client, KEYS, MODEL))
    finally:
        await client.aclose()


async def test_lmq_tenant_reapply_takes_every_record_away_from_users_of_an_earlier_version(
    parties: Parties, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Users made by an earlier version keep their rules (which let every tenant read every
    adapter record) until `lmq tenant reapply` gives them this version's; passwords stay."""
    from lmqueue.cli import main

    await _publish_three(parties.registry("admin"))
    earlier = ("ACL", "SETUSER", "acme", f"(+hgetall %R~{KEYS.model_adapters('*')})")
    await parties.admin.execute_command(*earlier)
    assert GLOBEX.name.encode() in await parties.acme.hgetall(KEYS.model_adapters(MODEL))

    assert await asyncio.to_thread(main, ["tenant", "reapply", "--redis-url", redis_url]) == 0
    assert "acme, globex, lmq-worker" in capsys.readouterr().out
    with pytest.raises(NoPermissionError):
        await parties.acme.hgetall(KEYS.model_adapters(MODEL))
    again = {name: aioredis.Redis.from_url(parties.urls[name]) for name in ("acme", "worker")}
    try:  # the same URLs (passwords) still log in, with what they need
        acme = AdapterRegistry(again["acme"], KEYS.for_tenant("acme"), MODEL)
        assert set(await acme.records()) == {"pub", ACME.name}
        assert len(await AdapterRegistry(again["worker"], KEYS, MODEL).all_records()) == 3
    finally:
        for client in again.values():
            await client.aclose()


# -- workers -----------------------------------------------------------------------------------
class _CountingMock(MockAsyncLM):
    """The mock backend, counting adapter loads and unloads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[str] = []
        self.unloads: list[str] = []

    async def load_adapter(self, name: str, path: str) -> None:
        self.loads.append(name)
        await super().load_adapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        self.unloads.append(name)
        await super().unload_adapter(name)


@pytest.fixture
def fleet(parties: Parties, smol_tokenizer: Any) -> Iterator[tuple[ThreadedWorker, _CountingMock]]:
    backend = _CountingMock(smol_tokenizer)
    worker = ThreadedWorker(backend, parties.urls["worker"]).start()
    yield worker, backend
    worker.stop()


async def test_a_worker_serves_an_adapter_throughout_while_it_is_made_private_and_public(
    parties: Parties, fleet: tuple[ThreadedWorker, _CountingMock], tmp_path: Any
) -> None:
    """acme calls without pause while the operator makes the adapter private to acme and
    public again: every call is answered (the name never goes missing on the worker), the
    weights are never unloaded, and loaded again in place once it stops being private (which
    forgets what was computed for acme)."""
    worker, backend = fleet
    path = fake_adapter(tmp_path / "flip", b"flip weights")
    admin = parties.registry("admin")
    await admin.add(AdapterRecord("flip", str(path), adapter_revision(path)))
    settings = ClientSettings(timeout_s=20)
    url = parties.urls["acme"]
    async with await QueueLM.connect(MODEL, redis_url=url, settings=settings) as lm:
        await _retry_unknown(lambda: lm.next_token_logprobs([1, 2], lora_name="flip"))
        stop = asyncio.Event()
        answered = 0

        async def call_on() -> None:
            nonlocal answered
            while not stop.is_set():  # new prompts: every call goes to the worker
                await lm.next_token_logprobs([3, answered % 40_000 + 1], lora_name="flip")
                answered += 1

        calls = asyncio.create_task(call_on())
        for owner in ("acme", None):
            await admin.add(AdapterRecord("flip", str(path), adapter_revision(path), owner))
            await _until(lambda o=owner: _served_owner(worker, "flip") == (o,), calls)
        stop.set()
        await calls  # raises if any call failed
    assert answered >= 4
    assert backend.unloads == [] and backend.loads == ["flip", "flip"]


def _served_owner(worker: ThreadedWorker, name: str) -> tuple[str | None, ...]:
    assert worker.worker is not None
    record = worker.worker.adapters.served.get(name)
    return () if record is None else (record.tenant,)


async def _until(check: Callable[[], bool], calls: asyncio.Task[None]) -> None:
    deadline = time.monotonic() + 15
    while not check():
        assert not calls.done() or calls.result() is None, "the calls stopped"
        assert time.monotonic() < deadline, "the worker did not take the change"
        await asyncio.sleep(0.05)


# -- Redis Cluster -----------------------------------------------------------------------------
@pytest.mark.cluster
async def test_records_views_and_refusals_work_on_a_cluster(
    redis_cluster: LocalCluster, cluster_url: str
) -> None:
    """The three hashes of a model share its slot: moves and rebuilds are one script there
    too, each party's cluster client reads what its user may, and Redis refuses the rest."""
    tenant_admin, urls = _make_users(cluster_url)
    clients = {name: await connect_async_redis(url) for name, url in urls.items()}
    admin = await connect_async_redis(cluster_url)
    try:
        operator = AdapterRegistry(admin, KEYS, MODEL)
        await _publish_three(operator)
        await operator.add(AdapterRecord("pub", PUBLIC.path, PUBLIC.revision, "acme"))
        acme = AdapterRegistry(clients["acme"], KEYS.for_tenant("acme"), MODEL)
        assert set(await acme.records()) == {"pub", ACME.name}
        globex = AdapterRegistry(clients["globex"], KEYS.for_tenant("globex"), MODEL)
        assert set(await globex.records()) == {GLOBEX.name}
        worker = AdapterRegistry(clients["worker"], KEYS, MODEL)
        await worker.add(PUBLIC)  # a worker publishes its own adapters: one script, one slot
        await worker.rebuild_views()
        assert set(await globex.records()) == {"pub", GLOBEX.name}
        assert set(await worker.all_records()) == {"pub", ACME.name, GLOBEX.name}
        for key in (KEYS.model_adapters(MODEL), KEYS.for_tenant("acme").private_adapters(MODEL)):
            with pytest.raises(NoPermissionError):
                await clients["globex"].hgetall(key)
        assert LocalCluster.slot_of(KEYS.model_adapters(MODEL)) == LocalCluster.slot_of(
            KEYS.for_tenant("acme").private_adapters(MODEL)
        )
    finally:
        for client in (admin, *clients.values()):
            await client.aclose()
        _drop_users(tenant_admin)


def test_the_adapter_hashes_of_a_model_share_its_hash_slot() -> None:
    keys = [
        KEYS.model_adapters("m"), KEYS.public_adapters("m"),
        KEYS.for_tenant("acme").private_adapters("m"), KEYS.model_info("m"),
    ]  # fmt: skip
    assert {LocalCluster.slot_of(key) for key in keys} == {LocalCluster.slot_of("{m}")}
