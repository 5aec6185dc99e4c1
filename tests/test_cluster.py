"""Redis Cluster as a deployment choice: detection, hash slots, per-node reads, end to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as synccluster
import torch
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

from lmqueue.devstack import LocalCluster, WorkerProcess
from lmqueue.producer import QueueLM
from lmqueue.producer.node_pipes import NodePipes
from lmqueue.producer.resp_pipe import RespPipe
from lmqueue.producer.slot_pipe import SlotPipe
from lmqueue.shared.cluster_gets import ClusterGets
from lmqueue.shared.connections import (
    _VectoredConnection,
    connect_async_redis,
    multi_get,
    sync_redis,
)
from lmqueue.shared.errors import Unavailable
from lmqueue.shared.keys import WORKER_GROUP, KeySpace
from lmqueue.shared.redis_errors import REDIS_DOWN, translate
from lmqueue.shared.registry import ModelInfo, ModelRegistry
from lmqueue.shared.settings import ClientSettings, RedisSettings
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker

KEYS = KeySpace()


async def test_a_cluster_node_gives_a_cluster_client_and_a_single_instance_a_plain_one(
    cluster_url, redis_url
):
    on_cluster = await connect_async_redis(cluster_url)
    on_single = await connect_async_redis(redis_url)
    try:
        assert isinstance(on_cluster, aiocluster.RedisCluster)
        assert len(on_cluster.get_primaries()) == 3
        # every node sends a pipeline's pieces without joining them, as the plain client does
        assert {n.connection_class for n in on_cluster.get_nodes()} == {_VectoredConnection}
        # the single instance gets exactly the client it always got: nothing wraps it
        assert type(on_single) is aioredis.Redis
        assert on_single.connection_pool.connection_class is _VectoredConnection
    finally:
        await on_cluster.aclose()
        await on_single.aclose()
    blocking = sync_redis(cluster_url)
    assert isinstance(blocking, synccluster.RedisCluster)
    blocking.close()
    assert type(sync_redis(redis_url)) is redis.Redis


async def test_an_unreachable_node_gives_the_lazy_plain_client_as_before():
    client = await connect_async_redis("redis://127.0.0.1:1/0", connect_timeout_s=0.2)
    assert type(client) is aioredis.Redis
    await client.aclose()


async def test_a_model_is_published_and_read_back_on_a_cluster_from_one_slot(cluster_url):
    model = "some/model-1.5"
    registry_keys = [KEYS.model_info(model), KEYS.model_tokenizer(model), KEYS.model_vocab(model),
                     KEYS.model_workers(model)]  # fmt: skip
    client = await connect_async_redis(cluster_url)
    try:
        assert len({client.keyslot(key) for key in registry_keys}) == 1
        registry = ModelRegistry(client, KEYS)
        info = ModelInfo(model, "r1", "mock", 3, 3, 16)
        await registry.publish(info, {"tokenizer.json": b"{}"}, [b"a", b"b", b"c"])
        assert await registry.info(model) == info
        assert await registry.tokenizer_files(model) == {"tokenizer.json": b"{}"}
        assert await registry.byte_vocab(model) == [b"a", b"b", b"c"]
        assert await client.smembers(KEYS.models()) == {model.encode()}
    finally:
        await client.aclose()


async def test_cache_keys_spread_over_every_master(cluster_url):
    client = await connect_async_redis(cluster_url)
    try:
        keys = [
            KEYS.cache_entry("m", "r1", "lp.float32", i.to_bytes(2, "little")) for i in range(300)
        ]
        nodes = [client.get_node_from_key(key).name for key in keys]
        counts = sorted(nodes.count(name) for name in set(nodes))
        assert len(counts) == 3 and counts[0] > 60  # about 100 each
    finally:
        await client.aclose()


async def test_a_multi_get_on_a_cluster_asks_the_nodes_concurrently(redis_cluster, cluster_url):
    client = await connect_async_redis(cluster_url)
    keys = [KEYS.cache_entry("m", "r1", "lp.float32", bytes([i])) for i in range(60)]
    try:
        await asyncio.gather(*(client.set(key, key.encode()) for key in keys[::2]))
        assert await multi_get(client)(keys[:4]) == [keys[0].encode(), None, keys[2].encode(), None]
        # every master answers only after a 0.6 s pause: asked one after another, 1.8 s
        for port in redis_cluster.master_ports():
            with redis.Redis(host="127.0.0.1", port=port) as node:
                node.execute_command("CLIENT", "PAUSE", 600, "ALL")
        started = time.monotonic()
        values = await multi_get(client)(keys)
        elapsed_s = time.monotonic() - started
    finally:
        await client.aclose()
    assert values == [key.encode() if i % 2 == 0 else None for i, key in enumerate(keys)]
    assert 0.4 < elapsed_s < 1.2, elapsed_s


@pytest.fixture
async def cluster_client(cluster_url: str) -> AsyncIterator[Any]:
    """An asyncio cluster client of the flushed session cluster."""
    client = await connect_async_redis(cluster_url)
    yield client
    await client.aclose()


def _getkeys_calls(cluster: LocalCluster) -> int:
    """``COMMAND GETKEYS`` calls every master has run so far."""
    calls = 0
    for port in cluster.master_ports():
        with redis.Redis(host="127.0.0.1", port=port) as node:
            calls += int(
                node.info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0)
            )
    return calls


async def test_stream_reads_are_routed_without_asking_a_node_for_their_keys(
    redis_cluster, cluster_client
):
    """XREADGROUP and XREAD, alone and in a pipeline, reach the master of their stream and
    answer what they should; no master was asked ``COMMAND GETKEYS`` for them (redis-py asks
    one for every read of a command with movable keys)."""
    streams = [KEYS.requests("m", partition) for partition in range(3)]  # three slots
    for stream in streams:
        await cluster_client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        await cluster_client.xadd(stream, {b"m": stream.encode()})
    before = _getkeys_calls(redis_cluster)
    read = [
        await cluster_client.xreadgroup(WORKER_GROUP, "streams", {stream: ">"}, count=5)
        for stream in streams
    ]
    async with cluster_client.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xread({stream: "0"}, count=5, block=10)
        piped = await pipe.execute()
    assert _getkeys_calls(redis_cluster) == before
    for stream, got, again in zip(streams, read, piped, strict=True):
        assert [fields for _, fields in got[0][1]] == [{b"m": stream.encode()}]
        assert [fields for _, fields in again[0][1]] == [{b"m": stream.encode()}]
    with pytest.raises(RedisClusterException, match="same key slot"):
        await cluster_client.xread({streams[0]: "0", streams[1]: "0"})


async def _some_stored(
    client: Any, tag: bytes, count: int, every: int
) -> tuple[list[str], list[bytes | None]]:
    """`count` cache keys, every `every`-th of them set to its own name, and what MGET answers."""
    keys = [KEYS.cache_entry("m", "r1", "lp.float32", tag + bytes([i])) for i in range(count)]
    await asyncio.gather(*(client.set(key, key.encode()) for key in keys[::every]))
    return keys, [key.encode() if i % every == 0 else None for i, key in enumerate(keys)]


def _kill_connections(cluster: LocalCluster, last_commands: tuple[str, ...]) -> None:
    """Close, on every master, the client connections whose last command was one of these."""
    for port in cluster.master_ports():
        with redis.Redis(host="127.0.0.1", port=port) as node:
            for peer in node.client_list(_type="normal"):
                if peer["cmd"] in last_commands:
                    node.client_kill_filter(_id=peer["id"])


async def test_a_stale_slot_map_sends_a_multi_get_through_the_redirection(cluster_client):
    keys, expected = await _some_stored(cluster_client, b"stale", 24, every=3)
    gets = multi_get(cluster_client)
    assert isinstance(gets, ClusterGets) and await gets(keys) == expected
    assert gets.fallbacks == 0  # one pipeline of GETs a master answered it
    # the map says another master serves the first key's slot: that master answers MOVED
    slots = cluster_client.nodes_manager.slots_cache
    right = slots[key_slot(keys[0].encode())][0]
    wrong = next(n for n in cluster_client.get_primaries() if n.name != right.name)
    slots[key_slot(keys[0].encode())] = [wrong]
    assert await gets(keys) == expected
    assert gets.fallbacks == 1  # through mget_nonatomic, which followed MOVED
    # every answer was read, so the connections went back clean: the next call is exact
    assert await gets(list(reversed(keys))) == list(reversed(expected))


async def test_a_multi_get_answers_a_key_of_another_type_as_mget_does(cluster_client):
    keys = [KEYS.cache_entry("m", "r1", "lp.float32", b"type" + bytes([i])) for i in range(6)]
    await cluster_client.set(keys[0], b"v0")
    await cluster_client.rpush(keys[1], b"a list")  # GET answers WRONGTYPE; MGET answers nil
    gets = multi_get(cluster_client)
    assert await gets(keys) == [b"v0", None, None, None, None, None]
    assert gets.fallbacks == 1
    assert await gets(keys[:1]) == [b"v0"]  # the connections went back clean


async def test_a_multi_get_whose_connections_a_master_closed_still_answers(
    redis_cluster, cluster_client
):
    keys, expected = await _some_stored(cluster_client, b"killed", 12, every=2)
    gets = multi_get(cluster_client)
    assert await gets(keys) == expected and gets.fallbacks == 0
    _kill_connections(redis_cluster, last_commands=("get", "set"))  # this client's pool
    assert await gets(keys) == expected
    assert gets.fallbacks == 1  # the lost connection sent it through mget_nonatomic
    assert await gets(keys) == expected and gets.fallbacks == 1  # reconnected


async def test_node_pipes_answer_what_redis_py_does_with_vectors_in_place(
    cluster_client, cluster_url
):
    keys = [KEYS.cache_entry("m", "r1", "lp.float16", b"pipes" + bytes([i])) for i in range(30)]
    vectors = {k: np.full(49152, i, dtype=np.float16).tobytes() for i, k in enumerate(keys[::3])}
    await cluster_client.set(keys[1], b"small")
    await asyncio.gather(*(cluster_client.set(key, value) for key, value in vectors.items()))
    pipes = NodePipes(cluster_client, cluster_url)
    try:
        values = await pipes.get(keys)
    finally:
        pipes.close()
    assert values is not None and pipes.answered == 30 and pipes.refusals == 0
    expected = await multi_get(cluster_client)(keys)
    assert [None if v is None else bytes(v) for v in values] == expected
    assert all(isinstance(values[keys.index(k)], memoryview) for k in vectors)  # in place


async def test_node_pipes_refuse_on_a_stale_map_or_a_lost_connection_and_then_answer(
    redis_cluster, cluster_client, cluster_url
):
    keys, expected = await _some_stored(cluster_client, b"refuse", 12, every=2)
    pipes = NodePipes(cluster_client, cluster_url)
    try:
        assert await pipes.get(keys) == expected
        slots = cluster_client.nodes_manager.slots_cache
        right = slots[key_slot(keys[0].encode())]
        slots[key_slot(keys[0].encode())] = [
            next(n for n in cluster_client.get_primaries() if n.name != right[0].name)
        ]
        assert await pipes.get(keys) is None and pipes.refusals == 1  # MOVED: ask redis-py
        slots[key_slot(keys[0].encode())] = right
        assert await pipes.get(keys) == expected  # every answer was read: the pipes are clean
        _kill_connections(redis_cluster, last_commands=("get",))  # the pipes' connections
        assert await pipes.get(keys) is None and pipes.refusals == 2
        assert await pipes.get(keys) == expected  # the failed pipes were dropped, new ones made
    finally:
        pipes.close()


@pytest.mark.parametrize(
    "error",
    [
        ClusterDownError("CLUSTERDOWN The cluster is down"),
        MasterDownError("MASTERDOWN Link with MASTER is down"),
        TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        SlotNotCoveredError("Slot 5 is not covered by the cluster"),
        ClusterError("TTL exhausted."),
    ],
)
def test_a_cluster_in_failover_counts_as_down_for_now(error):
    assert isinstance(error, REDIS_DOWN)  # loops retry it
    translated = translate(error, "reading replies")
    assert isinstance(translated, Unavailable) and "cannot be reached" in str(translated)


async def test_a_single_instance_multi_get_is_one_mget(aredis):
    assert multi_get(aredis) == aredis.mget


@pytest.fixture
def served_any(any_redis_url, tmp_path):
    worker = WorkerProcess("smollm2-135m", "mock", any_redis_url, "any-0", log_dir=tmp_path)
    worker.start()
    yield any_redis_url
    assert worker.stop() == 0, worker.log()


async def test_a_worker_process_and_a_client_answer_exactly_on_either_deployment(
    served_any, smol_tokenizer, redis_cluster
):
    reference = MockAsyncLM(smol_tokenizer)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 49152, size=int(rng.integers(1, 30))).tolist() for _ in range(300)]
    async with await QueueLM.connect(
        "smollm2-135m", redis_url=served_any, connect_timeout_s=60
    ) as lm:
        on_cluster = isinstance(lm.channel.redis, aiocluster.RedisCluster)
        pipes, thread = list(lm.channel.pipes), lm.channel.thread
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        lm.clear_cache()
        again = await lm.next_token_logprobs(prompts[0])  # from the shared cache
        stats = lm.stats
        aimed = thread is not None and not thread.needs_aim  # at the reply stream's master
    for prompt, result in zip(prompts, results, strict=True):
        assert torch.equal(result, reference.logprobs_of(prompt))
    assert torch.equal(again, results[0])
    assert on_cluster == (served_any == redis_cluster.url)
    # replies land in place on either; on a cluster the receiver follows the reply stream's slot
    assert isinstance(pipes[0], SlotPipe if on_cluster else RespPipe)
    assert (pipes[1] is None) if on_cluster else isinstance(pipes[1], RespPipe)
    assert isinstance(pipes[2], NodePipes) if on_cluster else pipes[2] is None
    assert stats["inflight"] == 0 and stats["cache_hits"] >= 1
    # claim-checks: on a cluster the worker writes cache entries before the replies, so a
    # claimed entry is always there
    assert stats["claims_missed"] == 0 and stats["claims_resolved"] > 0, stats
    # read on the client's reply thread on either, claims resolved there: on a cluster from
    # every master, by one snapshot of the slot map, none on the loop (nor through redis-py)
    assert thread is not None and thread.redirects == 0 and aimed
    if on_cluster:
        assert thread.slots is not None and thread.slots.taken == 1
        assert pipes[2].answered == 0 and pipes[2].refusals == 0


@pytest.mark.cluster
async def test_the_cache_role_alone_can_be_a_cluster(
    redis_url, cluster_url, smol_tokenizer, tmp_path
):
    worker = WorkerProcess("smollm2-135m", "mock", redis_url, "cache-on-cluster", log_dir=tmp_path,
                           extra_args=["--cache-url", cluster_url])  # fmt: skip
    worker.start()
    reference = MockAsyncLM(smol_tokenizer)
    prompts = [[i, i + 1, i + 2] for i in range(100)]
    try:
        settings = ClientSettings(redis=RedisSettings(url=redis_url, cache_url=cluster_url),
                                  connect_timeout_s=60)  # fmt: skip
        async with await QueueLM.connect("smollm2-135m", settings=settings) as lm:
            assert not isinstance(lm.channel.redis, aiocluster.RedisCluster)
            assert isinstance(lm.channel.cache_redis, aiocluster.RedisCluster)
            first = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            lm.clear_cache()
            second = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            stats, nodes, thread = lm.stats, lm.channel.claims.nodes, lm.channel.thread
    finally:
        assert worker.stop() == 0, worker.log()
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert torch.equal(a, reference.logprobs_of(prompt)) and torch.equal(a, b)
    # every first answer came as a claim-check on the cluster, every second from its cache
    assert stats["claims_resolved"] == 100 and stats["claims_missed"] == 0, stats
    # resolved on the reply thread, from the cluster's masters (the loop's pipes read none)
    assert thread is not None and thread.slots is not None and thread.redirects == 0
    assert nodes is not None and nodes.answered == 0 and nodes.refusals == 0
    assert stats["cache_hits"] == 100 and stats["sent"] == 100, stats


@pytest.mark.cluster
async def test_a_worker_recreates_the_group_a_promoted_replica_lacks(cluster_url, smol_tokenizer):
    backend = MockAsyncLM(smol_tokenizer)
    served = ThreadedWorker(backend, cluster_url, model="mock").start()
    try:
        async with await QueueLM.connect("mock", redis_url=cluster_url, timeout_s=20) as lm:
            assert torch.equal(await lm.next_token_logprobs([1, 2]), backend.logprobs_of([1, 2]))
            # what a replica promoted before the group's creation reached it looks like
            destroyed = await lm.channel.redis.xgroup_destroy(KEYS.requests("mock"), WORKER_GROUP)
            results = await asyncio.gather(*(lm.next_token_logprobs([3, i]) for i in range(20)))
    finally:
        served.stop()
    assert destroyed == 1
    for i, result in enumerate(results):
        assert torch.equal(result, backend.logprobs_of([3, i]))


@pytest.mark.cluster
async def test_the_slot_pipe_follows_its_key_through_ask_and_moved(redis_cluster, cluster_url):
    key = KEYS.replies("slot-pipe-test")
    client = await connect_async_redis(cluster_url)
    pipe = SlotPipe(client, key, cluster_url)
    slot = redis_cluster.slot_of(key)
    source = redis_cluster.port_of_slot(slot)
    target = next(p for p in redis_cluster.master_ports() if p != source)
    nodes = {p: redis.Redis(host="127.0.0.1", port=p) for p in (source, target)}
    ids = {p: redis_cluster.node_id(p) for p in (source, target)}
    try:
        await client.xadd(key, {b"f": b"1"})
        assert len((await pipe.execute(("XRANGE", key, "-", "+")))[0]) == 1
        # migrating: the key has left the source, which answers ASK until the slot is handed over
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        nodes[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", key)
        (rows,) = await pipe.execute(("XRANGE", key, "-", "+"))
        assert len(rows) == 1 and pipe.redirects == 1
        for port in redis_cluster.master_ports():
            with redis.Redis(host="127.0.0.1", port=port) as node:
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        # handed over: the source answers MOVED, and the pipe stays on the target from then on
        (rows,) = await pipe.execute(("XRANGE", key, "-", "+"))
        assert len(rows) == 1 and pipe.redirects == 2
        (rows,) = await pipe.execute(("XRANGE", key, "-", "+"))
        assert len(rows) == 1 and pipe.redirects == 2
        assert pipe.pipe.options["port"] == target
    finally:
        pipe.close()
        for node in nodes.values():
            node.close()
        await client.aclose()
