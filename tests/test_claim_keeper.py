"""`ClaimKeeper`: touches only for a batch that outlives its first interval, none after stop."""

from __future__ import annotations

import asyncio

from lmqueue.workers.claim_keeper import ClaimKeeper


class _Touches:
    def __init__(self) -> None:
        self.count = 0
        self.cancelled = False
        self.block = False

    async def __call__(self) -> None:
        self.count += 1
        if self.block:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise


async def test_a_batch_ended_before_the_first_interval_starts_no_task_and_never_touches() -> None:
    touches = _Touches()
    keeper = ClaimKeeper(touches, 0.05)
    await asyncio.sleep(0.01)
    await keeper.stop()
    await asyncio.sleep(0.1)  # past when the timer would have fired
    assert touches.count == 0
    assert not keeper.started


async def test_a_long_batch_is_touched_every_interval_until_stopped() -> None:
    touches = _Touches()
    keeper = ClaimKeeper(touches, 0.05)
    await asyncio.sleep(0.22)  # due at 0.05, 0.10, 0.15, 0.20
    assert keeper.started
    assert 2 <= touches.count <= 4, touches.count
    await keeper.stop()
    assert not keeper.started
    seen = touches.count
    await asyncio.sleep(0.12)
    assert touches.count == seen


async def test_stop_cancels_a_touch_under_way_and_waits_for_it() -> None:
    touches = _Touches()
    touches.block = True
    keeper = ClaimKeeper(touches, 0.01)
    await asyncio.sleep(0.05)
    assert touches.count == 1  # the first touch never returned
    await asyncio.wait_for(keeper.stop(), 1.0)
    assert touches.cancelled
