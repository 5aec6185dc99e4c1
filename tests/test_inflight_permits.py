"""InflightPermits: a client's in-flight bound, first come first served, never leaking a permit."""

from __future__ import annotations

import asyncio

import pytest

from lmqueue.producer.inflight_permits import InflightPermits


async def test_waiters_get_slots_in_arrival_order():
    permits = InflightPermits(1)
    assert permits.take_now() and not permits.take_now()
    order: list[int] = []

    async def take(n: int) -> None:
        await permits.take()
        order.append(n)

    waiting = [asyncio.create_task(take(n)) for n in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        permits.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert order == [0, 1, 2] and permits.free == 0
    permits.release()
    assert permits.free == 1


async def test_a_cancelled_waiter_takes_no_slot_and_skips_no_one():
    permits = InflightPermits(1)
    permits.take_now()
    gone = asyncio.create_task(permits.take())
    next_in_line = asyncio.create_task(permits.take())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    permits.release()
    await next_in_line
    assert permits.free == 0


async def test_a_waiter_cancelled_as_it_was_handed_a_slot_gives_it_back():
    permits = InflightPermits(1)
    permits.take_now()
    waiter = asyncio.create_task(permits.take())
    await asyncio.sleep(0)
    permits.release()  # handed over, but the task has not run yet
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert permits.free == 1


async def test_a_timed_out_wait_leaves_every_slot_accounted_for():
    permits = InflightPermits(2)
    assert permits.take_now() and permits.take_now()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(permits.take(), 0.05)
    permits.release()
    permits.release()
    assert permits.free == 2 and permits.take_now()
