"""The allowed path works with nothing but ACL credentials: a tenant's client, the workers' user.

The worker runs as `lmq-worker`, the client as tenant `alice`: connect, next-token calls (inline
replies, claim-checks fetched through `RespPipe` with AUTH user password, shared-cache hits)
and trie masses through `QueueTrie`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis
import torch

from lmqueue.producer import QueueLM, QueueTrie
from lmqueue.shared.connections import sync_redis
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.masses import TrieMasses
from workers_in_threads import ThreadedWorker


@dataclass
class Urls:
    alice: str
    worker: str


@pytest.fixture
def urls(any_redis_url: str) -> Iterator[Urls]:
    """alice and the workers' user, on a single instance and on every node of a cluster."""
    admin = sync_redis(any_redis_url)
    tenant_admin = TenantAdmin(admin, any_redis_url)
    yield Urls(tenant_admin.add(TenantConfig("alice")), tenant_admin.worker_user())
    tenant_admin.remove("alice")
    tenant_admin._acl("DELUSER", "lmq-worker")
    admin.close()


@pytest.fixture
def backend(smol_tokenizer: object) -> MockAsyncLM:
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
async def alice_lm(urls: Urls, backend: MockAsyncLM) -> AsyncIterator[QueueLM]:
    """The worker finds alice in the tenants hash; the client is alice by its URL alone."""
    masses = TrieMasses(backend.byte_vocab)
    served = ThreadedWorker(backend, urls.worker, masses=masses).start()
    lm = await QueueLM.connect("mock", redis_url=urls.alice, settings=ClientSettings())
    yield lm
    await lm.close()
    served.stop()


async def test_a_tenant_calls_and_gets_trie_masses_with_its_credentials_only(
    alice_lm: QueueLM, backend: MockAsyncLM
) -> None:
    assert alice_lm.channel.reader.pipe is not None  # RespPipe, AUTH as alice
    prompts = [[1, 2, 3], [4, 5], [6]]
    rows = await alice_lm.batch_next_token_logprobs(prompts)
    for row, prompt in zip(rows, prompts, strict=True):
        torch.testing.assert_close(row, backend.logprobs_of(prompt).float())
    assert alice_lm.channel.claims.resolved >= 1  # from alice's cache namespace
    trie = await QueueTrie.create(alice_lm)
    masses = await trie.mass_sum([1, 2, 3])
    assert masses[0] == pytest.approx(1.0, abs=1e-5)
    alice_lm.clear_cache()
    again = await alice_lm.next_token_logprobs([1, 2, 3])
    torch.testing.assert_close(again, rows[0])
    assert alice_lm.channel.submitter.cache_hits >= 1  # a shared-cache hit, read as alice


async def test_generated_tenant_users_submit_and_read_only_their_own_experiments(
    redis_url: str,
) -> None:
    """The same ACL rules `lmq tenant add` makes cover experiments; Redis refuses the rest."""
    from lmqueue.producer import Experiments
    from lmqueue.shared.errors import Forbidden
    from lmqueue.shared.experiment_kinds import KindSpec, encode_catalog
    from lmqueue.shared.keys import KeySpace

    admin = redis.Redis.from_url(redis_url)
    tenant_admin = TenantAdmin(admin, redis_url)
    alice_url = tenant_admin.add(TenantConfig("alice"))
    bob_url = tenant_admin.add(TenantConfig("bob"))
    alice, bob = Experiments.connect(alice_url), Experiments.connect(bob_url)
    # what a scheduler publishes, and tenants read to check a submission
    catalog = encode_catalog({"noop": KindSpec(None, needs_model=False)})
    admin.set(KeySpace().experiment_kinds(), catalog)
    try:
        experiment_id = await alice.submit("noop", {"rows": []}, experiment_id="e1")
        assert (await alice.status(experiment_id)).status == "queued"
        assert [s.id for s in await alice.list()] == [experiment_id]
        with pytest.raises(Forbidden):  # alice's record, read with bob's credentials
            await Experiments(bob.redis, alice.keys).status(experiment_id)
        with pytest.raises(Forbidden):
            await Experiments(bob.redis, alice.keys).cancel(experiment_id)
        assert await bob.list() == []
    finally:
        await alice.close()
        await bob.close()
        admin.execute_command("ACL", "DELUSER", "alice", "bob")
        admin.close()
