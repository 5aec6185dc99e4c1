"""A tenant removed while a worker runs: what the worker read is answered, the rest waits.

`lmq tenant remove` deletes the tenant's record; within a refresh the worker stops reading its
stream, still answers the entries it had read, and leaves unread ones in the stream, which a
worker answers once the tenant is added again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from lmqueue.shared.keys import KeySpace
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request, encode_request
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.upkeep import TENANT_REFRESH_S
from workers_in_threads import ThreadedWorker

MODEL = "mock"
FORWARD_S = 1.0


@pytest.fixture
def admin(redis_url: str) -> Iterator[Any]:
    client = redis.Redis.from_url(redis_url)
    yield client
    users = [u.decode() for u in client.execute_command("ACL", "USERS")]
    client.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    client.close()


def _xadd(admin: Any, tenant: str, first: int, count: int) -> None:
    with admin.pipeline(transaction=False) as pipe:
        for n in range(first, first + count):
            request = Request(f"{tenant}:{n}", "raw", np.asarray([5, n], "<i4").tobytes())
            pipe.xadd(KeySpace(tenant=tenant).requests(MODEL), encode_request(request))
        pipe.execute()


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_removed_tenants_read_entries_are_answered_and_unread_ones_wait(
    redis_url: str, admin: Any, smol_tokenizer: Any
) -> None:
    tenants = TenantAdmin(admin, redis_url)
    for name in ("gone", "stays"):
        tenants.add(TenantConfig(name))
    backend = MockAsyncLM(smol_tokenizer, batch_delay_s=FORWARD_S)
    served = ThreadedWorker(backend, tenants.worker_user()).start()
    stream = KeySpace(tenant="gone").requests(MODEL)
    replies = {name: KeySpace(tenant=name).replies("raw") for name in ("gone", "stays")}
    try:
        _xadd(admin, "gone", 0, 3)
        await _until(lambda: admin.xpending(stream, "workers")["pending"] == 3, 10)
        tenants.remove("gone")  # while its 3 entries are in the forward
        worker = served.worker
        assert worker is not None
        await _until(lambda: "gone" not in {lane.tenant for lane in worker.lanes}, 10)
        await asyncio.sleep(1.0)  # a blocking read issued before may still take an entry
        _xadd(admin, "gone", 3, 5)
        _xadd(admin, "stays", 0, 4)
        await _until(lambda: admin.xlen(replies["stays"]) == 4, 10)
        await asyncio.sleep(TENANT_REFRESH_S)  # another refresh and more reads: no change
        assert admin.xlen(replies["gone"]) == 3
        assert admin.xlen(stream) == 5
        assert admin.xpending(stream, "workers")["pending"] == 0
        tenants.add(TenantConfig("gone"))
        await _until(lambda: admin.xlen(replies["gone"]) == 8, 10)
    finally:
        served.stop()
