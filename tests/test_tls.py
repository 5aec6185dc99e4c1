"""TLS and password-protected users: client, worker and tenant administration over rediss://.

`RespPipe` speaks plain TCP only (`RespPipe.supports` refuses ``rediss://``), so over TLS the
client reads replies and claim-checks through redis-py: the fallback is tested here, and the
pipe's own password handshake (AUTH user password) on plain TCP. The same client and worker
run on a TLS-only Redis Cluster too (slow: a cluster of its own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import torch
from redis.exceptions import AuthenticationError, ResponseError

from lmqueue.devstack import LocalCluster
from lmqueue.producer import QueueLM
from lmqueue.producer.resp_pipe import RespPipe
from lmqueue.shared.connections import is_cluster, sync_redis
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker


@pytest.fixture
def tls_urls(tls_redis: tuple[str, Path]) -> Iterator[tuple[str, str]]:
    """URLs of tenant alice and of the workers' user on the TLS-only server."""
    admin_url, _ = tls_redis
    admin = redis.Redis.from_url(admin_url)
    admin.flushall()
    tenant_admin = TenantAdmin(admin, admin_url)
    yield tenant_admin.add(TenantConfig("alice")), tenant_admin.worker_user()
    admin.execute_command("ACL", "DELUSER", "alice", "lmq-worker")
    admin.close()


@pytest.fixture
def tls_cluster_urls(tls_cluster: LocalCluster) -> Iterator[tuple[str, str]]:
    """alice and the workers' user on every node of the TLS-only cluster."""
    tls_cluster.flush()
    admin = sync_redis(tls_cluster.url)
    assert is_cluster(admin)
    tenant_admin = TenantAdmin(admin, tls_cluster.url)
    yield tenant_admin.add(TenantConfig("alice")), tenant_admin.worker_user()
    admin.execute_command("ACL", "DELUSER", "alice", "lmq-worker", target_nodes=admin.ALL_NODES)
    admin.close()


@pytest.fixture(
    params=["single", pytest.param("cluster", marks=[pytest.mark.slow, pytest.mark.cluster])]
)
async def tls_lm(
    request: pytest.FixtureRequest, smol_tokenizer: object
) -> AsyncIterator[tuple[QueueLM, MockAsyncLM]]:
    """A client as alice and a worker as lmq-worker over TLS: one instance, then a cluster."""
    fixture = "tls_urls" if request.param == "single" else "tls_cluster_urls"
    alice_url, worker_url = request.getfixturevalue(fixture)
    backend = MockAsyncLM(smol_tokenizer)
    worker_redis = RedisSettings(url=worker_url, tenant="alice")
    served = ThreadedWorker(backend, worker_url, redis=worker_redis).start()
    settings = ClientSettings(redis=RedisSettings(url=alice_url, tenant="alice"))
    lm = await QueueLM.connect("mock", settings=settings)
    yield lm, backend
    await lm.close()
    served.stop()


def test_tenant_urls_keep_the_tls_scheme_and_options(tls_urls: tuple[str, str]) -> None:
    alice_url, worker_url = tls_urls
    assert alice_url.startswith("rediss://alice:") and "ssl_ca_certs=" in alice_url
    assert worker_url.startswith("rediss://lmq-worker:")
    assert not RespPipe.supports(alice_url)


def test_a_plain_connection_to_the_tls_port_fails(tls_redis: tuple[str, Path]) -> None:
    url, _ = tls_redis
    plain = redis.Redis.from_url(
        url.split("?")[0].replace("rediss://", "redis://"), socket_timeout=2
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()
    plain.close()


async def test_over_tls_with_passwords_the_client_falls_back_to_redis_py_and_works(
    tls_lm: tuple[QueueLM, MockAsyncLM], request: pytest.FixtureRequest
) -> None:
    lm, backend = tls_lm
    assert lm.channel.reader.pipe is None and lm.channel.claims.pipe is None  # redis-py path
    assert lm.channel.reader.thread is None  # no reply thread: its sockets speak no TLS
    assert is_cluster(lm.channel.redis) == (request.node.callspec.params["tls_lm"] == "cluster")
    prompts = [[1, 2, 3], [9, 8]]
    rows = await lm.batch_next_token_logprobs(prompts)
    for row, prompt in zip(rows, prompts, strict=True):
        torch.testing.assert_close(row, backend.logprobs_of(prompt).float())
    assert lm.channel.claims.resolved >= 1  # claim-checks fetched over TLS as alice
    assert lm.channel.reader.replies_read >= 2


async def test_resp_pipe_authenticates_as_a_user(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    alice_url = TenantAdmin(admin, redis_url).add(TenantConfig("alice"))
    key = KeySpace(tenant="alice").cache_entry("mock", "r", "lp.float32", b"\x01\x00\x00\x00")
    admin.set(key, b"v" * 20_000)
    try:
        pipe = RespPipe(alice_url)
        (values,) = await pipe.execute(("MGET", key))
        assert bytes(values[0]) == b"v" * 20_000
        bobs = KeySpace(tenant="bob").cache_entry("mock", "r", "lp.float32", b"\x01\x00\x00\x00")
        (refused,) = await pipe.execute(("GET", bobs))
        assert isinstance(refused, ResponseError) and "NOPERM" in str(refused)
        pipe.close()
        wrong = RespPipe(alice_url.replace("alice:", "alice:x", 1))
        with pytest.raises((ResponseError, AuthenticationError), match="WRONGPASS"):
            await wrong.execute(("PING",))
    finally:
        admin.execute_command("ACL", "DELUSER", "alice")
        admin.close()
