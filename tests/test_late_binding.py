"""Late binding: a worker picks its next batch when the backend is done with the last one.

A request arriving while a forward runs joins the very next forward, not the one after it,
though the worker reads ahead and another tenant has several batches queued.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import redis

from lmqueue.shared.keys import KeySpace
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request, encode_request
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.late_binding import (
    PICK_LEAD,
    BackendOccupancy,
    BatchForward,
    ForwardPart,
    ForwardStart,
)
from workers_in_threads import ThreadedWorker

MODEL = "mock"
FORWARD_S = 0.5


class RecordingLM(MockAsyncLM):
    """A mock backend that notes which forward (1, 2, ...) answered each prompt."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, batch_delay_s=FORWARD_S)
        self.forward_of: dict[tuple[int, ...], int] = {}
        self.calls = 0

    async def logprobs_batch(self, prompts: Sequence[tuple[str | None, Sequence[int]]]) -> Any:
        self.calls += 1
        results = await super().logprobs_batch(prompts)
        for _, token_ids in prompts:
            self.forward_of[tuple(token_ids)] = len(self.batch_sizes)
        return results


@pytest.fixture
def tenants(redis_url: str) -> Iterator[TenantAdmin]:
    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    for name in ("flood", "light"):
        tenant_admin.add(TenantConfig(name))
    yield tenant_admin
    users = [u.decode() for u in admin.execute_command("ACL", "USERS")]
    admin.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    admin.close()


def _xadd(url: str, tenant: str, prompts: list[list[int]]) -> None:
    client = redis.Redis.from_url(url)
    with client.pipeline(transaction=False) as pipe:
        for n, prompt in enumerate(prompts):
            request = Request(f"{tenant}:{n}", f"raw-{tenant}", np.asarray(prompt, "<i4").tobytes())
            pipe.xadd(KeySpace(tenant=tenant).requests(MODEL), encode_request(request))
        pipe.execute()
    client.close()


async def test_a_request_arriving_during_a_forward_joins_the_next_forward(
    redis_url: str, tenants: TenantAdmin, smol_tokenizer: Any
) -> None:
    backend = RecordingLM(smol_tokenizer)
    worker = ThreadedWorker(backend, tenants.worker_user()).start()
    try:
        deadline = time.monotonic() + 15
        _xadd(redis_url, "flood", [[3, 3]])  # one forward first: the worker measures it
        while not backend.forward_of and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        flood = [[1, n] for n in range(4 * 32)]  # four batches of the default 32
        _xadd(redis_url, "flood", flood)
        while backend.calls < 2 and time.monotonic() < deadline:  # the next forward began
            await asyncio.sleep(0.01)
        await asyncio.sleep(FORWARD_S / 4)
        _xadd(redis_url, "light", [[2, 2, 2]])
        while (2, 2, 2) not in backend.forward_of and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
    assert backend.forward_of[(2, 2, 2)] == 3  # the forward after the one it arrived in
    assert backend.batch_sizes[:3] == [1, 32, 32]  # the worker batched no less for it


def test_the_backend_slot_is_free_only_when_every_holder_released() -> None:
    slot = BackendOccupancy()
    first, second = slot.hold(), slot.hold()
    first()
    first()  # a second release of one hold changes nothing
    assert slot.busy
    second()
    assert not slot.busy


def test_the_backend_is_idle_since_its_last_batch_was_released() -> None:
    now = [1.0]
    slot = BackendOccupancy(clock=lambda: now[0])
    assert slot.idle_since == 1.0
    first, second = slot.hold(), slot.hold()
    now[0] = 2.0
    first()
    assert slot.idle_since is None  # one batch still held
    now[0] = 3.0
    second()
    assert slot.idle_since == 3.0


def test_the_next_batch_is_picked_a_fifth_of_a_forward_before_the_backend_is_done() -> None:
    now = [0.0]
    slot = BackendOccupancy(clock=lambda: now[0])
    assert slot.pick_in_s() == 0.0
    first = slot.hold()
    assert slot.pick_in_s() == 0.0  # no estimate yet: one batch ahead, as a prefetch
    slot.hold()
    assert slot.pick_in_s() is None  # a batch waits for the backend already
    now[0] = 1.0
    first()
    assert slot.forward_s == 1.0
    now[0] = 1.5
    assert slot.pick_in_s() == pytest.approx((1 - PICK_LEAD) - 0.5)
    now[0] = 2.0
    assert slot.pick_in_s() == 0.0


async def test_the_parts_of_a_batch_call_the_backend_together() -> None:
    done: list[str] = []
    forward = BatchForward(3, lambda: done.append("computed"))
    parts = [forward.part() for _ in range(3)]
    early = asyncio.create_task(parts[0].ready())
    await asyncio.sleep(0.01)
    assert not early.done()  # waits for the others
    parts[1].computed()  # a part with nothing to compute (or failed) does not hold it up
    parts[2].computed()
    assert not early.done() and done == []
    await parts[2].ready()  # computed already: returns at once
    await asyncio.wait_for(early, 1)
    parts[0].computed()
    parts[0].computed()
    assert done == ["computed"]


async def test_what_waits_for_the_whole_batch_runs_once_its_last_part_is_computed() -> None:
    done: list[str] = []
    forward = BatchForward(2, lambda: done.append("computed"))
    narrow, wide = forward.part(), forward.part()
    narrow.computed()  # a split batch's narrow rows are answered first ...
    narrow.after_batch(lambda: done.append("narrow's tenant replied"))
    assert done == []  # ... but the backend still computes the wide ones
    wide.computed()
    assert done == ["computed", "narrow's tenant replied"]
    wide.after_batch(lambda: done.append("wide's tenant replied"))  # done already: at once
    assert done[-1] == "wide's tenant replied"


async def test_a_batch_reports_the_backends_time_from_its_call_and_none_for_cache_hits() -> None:
    took: list[float] = []
    now = [10.0]
    forward = BatchForward(2, timed=took.append, clock=lambda: now[0])
    parts = [forward.part(), forward.part()]
    parts[0].computed()  # a part of cache hits: no call
    now[0] = 11.0
    await parts[1].ready()  # the last part arrives: the backend is called now
    now[0] = 11.25
    parts[1].computed()
    assert took == [0.25]
    hits = BatchForward(1, timed=took.append)
    hits.part().computed()
    assert len(took) == 1  # nothing computed: nothing to time


async def test_a_batch_says_once_when_its_parts_are_released_to_the_backend() -> None:
    order: list[str] = []
    forward = BatchForward(2, started=lambda: order.append("started"))
    parts = [forward.part(), forward.part()]

    async def call(name: str, part: ForwardPart) -> None:
        await part.ready()
        order.append(name)

    first = asyncio.create_task(call("first part", parts[0]))
    await asyncio.sleep(0.01)
    assert order == []  # one part still decoding
    await call("last part", parts[1])
    await first
    assert order == ["started", "first part", "last part"]
    parts[0].computed()
    parts[1].computed()
    assert order.count("started") == 1
    empty: list[str] = []
    BatchForward(0, started=lambda: empty.append("started"))  # nothing to call: released at once
    assert empty == ["started"]


async def test_the_parts_of_a_batch_call_the_backend_in_the_order_they_arrived() -> None:
    forward = BatchForward(3)
    calls: list[int] = []

    async def call(index: int, part: ForwardPart) -> None:
        await part.ready()
        calls.append(index)

    await asyncio.gather(*(call(i, forward.part()) for i in range(3)))
    assert calls == [0, 1, 2]  # the last to arrive does not run ahead of the others


def test_a_held_batch_is_told_when_it_gets_its_place_at_the_backend() -> None:
    placed: list[str] = []
    slot = BackendOccupancy()
    first = slot.hold(placed=lambda: placed.append("first"))
    assert placed == ["first"]  # the backend was free
    second = slot.hold(placed=lambda: placed.append("second"))
    third = slot.hold(placed=lambda: placed.append("third"))
    assert placed == ["first"]  # both wait behind the first
    third()  # released before its place (a batch of cache hits): never placed
    first()
    assert placed == ["first", "second"]
    second()
    assert placed == ["first", "second"]


async def test_a_forward_starts_when_its_parts_are_released_and_it_has_its_place() -> None:
    """A batch whose parts call the backend while the forward ahead runs is timed from when
    that forward ended, not from its call."""
    took: list[float] = []
    now = [10.0]
    slot = BackendOccupancy(clock=lambda: now[0])
    ahead = slot.hold()
    start = ForwardStart(clock=lambda: now[0])
    slot.hold(placed=start.placed)
    forward = BatchForward(1, timed=took.append, clock=lambda: now[0], start=start)
    part = forward.part()
    await part.ready()  # released at 10.0, while the batch ahead runs
    assert start.at is None
    now[0] = 10.4
    ahead()  # the forward ahead ends: this one has the backend from now
    assert start.at == 10.4
    now[0] = 10.9
    part.computed()
    assert took == [pytest.approx(0.5)]
    early = ForwardStart(clock=lambda: now[0])
    early.placed()  # the backend was free before the parts were ready
    forward = BatchForward(1, timed=took.append, clock=lambda: now[0], start=early)
    now[0] = 11.0
    await forward.part().ready()
    assert early.at == 11.0
