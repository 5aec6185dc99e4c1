"""Private LoRA adapters: another tenant is refused, and their rows stay in their tenant's keys.

A real redis-server with the ACL users `lmq tenant` makes; the worker runs as `lmq-worker`,
each client as its tenant, given nothing but its URL. bob and carol share the cache pool
``pool.lab``: a private adapter of bob's must still keep its rows out of the pool, where carol
could read them, and Redis itself must refuse carol the key (NOPERM).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import redis
from redis.exceptions import NoPermissionError
from test_adapters import _retry_unknown, _wait_replies, fake_adapter

from lmqueue.producer import QueueLM
from lmqueue.shared.adapters import AdapterRecord, adapter_revision
from lmqueue.shared.errors import Forbidden, UnknownAdapter
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request, encode_request, ids_to_bytes
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

MODEL = "mock"
PROMPT = [5, 6, 7]


@dataclass
class Fleet:
    admin: Any
    urls: dict[str, str]
    backend: MockAsyncLM


@pytest.fixture
def fleet(redis_url: str, smol_tokenizer: object, tmp_path) -> Iterator[Fleet]:
    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    urls = {
        "alice": tenant_admin.add(TenantConfig("alice")),
        "bob": tenant_admin.add(TenantConfig("bob", cache_namespace="pool.lab")),
        "carol": tenant_admin.add(TenantConfig("carol", cache_namespace="pool.lab")),
    }
    keys = KeySpace()
    for name, tenant in (("pub", None), ("bobs", "bob")):
        path = fake_adapter(tmp_path / name, name.encode())
        record = AdapterRecord(name, str(path), adapter_revision(path), tenant)
        admin.hset(keys.model_adapters(MODEL), name, record.to_bytes())
    backend = MockAsyncLM(smol_tokenizer)
    worker = ThreadedWorker(backend, tenant_admin.worker_user()).start()
    yield Fleet(admin, urls, backend)
    worker.stop()
    users = [u.decode() for u in admin.execute_command("ACL", "USERS")]
    admin.execute_command("ACL", "DELUSER", *[u for u in users if u != "default"])
    admin.close()


async def _connect(url: str, **kwargs: Any) -> QueueLM:
    settings = ClientSettings(timeout_s=20)
    return await QueueLM.connect(MODEL, redis_url=url, settings=settings, **kwargs)


async def test_a_private_adapter_serves_its_tenant_in_its_own_namespace_only(fleet: Fleet):
    async with await _connect(fleet.urls["bob"]) as bob:
        row = await _retry_unknown(lambda: bob.next_token_logprobs(PROMPT, lora_name="bobs"))
        public = await bob.next_token_logprobs(PROMPT, lora_name="pub")
    np.testing.assert_array_equal(row.numpy(), fleet.backend.logprobs_of(PROMPT, "bobs").numpy())
    cached = [k.decode() for k in fleet.admin.keys("lmq:*:cache:*")]
    private_keys = [k for k in cached if "~bobs@" in k]
    public_keys = [k for k in cached if "~pub@" in k]
    assert len(private_keys) == 1 and private_keys[0].startswith("lmq:bob:cache:")
    assert len(public_keys) == 1 and public_keys[0].startswith("lmq:pool.lab:cache:")
    carol = redis.Redis.from_url(fleet.urls["carol"])
    try:
        with pytest.raises(NoPermissionError):  # Redis itself refuses the pool's other tenant
            carol.get(private_keys[0])
        assert carol.get(public_keys[0]) is not None  # the pool works for carol
    finally:
        carol.close()
    async with await _connect(fleet.urls["bob"], adapter="bobs") as again:  # bob reads his own
        np.testing.assert_array_equal((await again.next_token_logprobs(PROMPT)).numpy(), row)
        assert again.stats["cache_hits"] == 1 and again.stats["sent"] == 0
    assert np.abs(public.numpy() - row.numpy()).max() > 0.1


async def test_another_tenants_client_cannot_tell_a_private_adapter_from_an_unknown_name(
    fleet: Fleet,
):
    """alice's credentials cannot read bob's adapter records (Redis refuses them), so her
    client knows nothing of "bobs": it is as unknown as a name nobody serves."""
    async with await _connect(fleet.urls["alice"]) as alice:
        for name in ("bobs", "nope"):
            with pytest.raises(UnknownAdapter) as caught:
                await alice.next_token_logprobs(PROMPT, lora_name=name)
            assert caught.value.data["served"] == ["pub"]  # bob's adapter is not listed
    with pytest.raises(UnknownAdapter):
        await _connect(fleet.urls["alice"], adapter="bobs")


async def test_the_worker_refuses_a_private_adapter_to_a_client_that_skips_its_checks(
    fleet: Fleet, aredis: Any
):
    """alice writes her own request stream directly, naming bob's adapter: the worker answers
    `Forbidden`, computes nothing and caches nothing."""
    async with await _connect(fleet.urls["bob"]) as bob:  # the worker has loaded it by now
        await _retry_unknown(lambda: bob.next_token_logprobs([9], lora_name="bobs"))
    alice = redis.asyncio.Redis.from_url(fleet.urls["alice"])
    try:
        alice_keys = KeySpace(tenant="alice")
        request = Request("r0", "rogue", ids_to_bytes(PROMPT), adapter="bobs")
        await alice.xadd(alice_keys.requests(MODEL), encode_request(request))
        replies = await _wait_replies(aredis, "rogue", 1, alice_keys)
    finally:
        await alice.aclose()
    assert isinstance(replies["r0"].error, Forbidden)
    assert not fleet.admin.keys("lmq:alice:cache:*")
