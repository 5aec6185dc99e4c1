"""Anticipation: a busy worker holds its next batch a moment for a returning tenant's calls.

A closed-loop tenant's next calls come a few milliseconds after its replies; picked before
they came, the next batch would leave them for the forward after it (two forwards' wait).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from test_late_binding import MODEL, RecordingLM, _xadd

from lmqueue.producer import QueueLM
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.anticipation import COOL_OFF_BATCHES, ReturningTenants
from workers_in_threads import ThreadedWorker


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_is_awaited_until_its_replies_then_until_its_calls_are_back() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.010, clock)
    backlog = {"light": 0}
    returning.sent("light", 4, cost=64.0)
    assert returning.waiting(backlog.get) == (True, None)  # replies not written yet
    assert returning.credit("light") == 64.0
    clock.now = 1.0
    returning.replied("light")
    clock.now = 1.004
    hold, wait_s = returning.waiting(backlog.get)
    assert hold and wait_s == pytest.approx(0.006)
    backlog["light"] = 3
    assert returning.waiting(backlog.get)[0]  # three of its four: still held
    backlog["light"] = 4
    assert returning.waiting(backlog.get) == (False, 0.0)  # all back: pick now
    assert returning.credit("light") == 0.0  # no longer awaited: no credit


def test_the_wait_ends_after_wait_s_and_a_tenant_missing_twice_cools_off() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.010, clock)
    backlog = {"gone": 0}
    for _ in range(2):
        returning.sent("gone", 2, cost=32.0)
        returning.replied("gone")
        clock.now += 0.011
        assert returning.waiting(backlog.get) == (False, 0.0)  # waited long enough
    for _ in range(COOL_OFF_BATCHES):  # not awaited for its next batches ...
        returning.sent("gone", 2, cost=32.0)
        assert returning.waiting(backlog.get) == (False, 0.0)
    returning.sent("gone", 2, cost=32.0)  # ... then tried again
    assert returning.waiting(backlog.get) == (True, None)


def test_a_tenant_with_a_backlog_or_a_zero_wait_is_never_awaited() -> None:
    returning = ReturningTenants(0.010, _Clock())
    returning.sent("flood", 16, cost=256.0)
    assert returning.waiting({"flood": 40}.get) == (False, 0.0)
    off = ReturningTenants(0.0, _Clock())
    off.sent("light", 4, cost=64.0)
    assert off.waiting({"light": 0}.get) == (False, 0.0)


def test_tenants_whose_replies_will_not_come_are_forgotten() -> None:
    returning = ReturningTenants(0.010, _Clock())
    returning.sent("a", 1, cost=16.0)
    returning.sent("b", 1, cost=16.0)
    returning.replied("b")
    returning.forget_unreplied()
    hold, wait_s = returning.waiting({"a": 0, "b": 0}.__getitem__)
    assert hold and wait_s == pytest.approx(0.010)  # only b, replied, is still awaited


@pytest.fixture
def tenant_urls(redis_url: str) -> Iterator[tuple[TenantAdmin, dict[str, str]]]:
    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    urls = {name: tenant_admin.add(TenantConfig(name)) for name in ("flood", "light")}
    yield tenant_admin, urls
    users = [u.decode() for u in admin.execute_command("ACL", "USERS")]
    admin.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    admin.close()


@pytest.mark.parametrize(("anticipate_ms", "gap"), [(0, 2), (150, 1)])
async def test_a_closed_loop_under_a_flood_runs_each_step_in_the_next_forward(
    redis_url: str,
    tenant_urls: tuple[TenantAdmin, dict[str, str]],
    smol_tokenizer: Any,
    anticipate_ms: int,
    gap: int,
) -> None:
    """Without anticipation each step of the light tenant's loop waits for the forward picked
    while its last step's replies were on their way (gap 2); with it, it joins that one."""
    admin, urls = tenant_urls
    backend = RecordingLM(smol_tokenizer)
    worker = ThreadedWorker(backend, admin.worker_user(), anticipate_ms=anticipate_ms).start()
    settings = ClientSettings(
        redis=RedisSettings(url=urls["light"]), use_shared_cache=False, local_cache_size=0
    )
    try:
        deadline = time.monotonic() + 20
        _xadd(redis_url, "flood", [[3, 3]])  # one forward first: the worker measures it
        while not backend.forward_of and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        _xadd(redis_url, "flood", [[1, n] for n in range(12 * 32)])  # 12 full forwards
        lm = await QueueLM.connect(MODEL, settings=settings)
        steps = [[[2, step, i] for i in range(4)] for step in range(4)]
        try:
            for prompts in steps:  # a closed loop: each step sent when the last is answered
                await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        finally:
            await lm.close()
    finally:
        worker.stop()
    forwards = [{backend.forward_of[tuple(p)] for p in prompts} for prompts in steps]
    assert all(len(f) == 1 for f in forwards)  # each step's calls in one forward
    firsts = [min(f) for f in forwards]
    assert [b - a for a, b in zip(firsts, firsts[1:], strict=False)] == [gap] * 3
    assert max(backend.batch_sizes[1:-1]) == 32  # the flood still filled the batches
