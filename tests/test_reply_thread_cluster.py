"""The client's reply thread on a Redis Cluster: the reply stream's master and the claims'
masters reached from a snapshot of the slot map, redirections and a stale map survived.

Every test runs on the session cluster (real redis-server processes) and moves slots the way
a resharding does (``CLUSTER SETSLOT``); a slot moved is left where a resharding leaves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from lmqueue.producer.claims import ClaimResolver
from lmqueue.producer.inflight import InflightTable
from lmqueue.producer.reply_reader import ReplyReader
from lmqueue.producer.reply_thread import ReplyRedirected, ReplyThread
from lmqueue.producer.slot_pipe import SlotPipe
from lmqueue.shared.cluster_targets import SlotTargets
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.wire import encode_claim

pytestmark = pytest.mark.cluster

KEYS = KeySpace()
SIZE = 16  # values a claimed vector holds


@pytest.fixture
async def client(cluster_url: str) -> AsyncIterator[Any]:
    """An asyncio cluster client of the flushed session cluster."""
    cluster = await connect_async_redis(cluster_url)
    yield cluster
    await cluster.aclose()


@pytest.fixture
def threads() -> Iterator[list[ReplyThread]]:
    """Reply threads a test made, closed after it."""
    made: list[ReplyThread] = []
    yield made
    for thread in made:
        thread.close()


def _thread(client: Any, threads: list[ReplyThread]) -> ReplyThread:
    thread = ReplyThread(None, SlotTargets(client), ClaimResolver(client, 5.0, vector_size=SIZE))
    threads.append(thread)
    return thread


def _vector(i: int) -> bytes:
    return np.arange(i, i + SIZE, dtype="<f4").tobytes()


async def _claims(client: Any, stream: str, keys: list[str]) -> None:
    """Store a vector under each of `keys` and add a claim-check for it to `stream`."""
    for i, key in enumerate(keys):
        await client.set(key, _vector(i))
        await client.xadd(stream, encode_claim(f"r{i}", key, "float32"))


def _keys_on_every_master(cluster: Any, count: int) -> list[str]:
    keys = [f"rt-claim:{i}" for i in range(count)]
    assert len({cluster.port_of_slot(cluster.slot_of(k)) for k in keys}) == 3
    return keys


def _move_slot(cluster: Any, slot: int, to_port: int) -> None:
    """Hand an empty `slot` to the master on `to_port`, as the end of a resharding does."""
    node_id = cluster.node_id(to_port)
    for port in cluster.master_ports():
        with redis.Redis(host="127.0.0.1", port=port) as node:
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)


async def test_claims_come_from_every_master_and_a_moved_reply_stream_is_followed(
    redis_cluster, client, threads
):
    stream = KEYS.replies("rt-moved")
    home = redis_cluster.port_of_slot(redis_cluster.slot_of(stream))
    elsewhere = next(p for p in redis_cluster.master_ports() if p != home)
    keys = _keys_on_every_master(redis_cluster, 12)
    await _claims(client, stream, keys)
    thread = _thread(client, threads)
    assert thread.needs_aim
    # aimed at the wrong master: it answers MOVED, and the thread goes where it says
    batch = await thread.read(
        stream, "0-0", None, False, 100, 100, {"host": "127.0.0.1", "port": elsewhere}
    )
    assert [r.request_id for r in batch.ready] == [f"r{i}" for i in range(12)]
    for i, reply in enumerate(batch.ready):
        assert bytes(reply.payload) == _vector(i)
    assert batch.claims == [] and batch.missed == [] and batch.found == 12
    assert thread.redirects == 1 and not thread.needs_aim
    assert thread.replies is not None and thread.replies.target["port"] == home
    assert thread.slots is not None and thread.slots.taken == 1 and not thread.slots.stale
    await client.xadd(stream, encode_claim("r99", keys[0], "float32"))
    again = await thread.read(stream, batch.last_id or "", None, False, 100, 100)
    assert [r.request_id for r in again.ready] == ["r99"] and thread.redirects == 1


async def test_claims_on_a_slot_the_snapshot_misplaces_are_left_to_the_loop(
    redis_cluster, client, threads
):
    stream = KEYS.replies("rt-stale")
    keys = _keys_on_every_master(redis_cluster, 12)
    thread = _thread(client, threads)
    assert thread.slots is not None
    thread.slots.table()  # the snapshot, taken before the slot of keys[0] moves
    slot = redis_cluster.slot_of(keys[0])
    source = redis_cluster.port_of_slot(slot)
    _move_slot(redis_cluster, slot, next(p for p in redis_cluster.master_ports() if p != source))
    await _claims(client, stream, keys)  # redis-py follows the move and mends its own map
    home = redis_cluster.port_of_slot(redis_cluster.slot_of(stream))
    batch = await thread.read(stream, "0-0", None, False, 100, 100,
                              {"host": "127.0.0.1", "port": home})  # fmt: skip
    # the old master answered MOVED: that claim is left unresolved, the others are found
    assert [r.request_id for r in batch.claims] == ["r0"] and batch.missed == []
    assert sorted(r.request_id for r in batch.ready) == sorted(f"r{i}" for i in range(1, 12))
    assert thread.redirects == 1 and thread.slots.stale
    # the next read takes the map afresh (redis-py's, mended) and finds it on the new master
    await client.xadd(stream, encode_claim("again", keys[0], "float32"))
    again = await thread.read(stream, batch.last_id or "", None, False, 100, 100)
    assert [r.request_id for r in again.ready] == ["again"] and again.claims == []
    assert bytes(again.ready[0].payload) == _vector(0)
    assert thread.slots.taken == 2 and not thread.slots.stale


async def test_claims_on_a_master_that_cannot_be_reached_are_left_to_the_loop(
    redis_cluster, client, threads
):
    stream = KEYS.replies("rt-lost")
    keys = _keys_on_every_master(redis_cluster, 12)
    await _claims(client, stream, keys)
    thread = _thread(client, threads)
    assert thread.slots is not None
    table = thread.slots.table()
    lost = table[redis_cluster.slot_of(keys[0])]
    assert lost is not None
    lost["port"] = 1  # nothing listens there: refused, as a master that died
    home = redis_cluster.port_of_slot(redis_cluster.slot_of(stream))
    batch = await thread.read(stream, "0-0", None, False, 100, 100,
                              {"host": "127.0.0.1", "port": home})  # fmt: skip
    on_lost = {f"r{i}" for i, k in enumerate(keys)
               if table[redis_cluster.slot_of(k)] is lost}  # fmt: skip
    assert {r.request_id for r in batch.claims} == on_lost and batch.missed == []
    assert {r.request_id for r in batch.ready} == {f"r{i}" for i in range(12)} - on_lost
    assert thread.slots.stale


async def test_a_reply_stream_whose_slot_migrates_is_read_through_the_slot_pipe(
    redis_cluster, cluster_url, client, threads
):
    stream = KEYS.replies("rt-ask")
    slot = redis_cluster.slot_of(stream)
    source = redis_cluster.port_of_slot(slot)
    target = next(p for p in redis_cluster.master_ports() if p != source)
    ids = {p: redis_cluster.node_id(p) for p in (source, target)}
    await client.xadd(stream, encode_claim("r0", "rt-claim:0", "float32"))
    await client.set("rt-claim:0", _vector(0))
    thread = _thread(client, threads)
    pipe = SlotPipe(client, stream, cluster_url)
    reader = ReplyReader(client, stream, InflightTable("c"), on_restart=lambda: None,
                         pipe=pipe, thread=thread)  # fmt: skip
    nodes = {p: redis.Redis(host="127.0.0.1", port=p) for p in (source, target)}
    try:
        # migrating: the stream has left the source, which answers ASK for it
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        nodes[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", stream)
        with pytest.raises(ReplyRedirected):
            await thread.read(stream, "0-0", None, False, 100, 100,
                              {"host": "127.0.0.1", "port": source})  # fmt: skip
        assert thread.needs_aim and thread.redirects == 1
        batch = await reader._read()  # the thread is redirected again; the slot pipe follows
        assert [r.request_id for r in batch.claims] == ["r0"] and pipe.redirects == 1
    finally:
        for port in redis_cluster.master_ports():
            with redis.Redis(host="127.0.0.1", port=port) as node:
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        pipe.close()
        for node in nodes.values():
            node.close()
    # handed over: the thread is aimed from redis-py's map, follows the MOVED, and reads it
    batch = await reader._read()
    assert [r.request_id for r in batch.ready] == ["r0"] and not thread.needs_aim


async def test_a_snapshot_is_taken_again_once_redis_py_takes_a_new_map(client):
    """After a failover or a lost node redis-py reads the map afresh; a snapshot of the old one
    would keep sending a thread to a dead master (the writer thread did, in the fault runs)."""
    slots = SlotTargets(client)
    first = slots.table()
    assert slots.table() is first and slots.taken == 1
    await client.nodes_manager.initialize()  # what redis-py does after a node was lost
    assert slots.table() is not first and slots.taken == 2


async def test_float16_claims_on_every_master_arrive_widened(redis_cluster, client, threads):
    """Each master's GETs take the widener too: every vector exactly its float16 values."""
    stream = KEYS.replies("rt-half")
    keys = _keys_on_every_master(redis_cluster, 9)
    halves = [np.linspace(-i, i, SIZE, dtype=np.float16) for i in range(9)]
    for i, (key, half) in enumerate(zip(keys, halves, strict=True)):
        await client.set(key, half.tobytes())
        await client.xadd(stream, encode_claim(f"r{i}", key, "float16"))
    thread = _thread(client, threads)
    home = redis_cluster.port_of_slot(redis_cluster.slot_of(stream))
    batch = await thread.read(
        stream, "0-0", None, False, 100, 100, {"host": "127.0.0.1", "port": home}
    )
    assert [r.request_id for r in batch.ready] == [f"r{i}" for i in range(9)]
    for half, reply in zip(halves, batch.ready, strict=True):
        assert reply.dtype == "float32"
        assert bytes(reply.payload) == half.astype(np.float32).tobytes()
