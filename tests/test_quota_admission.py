"""Quotas are enforced atomically by the admission script, run as the tenant's own ACL user."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from lmqueue.producer.admission import Admission
from lmqueue.producer.inflight import InflightTable
from lmqueue.producer.submitter import Submitter
from lmqueue.shared.errors import Busy, QuotaExceeded, Unavailable, from_wire, to_wire
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request
from lmqueue.tenant_admin import TenantAdmin

MODEL = "mock"
KEYS = KeySpace(tenant="alice")


@pytest.fixture
def admin(redis_url: str) -> Iterator[TenantAdmin]:
    client = redis.Redis.from_url(redis_url)
    client.sadd(KEYS.models(), MODEL)
    yield TenantAdmin(client, redis_url)
    client.execute_command("ACL", "DELUSER", "alice")
    client.close()


async def _as_tenant(admin: TenantAdmin, **limits: float) -> aioredis.Redis:
    url = admin.add(TenantConfig("alice", **limits))  # type: ignore[arg-type]
    return aioredis.Redis.from_url(url)


def _admission(client: aioredis.Redis, max_backlog: int = 0) -> Admission:
    return Admission(client, KEYS.requests(MODEL), max_backlog, KEYS.quota(MODEL), KEYS.rate(MODEL))


async def test_in_flight_quota_admits_what_fits_and_names_the_quota(admin: TenantAdmin) -> None:
    client = await _as_tenant(admin, max_inflight=5)
    admission = _admission(client)
    assert await admission.enqueue([b"a", b"b", b"c"]) == 3
    with pytest.raises(QuotaExceeded) as refused:
        await admission.enqueue([b"d", b"e", b"f", b"g"])
    assert refused.value.data["quota"] == "max_inflight"
    assert refused.value.data["limit"] == 5
    assert refused.value.data["admitted"] == 2
    assert isinstance(refused.value, Busy)
    entries = [fields[b"m"] for _, fields in admin.redis.xrange(KEYS.requests(MODEL))]
    assert entries == [b"a", b"b", b"c", b"d", b"e"]  # nothing accepted earlier was dropped
    await client.aclose()


async def test_in_flight_frees_up_as_workers_delete_answered_entries(
    admin: TenantAdmin,
) -> None:
    client = await _as_tenant(admin, max_inflight=2)
    admission = _admission(client)
    await admission.enqueue([b"a", b"b"])
    with pytest.raises(QuotaExceeded):
        await admission.enqueue([b"c"])
    first = admin.redis.xrange(KEYS.requests(MODEL), count=1)[0][0]
    admin.redis.xdel(KEYS.requests(MODEL), first)  # what a worker does after answering
    assert await admission.enqueue([b"c"]) == 2
    await client.aclose()


async def test_token_rate_quota_refuses_past_the_bucket_and_refills(admin: TenantAdmin) -> None:
    client = await _as_tenant(admin, max_tokens_per_s=100)
    admission = _admission(client)
    with pytest.raises(QuotaExceeded) as refused:
        await admission.enqueue([b"a", b"b", b"c"], tokens=[40, 40, 40])
    data = refused.value.data
    assert (data["quota"], data["admitted"], data["limit"]) == ("max_tokens_per_s", 2, 100)
    assert 0.15 <= data["retry_after_s"] <= 0.21  # 20 tokens left, 40 needed, 100 per s
    await asyncio.sleep(data["retry_after_s"] + 0.02)
    assert await admission.enqueue([b"c"], tokens=[40]) == 3
    await client.aclose()


async def test_a_request_larger_than_the_rate_runs_once_the_bucket_is_full(
    admin: TenantAdmin,
) -> None:
    """A prompt longer than one second's tokens is admitted alone, then the debt is paid."""
    client = await _as_tenant(admin, max_tokens_per_s=100)
    admission = _admission(client)
    assert await admission.enqueue([b"big"], tokens=[250]) == 1
    with pytest.raises(QuotaExceeded) as refused:
        await admission.enqueue([b"small"], tokens=[1])
    assert refused.value.data["retry_after_s"] >= 1.4  # 150 tokens of debt at 100 per s
    await client.aclose()


async def test_backlog_bound_still_refuses_the_whole_batch(admin: TenantAdmin) -> None:
    client = await _as_tenant(admin, max_inflight=100)
    admission = _admission(client, max_backlog=3)
    await admission.enqueue([b"a", b"b"])
    with pytest.raises(Busy) as refused:
        await admission.enqueue([b"c", b"d"])
    assert not isinstance(refused.value, QuotaExceeded)
    assert admin.redis.xlen(KEYS.requests(MODEL)) == 2
    await client.aclose()


async def test_without_the_script_loaded_a_tenant_gets_unavailable_not_an_eval(
    admin: TenantAdmin,
) -> None:
    client = await _as_tenant(admin, max_inflight=5)
    admin.redis.script_flush()
    with pytest.raises(Unavailable, match="admission script is not loaded"):
        await _admission(client).enqueue([b"a"])
    assert admin.redis.xlen(KEYS.requests(MODEL)) == 0
    await client.aclose()


async def test_a_user_allowed_to_eval_loads_the_script_itself(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.script_flush()
    assert await Admission(client, KEYS.requests(MODEL), 0).enqueue([b"a"]) == 1
    assert await Admission(client, KEYS.requests(MODEL), 0).enqueue([b"b"]) == 2
    await client.aclose()


async def test_the_submitter_fails_only_the_refused_requests(admin: TenantAdmin) -> None:
    client = await _as_tenant(admin, max_inflight=2)
    inflight = InflightTable("c1")
    submitter = Submitter(inflight, None, _admission(client))
    pendings = []
    for i in range(3):
        request = Request(inflight.next_request_id(), "c1", bytes([i, 0, 0, 0]))
        pendings.append(inflight.add(request, PromptKey.of_request(request), i, 10.0))
    waiters = [inflight.wait(p) for p in pendings]
    await submitter._send(pendings)
    assert submitter.sent == 2
    assert not waiters[0].done() and not waiters[1].done()
    with pytest.raises(QuotaExceeded, match="max_inflight"):
        await waiters[2]
    inflight.fail_all(Busy, "test over")
    await asyncio.gather(*waiters, return_exceptions=True)
    await client.aclose()


def test_quota_exceeded_travels_the_wire_as_itself() -> None:
    error = from_wire(to_wire(QuotaExceeded("over", quota="max_inflight", limit=5.0)))
    assert isinstance(error, QuotaExceeded)
    assert error.data == {"quota": "max_inflight", "limit": 5.0}
