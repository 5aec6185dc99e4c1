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
from lmqueue.workers.anticipation import (
    COOL_OFF_BATCHES,
    MAX_COOL_OFF_BATCHES,
    AwaitedFirst,
    ReturningTenants,
)
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


def test_the_backend_idles_for_a_returning_tenant_at_most_a_share_of_a_forward() -> None:
    clock = _Clock()
    returning = ReturningTenants(1.0, clock, idle_share=0.1)  # anticipate_ms far longer
    returning.sent("light", 4, cost=64.0)
    clock.now = 10.0
    hold, wait_s = returning.waiting({"light": 0}.get, idle_since=10.0, forward_s=0.1)
    assert hold and wait_s == pytest.approx(0.01)  # replies not written: the share bounds it
    returning.replied("light")
    clock.now = 10.006
    hold, wait_s = returning.waiting({"light": 0}.get, idle_since=10.0, forward_s=0.1)
    assert hold and wait_s == pytest.approx(0.004)
    clock.now = 10.0101
    assert returning.waiting({"light": 0}.get, idle_since=10.0, forward_s=0.1) == (False, 0.0)
    assert returning.credit("light") == 0.0


def test_while_the_backend_is_busy_only_anticipate_ms_bounds_a_wait() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.020, clock, idle_share=0.1)
    returning.sent("light", 4, cost=64.0)
    returning.replied("light")
    clock.now = 0.015  # past a share of the forward, but the backend is busy meanwhile
    hold, wait_s = returning.waiting({"light": 0}.get, idle_since=None, forward_s=0.1)
    assert hold and wait_s == pytest.approx(0.005)


@pytest.mark.parametrize(("forward_s", "caught"), [(0.100, True), (0.003, False)])
def test_one_setting_waits_out_a_round_trip_of_a_long_forward_not_of_a_short_one(
    forward_s: float, caught: bool
) -> None:
    """The same 8 ms round trip fits a tenth of a 100 ms CPU forward, not of a 3 ms GPU one:
    there the tenant's calls wait one short forward instead of the backend idling for them."""
    clock = _Clock()
    returning = ReturningTenants(0.020, clock, idle_share=0.1)
    backlog = {"light": 0}
    returning.sent("light", 4, cost=64.0)
    returning.replied("light")
    clock.now = 0.008
    hold, _ = returning.waiting(backlog.get, idle_since=0.0, forward_s=forward_s)
    assert hold is caught
    backlog["light"] = 4  # its calls are back
    assert returning.waiting(backlog.get, idle_since=0.0, forward_s=forward_s) == (False, 0.0)


def test_a_wait_that_held_up_no_one_else_is_not_bounded_by_the_idle_nor_a_miss() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.020, clock, idle_share=0.1)
    for _ in range(3):
        returning.sent("alone", 4, cost=64.0)
        returning.replied("alone")
        clock.now += 0.015  # past a tenth of the forward: nothing else was queued
        hold, _ = returning.waiting({"alone": 0}.get, clock.now - 0.015, 0.1, queued=0)
        assert hold
        clock.now += 0.006  # past anticipate_ms: its wait is over, yet it missed nobody
        assert returning.waiting({"alone": 0}.get, clock.now, 0.1, queued=0) == (False, 0.0)
    returning.sent("alone", 4, cost=64.0)
    assert returning.awaits("alone")  # never cooled off


def test_with_no_one_else_queued_some_of_its_calls_back_end_the_wait() -> None:
    """A sampler alone on a worker whose step has fewer distinct prompts than the last (or the
    rest of a step larger than a batch queued) is not held up by the wait for itself."""
    clock = _Clock()
    returning = ReturningTenants(0.020, clock)
    returning.sent("sampler", 64, cost=64.0)
    returning.replied("sampler")
    clock.now += 0.002
    assert returning.waiting({"sampler": 0}.get, clock.now, 0.1, queued=0)[0]  # none back yet
    assert returning.waiting({"sampler": 50}.get, clock.now, 0.1, queued=50) == (False, 0.0)
    returning.sent("sampler", 32, cost=32.0, queued=10)  # a step of 42, a batch of 32
    assert returning.awaits("sampler")
    assert returning.waiting({"sampler": 10}.get, None, 0.1, queued=10) == (False, 0.0)
    # with another tenant's requests queued, a partial return is still waited for (bounded)
    returning.sent("sampler", 64, cost=64.0)
    returning.replied("sampler")
    assert returning.waiting({"sampler": 50, "flood": 9}.get, clock.now, 0.1, queued=59)[0]


def _miss_twice(returning: ReturningTenants, clock: _Clock) -> None:
    for _ in range(2):
        returning.sent("slow", 2, cost=32.0)
        returning.replied("slow")
        clock.now += 0.011
        assert returning.waiting({"slow": 0}.get) == (False, 0.0)


def _cooled_batches(returning: ReturningTenants) -> int:
    batches = 0
    while True:
        returning.sent("slow", 2, cost=32.0)
        if returning.awaits("slow"):
            return batches
        batches += 1


def test_a_tenant_that_keeps_missing_is_tried_ever_more_rarely_until_it_is_caught() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.010, clock)
    cooled = []
    for _ in range(8):
        _miss_twice(returning, clock)
        cooled.append(_cooled_batches(returning))  # then awaited again
    assert cooled == [16, 32, 64, 128, 256, 512, 1024, 1024]
    assert cooled[-1] == MAX_COOL_OFF_BATCHES
    returning.replied("slow")
    assert returning.waiting({"slow": 2}.get) == (False, 0.0)  # caught: back to the start
    _miss_twice(returning, clock)
    assert _cooled_batches(returning) == COOL_OFF_BATCHES


def test_a_tenant_left_with_as_many_queued_as_it_sent_is_not_awaited() -> None:
    returning = ReturningTenants(0.010, _Clock())
    returning.sent("flood", 16, cost=256.0, queued=16)
    assert not returning.awaits("flood")
    returning.sent("light", 16, cost=256.0, queued=3)
    assert returning.awaits("light")


async def test_other_parts_replies_wait_for_every_awaited_part_or_the_safety_bound() -> None:
    first = AwaitedFirst(2)
    waiter = asyncio.create_task(first.wait(5.0))
    first.written()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # one awaited part still writing
    first.written()
    await asyncio.wait_for(waiter, 1.0)
    await asyncio.wait_for(AwaitedFirst(1).wait(0.01), 1.0)  # never written: the bound ends it


async def test_other_parts_replies_then_wait_for_the_next_forward_or_its_bound() -> None:
    started = asyncio.Event()
    first = AwaitedFirst(1, started, 5.0)
    waiter = asyncio.create_task(first.wait(5.0))
    first.written()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # the awaited part is written; the next batch is not started yet
    started.set()
    await asyncio.wait_for(waiter, 1.0)
    bounded = AwaitedFirst(1, asyncio.Event(), 0.01)
    bounded.written()
    await asyncio.wait_for(bounded.wait(5.0), 1.0)  # never started: its bound ends it


@pytest.fixture
def tenant_urls(redis_url: str) -> Iterator[tuple[TenantAdmin, dict[str, str]]]:
    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    urls = {name: tenant_admin.add(TenantConfig(name)) for name in ("flood", "light")}
    yield tenant_admin, urls
    users = [u.decode() for u in admin.execute_command("ACL", "USERS")]
    admin.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    admin.close()


@pytest.mark.parametrize(("anticipate_ms", "gap"), [(0, 2), (300, 1)])
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
    assert worker.worker is not None
    worker.worker.returning.idle_share = 0.6  # 300 ms of a 500 ms forward: a loaded machine's
    # round trip fits (the share bounds the idle; `test_one_setting_waits_out...` tests it)
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


def test_a_wait_that_ran_out_with_some_calls_back_is_no_miss() -> None:
    clock = _Clock()
    returning = ReturningTenants(0.010, clock)
    for _ in range(3):  # one of its programs late each time: it is still a live loop
        returning.sent("sampler", 16, cost=64.0)
        returning.replied("sampler")
        clock.now += 0.011
        assert returning.waiting({"sampler": 8}.get, queued=40) == (False, 0.0)
    returning.sent("sampler", 16, cost=64.0)
    assert returning.awaits("sampler")  # not cooling off
    for _ in range(2):  # nothing back, twice: that is a miss
        returning.replied("sampler")
        clock.now += 0.011
        assert returning.waiting({"sampler": 0}.get, queued=40) == (False, 0.0)
        returning.sent("sampler", 16, cost=64.0)
    assert not returning.awaits("sampler")


class _ReusingLM(RecordingLM):
    """Reports the light tenant's prompts (first token 2) as extending a stored past, as an
    hf backend's prefix cache does for a sampler's steps: one new token each."""

    def __init__(self, tokenizer: Any, reuses: bool) -> None:
        super().__init__(tokenizer)
        self.reuses = reuses

    def reused_tokens(self, prompts: Any) -> int:
        return sum(len(ids) - 1 for _, ids in prompts if self.reuses and ids[0] == 2)


@pytest.mark.parametrize("reuses", [True, False])
async def test_a_step_of_prompts_costing_less_than_their_length_fits_one_forward(
    redis_url: str,
    tenant_urls: tuple[TenantAdmin, dict[str, str]],
    smol_tokenizer: Any,
    reuses: bool,
) -> None:
    """Not awaited (no anticipation), a light tenant's 40-token calls are charged when picked
    what its forwards computed lately: one token each where the backend reuses their prefix,
    so its whole step shares the next forward with the flood; charged their length, a step
    is split over two forwards."""
    admin, urls = tenant_urls
    backend = _ReusingLM(smol_tokenizer, reuses)
    worker = ThreadedWorker(backend, admin.worker_user(), anticipate_ms=0).start()
    settings = ClientSettings(
        redis=RedisSettings(url=urls["light"]), use_shared_cache=False, local_cache_size=0
    )
    try:
        _xadd(redis_url, "flood", [[1, n] for n in range(20 * 32)])
        lm = await QueueLM.connect(MODEL, settings=settings)
        steps = [[[2, step, i, *[5] * 37] for i in range(8)] for step in range(5)]
        try:
            for prompts in steps:
                await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        finally:
            await lm.close()
    finally:
        worker.stop()
    forwards = [len({backend.forward_of[tuple(p)] for p in prompts}) for prompts in steps]
    assert all(n == 1 for n in forwards[3:]) is reuses, forwards  # once its share is learned
    assert max(backend.batch_sizes) == 32  # the flood filled the batches
