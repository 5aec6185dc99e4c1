"""Tenant isolation is enforced by Redis: every refused operation answers NOPERM.

A real redis-server with the ACL users `lmq tenant` creates. Each refused operation is the exact
Redis command a misbehaving client would send, with the tenant's own credentials; each allowed
one is what its client needs, with the same credentials.

The same refusals run on the session Redis Cluster too, where `lmq tenant` writes the users to
every node: each command goes to the master owning its first key's slot (where a cluster
client would send it), a keyless one to every master (each node checks its own users).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from lmqueue.devstack import LocalCluster, LocalRedis
from lmqueue.shared.admission_script import ADMISSION_LUA, ADMISSION_SHA
from lmqueue.shared.connections import sync_redis
from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.tenants import WORKER_USER, TenantConfig
from lmqueue.tenant_admin import TenantAdmin

MODEL = "mock"


@dataclass
class Tenants:
    """The admin connection, and URLs of alice, bob (sharing pool.lab with carol) and workers."""

    admin: Any
    alice: str
    bob: str
    carol: str
    worker: str


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A redis-server saving users to an ACL file, DEBUG enabled (so only ACLs refuse it)."""
    acl_file = tmp_path_factory.mktemp("acl") / "users.acl"
    acl_file.write_text("user default on nopass ~* &* +@all\n")
    args = ["--aclfile", str(acl_file), "--enable-debug-command", "yes"]
    with LocalRedis(args=args) as server:
        yield server


@pytest.fixture
def tenants(acl_server: LocalRedis) -> Iterator[Tenants]:
    redis_url = acl_server.url
    admin = redis.Redis.from_url(redis_url)
    admin.flushall()
    admin.sadd(KeySpace().models(), MODEL)  # a published model: quotas get mirrored for it
    tenant_admin = TenantAdmin(admin, redis_url)
    urls = Tenants(
        admin,
        tenant_admin.add(TenantConfig("alice", max_inflight=100)),
        tenant_admin.add(TenantConfig("bob", cache_namespace="pool.lab")),
        tenant_admin.add(TenantConfig("carol", cache_namespace="pool.lab")),
        tenant_admin.worker_user(),
    )
    yield urls
    admin.execute_command("ACL", "DELUSER", "alice", "bob", "carol", "lmq-worker")
    admin.close()


@pytest.fixture
def alice(tenants: Tenants) -> Iterator[Any]:
    client = redis.Redis.from_url(tenants.alice)
    yield client
    client.close()


A = KeySpace(tenant="alice")
B = KeySpace(tenant="bob")
CACHE_A = A.cache_entry(MODEL, "r1", "lp.float32", b"\x01\x00\x00\x00")
CACHE_B = B.cache_entry(MODEL, "r1", "lp.float32", b"\x01\x00\x00\x00")
POOL = KeySpace(tenant="pool.lab").cache_entry(MODEL, "r1", "lp.float32", b"\x01\x00\x00\x00")

REFUSED = {
    # another tenant's streams
    "xadd to another tenant's requests": ("XADD", B.requests(MODEL), "*", "m", "x"),
    "xlen of another tenant's requests": ("XLEN", B.requests(MODEL)),
    "xrange of another tenant's requests": ("XRANGE", B.requests(MODEL), "-", "+"),
    "xread of another tenant's replies": ("XREAD", "STREAMS", B.replies("c1"), "0"),
    "xtrim of another tenant's replies": ("XTRIM", B.replies("c1"), "MAXLEN", "0"),
    "del of another tenant's replies": ("DEL", B.replies("c1")),
    "xadd into another tenant's replies": ("XADD", B.replies("c1"), "*", "r", "x"),
    "admission script on another tenant's stream": (
        "EVALSHA",
        ADMISSION_SHA,
        1,
        B.requests(MODEL),
        0,
        "",
        1,
        1,
        b"x",
    ),
    # writing any cache entry, reading another's
    "set of an own cache entry": ("SET", CACHE_A, b"v"),
    "set of another tenant's cache entry": ("SET", CACHE_B, b"v"),
    "set of a shared pool's entry": ("SET", POOL, b"v"),
    "get of another tenant's cache entry": ("GET", CACHE_B),
    "mget of another tenant's cache entry": ("MGET", CACHE_A, CACHE_B),
    "get of a pool not opted into": ("GET", POOL),
    "del of an own cache entry": ("DEL", CACHE_A),
    # consumer groups, even on its own stream
    "xgroup create": ("XGROUP", "CREATE", A.requests(MODEL), "g2", "0", "MKSTREAM"),
    "xgroup destroy": ("XGROUP", "DESTROY", A.requests(MODEL), WORKER_GROUP),
    "xreadgroup": ("XREADGROUP", "GROUP", WORKER_GROUP, "me", "STREAMS", A.requests(MODEL), ">"),
    "xack": ("XACK", A.requests(MODEL), WORKER_GROUP, "0-1"),
    "xautoclaim": ("XAUTOCLAIM", A.requests(MODEL), WORKER_GROUP, "me", 0, "0-0"),
    "xclaim": ("XCLAIM", A.requests(MODEL), WORKER_GROUP, "me", 0, "0-1"),
    "xpending": ("XPENDING", A.requests(MODEL), WORKER_GROUP),
    "xinfo groups": ("XINFO", "GROUPS", A.requests(MODEL)),
    # its own request stream beyond appending
    "xrange of its own requests": ("XRANGE", A.requests(MODEL), "-", "+"),
    "xdel from its own requests": ("XDEL", A.requests(MODEL), "0-1"),
    "xtrim of its own requests": ("XTRIM", A.requests(MODEL), "MAXLEN", "0"),
    "del of its own requests": ("DEL", A.requests(MODEL)),
    # adapter records: every adapter's (workers' and operator's), another tenant's private ones
    "hgetall of every adapter's records": ("HGETALL", A.model_adapters(MODEL)),
    "hget of every adapter's records": ("HGET", A.model_adapters(MODEL), "x"),
    "hgetall of another tenant's private adapters": ("HGETALL", B.private_adapters(MODEL)),
    "hset of the public adapters": ("HSET", A.public_adapters(MODEL), "x", b"r"),
    "hset of its own private adapters": ("HSET", A.private_adapters(MODEL), "x", b"r"),
    "hkeys of another tenant's private adapters": ("HKEYS", B.private_adapters(MODEL)),
    # workers' keys, the registry, quotas, tenants
    "zadd to the live workers": ("ZADD", A.model_workers(MODEL), 1, "w"),
    "zrange of the live workers": ("ZRANGE", A.model_workers(MODEL), 0, -1),
    "set of the model info": ("SET", A.model_info(MODEL), b"x"),
    "sadd to the model set": ("SADD", A.models(), "evil"),
    "hset of its own quota": ("HSET", A.quota(MODEL), "max_inflight", "0"),
    "hgetall of the tenants": ("HGETALL", A.tenants()),
    "hmget of another tenant's quota": ("HMGET", B.quota(MODEL), "max_inflight"),
    # dead letters
    "xrange of its dead letters": ("XRANGE", A.dead_letters(MODEL), "-", "+"),
    "xread of its dead letters": ("XREAD", "STREAMS", A.dead_letters(MODEL), "0"),
    "xadd to its dead letters": ("XADD", A.dead_letters(MODEL), "*", "m", "x"),
    # commands that ignore key patterns, and administration
    "keys": ("KEYS", "*"),
    "scan": ("SCAN", 0),
    "randomkey": ("RANDOMKEY",),
    "flushall": ("FLUSHALL",),
    "flushdb": ("FLUSHDB",),
    "config get": ("CONFIG", "GET", "*"),
    "config set": ("CONFIG", "SET", "maxmemory", "1"),
    "acl list": ("ACL", "LIST"),
    "acl setuser": ("ACL", "SETUSER", "alice", "+@all"),
    "debug": ("DEBUG", "SLEEP", 0),
    "script load": ("SCRIPT", "LOAD", "return 1"),
    "eval": ("EVAL", "return 1", 0),
    "script flush": ("SCRIPT", "FLUSH"),
    "function load": ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', ...)"),
    "info keyspace": ("INFO", "keyspace"),
    "client list": ("CLIENT", "LIST"),
    "client kill": ("CLIENT", "KILL", "USER", "bob"),
    "monitor": ("MONITOR",),
    "select": ("SELECT", 1),
    "publish": ("PUBLISH", "lmq", "x"),
    "subscribe": ("SUBSCRIBE", "lmq"),
    "multi": ("MULTI",),
    "object encoding": ("OBJECT", "ENCODING", A.requests(MODEL)),
    "dump of its own replies": ("DUMP", A.replies("c1")),
    "rename of its own replies": ("RENAME", A.replies("c1"), B.replies("c1")),
    "copy of its own replies": ("COPY", A.replies("c1"), B.replies("c1")),
}


@pytest.mark.parametrize("command", REFUSED.values(), ids=list(REFUSED))
def test_a_tenant_is_refused_with_noperm(alice: Any, command: tuple[object, ...]) -> None:
    with pytest.raises(NoPermissionError) as refused:
        alice.execute_command(*command)
    assert str(refused.value).startswith("this user has no permissions"), refused.value


def test_the_admission_script_cannot_read_another_tenants_quota(
    tenants: Tenants, alice: Any
) -> None:
    """The quota hash is named in ARGV; the script's HMGET is still checked as alice."""
    tenants.admin.script_load(ADMISSION_LUA)
    args = (A.requests(MODEL), 0, B.quota(MODEL), 1, 1, b"x")
    with pytest.raises(ResponseError, match="can't access at least one of the keys"):
        alice.execute_command("EVALSHA", ADMISSION_SHA, 1, *args)
    assert alice.xlen(A.requests(MODEL)) == 0


def test_a_tenant_may_do_what_its_clients_need(tenants: Tenants, alice: Any) -> None:
    admin = tenants.admin
    admin.set(A.model_info(MODEL), b"info")
    admin.set(A.model_tokenizer(MODEL), b"tok")
    admin.set(A.model_vocab(MODEL), b"vocab")
    admin.set(CACHE_A, b"vector")
    admin.xadd(A.replies("c1"), {"r": b"1"})
    admin.xadd(A.replies("c1"), {"r": b"2"})
    admin.hset(A.public_adapters(MODEL), "pub", b"public record")
    admin.hset(A.private_adapters(MODEL), "mine", b"alice's record")

    assert alice.ping()
    assert alice.info("server")["run_id"]
    assert alice.smembers(A.models()) == {MODEL.encode()}
    assert alice.get(A.model_info(MODEL)) == b"info"
    assert alice.get(A.model_tokenizer(MODEL)) == b"tok"
    assert alice.get(A.model_vocab(MODEL)) == b"vocab"
    assert alice.exists(A.model_info(MODEL)) == 1
    assert alice.hgetall(A.public_adapters(MODEL)) == {b"pub": b"public record"}
    assert alice.hgetall(A.private_adapters(MODEL)) == {b"mine": b"alice's record"}
    assert alice.mget([CACHE_A, CACHE_A + "0"]) == [b"vector", None]
    (stream, entries), *_ = alice.xread({A.replies("c1"): "0"})
    assert [fields for _, fields in entries] == [{b"r": b"1"}, {b"r": b"2"}]
    assert alice.xtrim(A.replies("c1"), minid=entries[1][0], approximate=False) == 1
    assert alice.delete(A.replies("c1")) == 1
    assert alice.hmget(A.quota(MODEL), "max_inflight") == [b"100"]
    admitted = alice.evalsha(
        ADMISSION_SHA, 2, A.requests(MODEL), A.rate(MODEL), 0, A.quota(MODEL), 2, 3, 4, b"a", b"b"
    )
    assert admitted[0] == 2 and alice.xlen(A.requests(MODEL)) == 2


def test_tenants_sharing_a_pool_read_it_and_nothing_private(tenants: Tenants) -> None:
    tenants.admin.set(POOL, b"shared")
    bob, carol = redis.Redis.from_url(tenants.bob), redis.Redis.from_url(tenants.carol)
    try:
        assert bob.get(POOL) == carol.get(POOL) == b"shared"
        with pytest.raises(NoPermissionError):
            bob.get(KeySpace(tenant="carol").cache_entry(MODEL, "r1", "lp.float32", b"\x01"))
    finally:
        bob.close()
        carol.close()


WORKER_REFUSED = {
    "xread of a reply stream": ("XREAD", "STREAMS", A.replies("c1"), "0"),
    "hset of the tenants": ("HSET", A.tenants(), "alice", "{}"),
    "hset of a rate bucket": ("HSET", A.rate(MODEL), "level", "1e9"),
    "keys": ("KEYS", "*"),
    "flushall": ("FLUSHALL",),
    "config set": ("CONFIG", "SET", "maxmemory", "1"),
    "acl setuser": ("ACL", "SETUSER", "lmq-worker", "+@all"),
    "set outside the layout": ("SET", "other:key", "x"),
    "xrange of dead letters": ("XRANGE", A.dead_letters(MODEL), "-", "+"),
}


@pytest.mark.parametrize("command", WORKER_REFUSED.values(), ids=list(WORKER_REFUSED))
def test_the_worker_user_is_refused_with_noperm(
    tenants: Tenants, command: tuple[object, ...]
) -> None:
    worker: Any = redis.Redis.from_url(tenants.worker)
    try:
        with pytest.raises(NoPermissionError):
            worker.execute_command(*command)
    finally:
        worker.close()


def test_the_worker_user_may_serve_every_tenant(tenants: Tenants, alice: Any) -> None:
    worker: Any = redis.Redis.from_url(tenants.worker)
    try:
        for keys in (A, B):
            worker.xgroup_create(keys.requests(MODEL), WORKER_GROUP, id="0", mkstream=True)
        alice.xadd(A.requests(MODEL), {"m": b"req"})
        reply = worker.xreadgroup(
            WORKER_GROUP, "w1", {A.requests(MODEL): ">", B.requests(MODEL): ">"}, count=8
        )
        (stream, [(entry_id, fields)]), *_ = reply
        assert fields == {b"m": b"req"}
        assert worker.hgetall(A.tenants())[b"alice"]
        worker.xadd(A.replies("c1"), {"r": b"1"})
        worker.expire(A.replies("c1"), 60)
        worker.set(CACHE_A, b"vector", ex=60)
        assert worker.mget([CACHE_A]) == [b"vector"]
        worker.xadd(A.dead_letters(MODEL), {"m": b"dead"}, maxlen=10, approximate=True)
        worker.hset(A.quota(MODEL), mapping={"max_inflight": "5"})
        assert worker.xpending(A.requests(MODEL), WORKER_GROUP)["pending"] == 1
        assert worker.xack(A.requests(MODEL), WORKER_GROUP, entry_id) == 1
        assert worker.xdel(A.requests(MODEL), entry_id) == 1
        assert worker.xautoclaim(A.requests(MODEL), WORKER_GROUP, "w1", 0)[1] == []
        assert worker.xinfo_consumers(A.requests(MODEL), WORKER_GROUP)
        with worker.pipeline(transaction=True) as pipe:
            pipe.set(A.model_info(MODEL), b"info").sadd(A.models(), MODEL)
            pipe.zadd(A.model_workers(MODEL), {"w1": 1}).execute()
        assert worker.script_load("return 1")
        assert alice.get(A.model_info(MODEL)) == b"info"
    finally:
        worker.close()


# DEBUG is refused before the ACL check where enable-debug-command is off (the cluster's nodes)
ON_CLUSTER = [
    *(pytest.param("alice", c, id=f"alice-{n}") for n, c in REFUSED.items() if n != "debug"),
    *(pytest.param(WORKER_USER, c, id=f"worker-{n}") for n, c in WORKER_REFUSED.items()),
]


@dataclass
class ClusterUsers:
    """The session cluster, an admin connection to one master, the users' passwords."""

    cluster: LocalCluster
    admin: Any
    passwords: dict[str, str]


@pytest.fixture(scope="module")
def cluster_users(redis_cluster: LocalCluster) -> Iterator[ClusterUsers]:
    """alice and the workers' user on every node of the session cluster, once per module."""
    admin = sync_redis(redis_cluster.url)
    tenant_admin = TenantAdmin(admin, redis_cluster.url)
    passwords = {"alice": "pw-alice", WORKER_USER: "pw-worker"}
    tenant_admin.add(TenantConfig("alice", max_inflight=100), password=passwords["alice"])
    tenant_admin.worker_user(password=passwords[WORKER_USER])
    node = redis.Redis(host="127.0.0.1", port=redis_cluster.master_ports()[0])
    yield ClusterUsers(redis_cluster, node, passwords)
    node.close()
    tenant_admin.remove("alice")
    admin.execute_command("ACL", "DELUSER", WORKER_USER, target_nodes=admin.ALL_NODES)
    admin.close()


def _owners(users: ClusterUsers, command: tuple[object, ...]) -> list[int]:
    """The master owning the command's first key, or every master for a keyless command."""
    try:
        keys = users.admin.command_getkeys(*command)  # decoded by redis-py
    except ResponseError:  # a command without key arguments
        keys = []
    if not keys:
        return users.cluster.master_ports()
    return [users.cluster.port_of_slot(LocalCluster.slot_of(keys[0]))]


@pytest.mark.cluster
@pytest.mark.parametrize(("user", "command"), ON_CLUSTER)
def test_a_tenant_and_the_worker_user_are_refused_with_noperm_on_a_cluster(
    cluster_users: ClusterUsers, user: str, command: tuple[object, ...]
) -> None:
    for port in _owners(cluster_users, command):
        client = redis.Redis(
            host="127.0.0.1", port=port, username=user, password=cluster_users.passwords[user]
        )
        try:
            with pytest.raises(NoPermissionError) as refused:
                client.execute_command(*command)
            assert str(refused.value).startswith("this user has no permissions"), refused.value
        finally:
            client.close()
