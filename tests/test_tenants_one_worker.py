"""Several tenants share one worker: each gets its own answers, in its own keys, and no more.

A real redis-server with the ACL users `lmq tenant` makes; the worker runs as `lmq-worker`,
each client as its tenant, given nothing but its URL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
import torch

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import QuotaExceeded
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.shared_cache import logprobs_kind
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request, decode_reply, encode_request
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

MODEL = "mock"


@dataclass
class Fleet:
    admin: Any
    tenant_admin: TenantAdmin
    urls: dict[str, str]
    worker: ThreadedWorker
    backend: MockAsyncLM


@pytest.fixture
def fleet(redis_url: str, smol_tokenizer: object) -> Iterator[Fleet]:
    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    urls = {
        "alice": tenant_admin.add(TenantConfig("alice")),
        "bob": tenant_admin.add(TenantConfig("bob", weight=2)),
        "capped": tenant_admin.add(TenantConfig("capped", max_inflight=3)),
    }
    backend = MockAsyncLM(smol_tokenizer)
    worker = ThreadedWorker(backend, tenant_admin.worker_user()).start()
    yield Fleet(admin, tenant_admin, urls, worker, backend)
    worker.stop()
    users = [u.decode() for u in admin.execute_command("ACL", "USERS")]
    admin.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    admin.close()


async def _connect(url: str) -> QueueLM:
    return await QueueLM.connect(MODEL, redis_url=url, settings=ClientSettings(timeout_s=20))


@pytest.fixture
async def clients(fleet: Fleet) -> AsyncIterator[dict[str, QueueLM]]:
    lms = {name: await _connect(url) for name, url in fleet.urls.items()}
    yield lms
    for lm in lms.values():
        await lm.close()


async def test_two_tenants_at_once_each_get_their_own_answers(
    fleet: Fleet, clients: dict[str, QueueLM]
) -> None:
    names = ["alice", "bob"]
    prompts = {name: [[i + 1, 7 * i + (3 if name == "bob" else 5)] for i in range(30)]
               for name in names}  # fmt: skip

    async def run(name: str) -> list[torch.Tensor]:
        lm = clients[name]
        return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts[name]))

    results = await asyncio.gather(*(run(name) for name in names))
    for name, rows in zip(names, results, strict=True):
        for prompt, row in zip(prompts[name], rows, strict=True):
            torch.testing.assert_close(row, fleet.backend.logprobs_of(prompt).float())
    for name, lm in clients.items():
        assert lm.channel.reader.stream == KeySpace(tenant=name).replies(lm.client_id)


async def test_a_forged_client_id_puts_nothing_into_another_tenants_keys(
    fleet: Fleet, clients: dict[str, QueueLM]
) -> None:
    """Alice names bob's client in her request: the reply lands in alice's keys only."""
    bob_id = clients["bob"].client_id
    alice = redis.Redis.from_url(fleet.urls["alice"])
    forged = Request("forged:1", bob_id, np.asarray([4, 2], "<i4").tobytes())
    alice.xadd(KeySpace(tenant="alice").requests(MODEL), encode_request(forged))
    alice.close()
    into_alice = KeySpace(tenant="alice").replies(bob_id)
    deadline = time.monotonic() + 10
    while not fleet.admin.exists(into_alice) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    [(_, fields)] = fleet.admin.xrange(into_alice)
    assert decode_reply(fields).request_id == "forged:1"
    assert clients["bob"].channel.reader.replies_read == 0
    assert clients["bob"].channel.inflight.duplicate_replies == 0


async def test_cache_namespaces_are_private_and_bad_vectors_are_misses(
    fleet: Fleet, clients: dict[str, QueueLM]
) -> None:
    prompt = [11, 12, 13]
    token_bytes = np.asarray(prompt, "<i4").tobytes()
    keys = {
        name: KeySpace(tenant=name).cache_entry(
            MODEL, fleet.backend.revision, logprobs_kind("float32"), token_bytes
        )
        for name in ("alice", "bob")
    }
    await clients["alice"].next_token_logprobs(prompt)
    assert fleet.admin.exists(keys["alice"]) and not fleet.admin.exists(keys["bob"])
    # a vector one value short in bob's namespace (as if someone wrote it): never handed out
    fleet.admin.set(keys["bob"], b"\0" * 4 * (fleet.backend.vector_size - 1))
    row = await clients["bob"].next_token_logprobs(prompt)
    torch.testing.assert_close(row, fleet.backend.logprobs_of(prompt).float())
    assert clients["bob"].channel.submitter.cache_hits == 0


async def test_a_tenant_added_while_the_worker_runs_is_served_within_seconds(
    fleet: Fleet,
) -> None:
    url = fleet.tenant_admin.add(TenantConfig("carol"))
    started = time.monotonic()
    async with await _connect(url) as carol:
        row = await carol.next_token_logprobs([5, 6])
    assert time.monotonic() - started < 8
    torch.testing.assert_close(row, fleet.backend.logprobs_of([5, 6]).float())


async def test_the_admission_quota_refuses_at_once_and_keeps_what_it_accepted(
    clients: dict[str, QueueLM],
) -> None:
    alice = clients["capped"]
    gate = asyncio.Event()  # hold answers back: nothing leaves the stream meanwhile
    original = alice.channel.reader.run

    async def held() -> None:
        await gate.wait()
        await original()

    alice.channel.reader.run = held  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(alice.next_token_logprobs([9, n]) for n in range(6)), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert refused and all(r.data["quota"] == "max_inflight" for r in refused)
    assert len(refused) < 6


async def test_the_worker_caps_a_tenant_that_skips_the_admission_script(
    fleet: Fleet, clients: dict[str, QueueLM]
) -> None:
    """A client may XADD directly; past the cap of 3 the worker answers QuotaExceeded."""
    alice = redis.Redis.from_url(fleet.urls["capped"])
    stream = KeySpace(tenant="capped").requests(MODEL)
    client_id = "raw-client"
    with alice.pipeline(transaction=False) as pipe:
        for n in range(12):
            request = Request(f"raw:{n}", client_id, np.asarray([3, n], "<i4").tobytes())
            pipe.xadd(stream, encode_request(request))
        pipe.execute()
    replies_key = KeySpace(tenant="capped").replies(client_id)
    deadline = time.monotonic() + 15
    alice.close()
    while fleet.admin.xlen(replies_key) < 12 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    replies = [decode_reply(fields) for _, fields in fleet.admin.xrange(replies_key)]
    assert len(replies) == 12
    errors = [r.error for r in replies if r.error is not None]
    assert errors and all(isinstance(e, QuotaExceeded) for e in errors)
    assert len(errors) <= 12 - 3


async def test_fair_share_charges_what_the_forward_computed_not_cache_hits(
    fleet: Fleet,
) -> None:
    settings = ClientSettings(timeout_s=20, use_shared_cache=False, local_cache_size=0)
    scheduler = fleet.worker.worker.scheduler  # type: ignore[union-attr]
    async with await QueueLM.connect(MODEL, redis_url=fleet.urls["alice"], settings=settings) as lm:
        await lm.next_token_logprobs([21, 22, 23])
        after_first = scheduler.served_cost("alice")
        await lm.next_token_logprobs([21, 22, 23])  # answered from the worker's cache
        after_hit = scheduler.served_cost("alice")
    assert after_first == pytest.approx(scheduler.cost_of(1, 3))
    assert after_hit == pytest.approx(after_first)
