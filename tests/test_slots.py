"""Slots: a client's in-flight bound, first come first served, never leaking a slot."""

from __future__ import annotations

import asyncio

import pytest

from lmqueue.producer.slots import Slots


async def test_waiters_get_slots_in_arrival_order():
    slots = Slots(1)
    assert slots.take_now() and not slots.take_now()
    order: list[int] = []

    async def take(n: int) -> None:
        await slots.take()
        order.append(n)

    waiting = [asyncio.create_task(take(n)) for n in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert order == [0, 1, 2] and slots.free == 0
    slots.release()
    assert slots.free == 1


async def test_a_cancelled_waiter_takes_no_slot_and_skips_no_one():
    slots = Slots(1)
    slots.take_now()
    gone = asyncio.create_task(slots.take())
    next_in_line = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    slots.release()
    await next_in_line
    assert slots.free == 0


async def test_a_waiter_cancelled_as_it_was_handed_a_slot_gives_it_back():
    slots = Slots(1)
    slots.take_now()
    waiter = asyncio.create_task(slots.take())
    await asyncio.sleep(0)
    slots.release()  # handed over, but the task has not run yet
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.free == 1


async def test_a_timed_out_wait_leaves_every_slot_accounted_for():
    slots = Slots(2)
    assert slots.take_now() and slots.take_now()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(slots.take(), 0.05)
    slots.release()
    slots.release()
    assert slots.free == 2 and slots.take_now()
