"""A worker killed mid-batch with two tenants' requests in it: every request of both is answered.

Workers run as the `lmq-worker` ACL user and serve both tenants' streams; each tenant's client
connects with nothing but its URL.
"""

from __future__ import annotations

import asyncio
import signal

import redis

from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin

from .harness import MODEL, Load, assert_clean, connect, make_prompts, probe, until
from .test_worker_faults import FAST_RECLAIM

TENANTS = ("alice", "bob")


async def test_a_worker_killed_mid_batch_with_two_tenants_leaves_no_request_unanswered(
    fault_redis, workers, reference, record
):
    admin = redis.Redis.from_url(fault_redis.url)
    tenant_admin = TenantAdmin(admin, fault_redis.url)
    urls = {name: tenant_admin.add(TenantConfig(name)) for name in TENANTS}
    worker_url = tenant_admin.worker_user()
    admin.close()
    victim, _ = workers.spawn(worker_url, 2, backend_opts={"batch_delay_s": 0.1}, env=FAST_RECLAIM)
    async with (
        connect(urls["alice"]) as alice,
        connect(urls["bob"]) as bob,
        probe(fault_redis.url) as redis_probe,
    ):
        loads = [Load(alice, make_prompts(300, seed=11)), Load(bob, make_prompts(300, seed=12))]
        running = [
            asyncio.create_task(load.run(f"kill -9 mid-batch, tenant {name}"))
            for load, name in zip(loads, TENANTS, strict=True)
        ]
        held = await until(lambda: _holding_both(redis_probe, victim.name), every_s=0.005)
        victim.signal(signal.SIGKILL)
        pairs = zip(loads, running, strict=True)
        results = [load.check(await task, reference) for load, task in pairs]
        left = await until(lambda: _all_settled(redis_probe), timeout_s=30, every_s=0.1)
    for figures in results:
        figures.extra.update(killed_holding=held)
        record(figures)
        assert_clean(figures)
    assert all(held.values()) and left == {"queued": 0, "pending": 0, "dead_letters": 0}


async def _holding_both(redis_probe, consumer: str) -> dict[str, int] | None:
    """What `consumer` holds unacknowledged of each tenant, once it holds entries of both."""
    held = {}
    for name in TENANTS:
        try:
            summary = await redis_probe.xpending(
                KeySpace(tenant=name).requests(MODEL), WORKER_GROUP
            )
        except redis.ResponseError:
            return None
        rows = {_text(row["name"]): int(row["pending"]) for row in summary.get("consumers") or []}
        held[name] = rows.get(consumer, 0)
    return held if all(held.values()) else None


async def _all_settled(redis_probe) -> dict[str, int] | None:
    left = {"queued": 0, "pending": 0, "dead_letters": 0}
    for name in TENANTS:
        keys = KeySpace(tenant=name)
        left["queued"] += int(await redis_probe.xlen(keys.requests(MODEL)))
        summary = await redis_probe.xpending(keys.requests(MODEL), WORKER_GROUP)
        left["pending"] += int(summary["pending"])
        left["dead_letters"] += int(await redis_probe.xlen(keys.dead_letters(MODEL)))
    return left if not left["queued"] and not left["pending"] else None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
