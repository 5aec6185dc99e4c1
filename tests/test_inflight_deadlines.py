"""InflightTable deadlines: one timer for all, each request still ends at its own deadline."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from lmqueue.producer.inflight import InflightTable
from lmqueue.shared.errors import DeadlineExceeded
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.wire import Reply, Request


def _add(table: InflightTable, n: int, timeout_s: float):
    request = Request(f"c:{n}", "c", np.int32(n).tobytes())
    pending = table.add(request, PromptKey.of_request(request), n, timeout_s)
    return pending, table.wait(pending)


async def _ended_at(waiter: asyncio.Future, loop: asyncio.AbstractEventLoop) -> float:
    with pytest.raises(DeadlineExceeded):
        await waiter
    return loop.time()


async def test_requests_expire_at_their_own_deadlines_in_or_out_of_order():
    loop = asyncio.get_running_loop()
    table = InflightTable("c")
    started = loop.time()
    (_, long), (_, short), (_, shorter) = (
        _add(table, 0, 0.3), _add(table, 1, 0.2), _add(table, 2, 0.1),
    )  # fmt: skip
    ends = await asyncio.gather(*(_ended_at(w, loop) for w in (shorter, short, long)))
    for end, timeout_s in zip(ends, (0.1, 0.2, 0.3), strict=True):
        assert timeout_s - 0.005 <= end - started < timeout_s + 0.05
    assert len(table) == 0


async def test_a_settled_request_never_expires():
    table = InflightTable("c")
    pending, waiter = _add(table, 0, 0.05)
    table.resolve(Reply("c:0", np.zeros(4, dtype="<f4").tobytes()))
    assert (await waiter).shape == (4,)
    await asyncio.sleep(0.1)
    assert table.resolved == 1


async def test_settled_requests_do_not_pile_up_in_the_deadline_queue():
    table = InflightTable("c")
    live = [_add(table, n, 60)[1] for n in range(10)]
    for n in range(10, 10_000):
        _add(table, n, 60)
        table.resolve(Reply(f"c:{n}", b"\x00" * 4))
    assert len(table) == 10
    assert len(table._deadlines) <= 2 * len(table) + 64 + 1
    table.fail_all(DeadlineExceeded, "closing")
    await asyncio.gather(*live, return_exceptions=True)


async def test_a_settled_request_lingering_for_its_deadline_keeps_no_result_alive():
    """A settled request stays in the deadline queue until it is compacted away; its result
    must not (2,000 calls in flight held ~2,000 finished vectors: fresh pages every reply)."""
    table = InflightTable("c")
    pending, waiter = _add(table, 0, 60)
    table.resolve(Reply("c:0", np.zeros(4, dtype="<f4").tobytes()))
    result = weakref.ref(await waiter)
    del waiter
    gc.collect()
    assert pending in table._deadlines  # still queued: compaction is amortized
    assert result() is None
    table.fail_all(DeadlineExceeded, "closing")
