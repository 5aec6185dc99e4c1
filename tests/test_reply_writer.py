"""ReplyWriter: a batch's writes on the writer thread, the same as through redis-py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis

from lmqueue.producer.reply_batch import ReplyBatch, decode_entries
from lmqueue.shared.connections import async_redis, connect_async_redis
from lmqueue.shared.errors import MalformedMessage
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import MAX_PACKED, decode_packed, decode_reply
from lmqueue.workers.outcome import Outcome
from lmqueue.workers.reply_writer import REPLY_PART_BYTES, ReplyWriter
from lmqueue.workers.request_stream import RequestStream
from lmqueue.workers.writer_thread import WriterThread

KEYS = KeySpace()
VECTOR = np.random.default_rng(2).standard_normal(49_152).astype(np.float32)


def _settings(url: str) -> WorkerSettings:
    return WorkerSettings(model="mock", backend="mock", name="w", redis=RedisSettings(url=url))


async def _pending_entries(client: Any, stream: RequestStream, count: int) -> list[Any]:
    """`count` request entries, delivered to the worker's consumer and not acknowledged."""
    await stream.ensure_group()
    for n in range(count):
        await client.xadd(stream.stream, {b"m": b"request %d" % n})
    return await stream.read_new(count, None)


def _outcome(entries: list[Any], cache: SharedCache) -> Outcome:
    outcome = Outcome(acks=[entry.entry_id for entry in entries])
    payload = VECTOR.data.cast("B")
    for n in range(3):  # fresh results that may travel as claim-checks
        key = cache.key("float32", b"%d" % n)
        outcome.cache_puts.append((key, payload))
        outcome.claimable_result("client-a" if n else "client-b", f"r:{n}", payload, "float32", key)
    outcome.result("client-b", "r:9", payload, "float32", cached=True)
    outcome.error("client-a", "r:10", MalformedMessage("bad"))
    outcome.dead_letter(entries[0], MalformedMessage("nobody to tell"))
    return outcome


@contextlib.asynccontextmanager
async def _writer_on(
    redis_url: str, path: str
) -> AsyncIterator[tuple[Any, ReplyWriter, WriterThread]]:
    """A writer with a shared cache on the queue's instance, writing on its thread or (path
    ``redis-py``) through redis-py; a blocking client to look with; the thread."""
    client = async_redis(redis_url)
    sync = redis.Redis.from_url(redis_url)
    thread = WriterThread()
    try:
        stream = RequestStream(client, KEYS.requests("mock"), "w")
        cache = SharedCache(client, KEYS, "mock", "r1")
        writer = ReplyWriter(client, stream, KEYS, _settings(redis_url), cache, thread=thread)
        assert writer.thread is thread
        if path == "redis-py":
            writer.thread = None
        yield sync, writer, thread
    finally:
        await thread.aclose()
        await client.aclose()
        sync.close()


async def _batch_of(writer: ReplyWriter) -> Outcome:
    assert writer.cache is not None
    return _outcome(await _pending_entries(writer.redis, writer.stream, 4), writer.cache)


@pytest.mark.parametrize("path", ["thread", "redis-py"])
async def test_a_batch_is_written_whole_on_either_path(redis_url: str, path: str) -> None:
    async with _writer_on(redis_url, path) as (sync, writer, thread):
        stream = writer.stream
        await writer.flush(await _batch_of(writer))
        jobs = thread.jobs
        replies = {
            c: [decode_reply(fields) for _, fields in sync.xrange(KEYS.replies(c))]
            for c in ("client-a", "client-b")
        }
        dead = sync.xrange(KEYS.dead_letters("mock"))
        ttl = sync.ttl(KEYS.replies("client-a"))
        pending, left = sync.xpending(stream.stream, "workers")["pending"], sync.xlen(stream.stream)
    by_id = {r.request_id: r for rs in replies.values() for r in rs}
    assert sorted(by_id) == ["r:0", "r:1", "r:10", "r:2", "r:9"]
    assert all(by_id[f"r:{n}"].claim for n in range(3))  # their entries were stored first
    assert np.array_equal(by_id["r:9"].vector(), VECTOR) and by_id["r:9"].cached
    assert isinstance(by_id["r:10"].error, MalformedMessage)
    assert len(dead) == 1 and dead[0][1][b"lmq.reason"].startswith(b"MalformedMessage")
    assert 0 < ttl <= 600 and pending == 0 and left == 0
    assert jobs == (1 if path == "thread" else 0)


@pytest.mark.parametrize("path", ["thread", "redis-py"])
async def test_a_batch_read_from_several_streams_is_acknowledged_on_each_of_them(
    redis_url: str, path: str
) -> None:
    """A tenant's partitions answered as one batch: each entry is acknowledged and deleted on
    the stream it was read from, and an entry of the same id on another stream is not."""
    async with _writer_on(redis_url, path) as (sync, writer, _):
        streams = [RequestStream(writer.redis, KEYS.requests("mock", p), "w") for p in (0, 1)]
        for stream, ids in zip(streams, (["1-1", "1-2"], ["1-1", "1-3"]), strict=True):
            await stream.ensure_group()
            for entry_id in ids:
                await writer.redis.xadd(stream.stream, {b"m": b"x"}, id=entry_id)
            assert len(await stream.read_new(10, None)) == 2
        outcome = Outcome(acks=["1-1", "1-2", "1-3"])
        outcome.acks_by_stream = {streams[0].stream: ["1-1", "1-2"], streams[1].stream: ["1-3"]}
        outcome.result("client-a", "r:1", VECTOR.data.cast("B"), "float32", cached=False)
        await writer.flush(outcome)
        left = [sync.xrange(stream.stream) for stream in streams]
        pending = [sync.xpending(stream.stream, "workers")["pending"] for stream in streams]
        replies = sync.xlen(KEYS.replies("client-a"))
    assert left[0] == [] and [entry_id for entry_id, _ in left[1]] == [b"1-1"]
    assert pending == [0, 1] and replies == 1


@pytest.mark.parametrize("path", ["thread", "redis-py"])
async def test_a_packing_clients_claims_and_errors_travel_in_one_entry(
    redis_url: str, path: str
) -> None:
    """client-a reads packed entries: its two claim-checks and its error are one entry; the
    other client's replies, and results with a vector, stay an entry each."""
    async with _writer_on(redis_url, path) as (sync, writer, _):
        outcome = await _batch_of(writer)
        outcome.packing.add("client-a")
        outcome.result("client-a", "r:11", VECTOR.data.cast("B"), "float32", cached=True)
        await writer.flush(outcome)
        entries = {c: sync.xrange(KEYS.replies(c)) for c in ("client-a", "client-b")}
    assert sorted(sorted(fields) for _, fields in entries["client-a"]) == [[b"d", b"h"], [b"p"]]
    assert sorted(sorted(fields) for _, fields in entries["client-b"]) == [[b"d", b"h"], [b"h"]]
    batch = decode_entries(entries["client-a"], ReplyBatch())
    assert batch.read == 4 and not batch.malformed
    assert sorted(r.request_id for r in batch.claims) == ["r:1", "r:2"]
    assert all(r.claim and r.payload is None for r in batch.claims)
    ready = {r.request_id: r for r in batch.ready}
    assert isinstance(ready["r:10"].error, MalformedMessage)
    assert np.array_equal(ready["r:11"].vector(), VECTOR)


async def _blocked_read(client: Any, reader: Any, key: str) -> asyncio.Task[Any]:
    """`reader`'s XREAD of the entries added to `key` from now, once it is blocked on it."""
    read = asyncio.create_task(reader.xread({key: "$"}, block=5000))
    while not any(c.get("cmd") == "xread" for c in await client.client_list()):
        await asyncio.sleep(0.01)
    return read


async def test_a_blocked_reader_wakes_once_with_all_of_its_clients_replies(redis_url: str) -> None:
    """A client's replies of one batch are one transaction: its reader, blocked on its
    stream, gets all of them in one read (in a plain pipeline it woke after the first)."""
    client, reader = async_redis(redis_url), async_redis(redis_url)
    thread = WriterThread()
    key = KEYS.replies("client-c")
    try:
        stream = RequestStream(client, KEYS.requests("mock"), "w")
        writer = ReplyWriter(client, stream, KEYS, _settings(redis_url), None, thread=thread)
        entries = await _pending_entries(client, stream, 4)
        outcome = Outcome(acks=[entry.entry_id for entry in entries])
        for n in range(4):
            outcome.result("client-c", f"r:{n}", VECTOR.data.cast("B"), "float32", cached=True)
        outcome.result("client-d", "r:9", VECTOR.data.cast("B"), "float32", cached=True)
        read = await _blocked_read(client, reader, key)
        await writer.flush(outcome)
        got = await read
        written = await client.xlen(key)
    finally:
        await thread.aclose()
        await client.aclose()
        await reader.aclose()
    assert written == 4
    read_ids = [decode_reply(fields).request_id for _, fields in got[0][1]]
    assert read_ids == [f"r:{n}" for n in range(4)]


async def test_a_large_batch_is_written_in_parts_the_client_reads_the_first_meanwhile(
    redis_url: str,
) -> None:
    """30 fresh float32 results (5.9 MB): a blocked reader wakes with the first part's
    claim-checks (about `REPLY_PART_BYTES`), before the rest is written; every entry is
    acknowledged once all are written."""
    client, reader = async_redis(redis_url), async_redis(redis_url)
    thread = WriterThread()
    key = KEYS.replies("client-e")
    try:
        stream = RequestStream(client, KEYS.requests("mock"), "w")
        cache = SharedCache(client, KEYS, "mock", "r1")
        writer = ReplyWriter(client, stream, KEYS, _settings(redis_url), cache, thread=thread)
        entries = await _pending_entries(client, stream, 30)
        outcome = Outcome(acks=[entry.entry_id for entry in entries])
        for n in range(30):
            payload = (VECTOR + n).data.cast("B")
            cache_key = cache.key("float32", b"part %d" % n)
            outcome.cache_puts.append((cache_key, payload))
            outcome.claimable_result("client-e", f"r:{n}", payload, "float32", cache_key)
        read = await _blocked_read(client, reader, key)
        await writer.flush(outcome)
        got = await read
        rows = await client.xrange(key)
        pending = (await client.xpending(stream.stream, "workers"))["pending"]
        stored = await client.mget([cache.key("float32", b"part %d" % n) for n in range(30)])
    finally:
        await thread.aclose()
        await client.aclose()
        await reader.aclose()
    first = [decode_reply(fields).request_id for _, fields in got[0][1]]
    per_part = -(-REPLY_PART_BYTES // VECTOR.nbytes)  # results until the budget is reached
    assert first == [f"r:{n}" for n in range(per_part)]  # the first part alone
    replies = [decode_reply(fields) for _, fields in rows]
    assert [r.request_id for r in replies] == [f"r:{n}" for n in range(30)]
    assert all(r.claim for r in replies) and pending == 0
    assert all(np.array_equal(np.frombuffer(v, "<f4"), VECTOR + n) for n, v in enumerate(stored))


def test_a_leading_part_keeps_the_results_of_one_key_together() -> None:
    payload = VECTOR.data.cast("B")  # 196,608 bytes
    outcome = Outcome()
    for n, key in enumerate(["k0", "k1", "k0", "k2", "k3"]):  # r:2 shares r:0's prompt
        if key not in dict(outcome.cache_puts):
            outcome.cache_puts.append((key, payload))
        outcome.claimable_result("c", f"r:{n}", payload, "float32", key)
    assert outcome.leading_part(4 * VECTOR.nbytes) is None  # all of it: no part
    part = outcome.leading_part(2 * VECTOR.nbytes)
    assert part is not None
    assert [i.request_id for i in part.claimable] == ["r:0", "r:1", "r:2"]
    assert [key for key, _ in part.cache_puts] == ["k0", "k1"]
    outcome.drop({"k0", "k1"})
    assert [i.request_id for i in outcome.claimable] == ["r:3", "r:4"]
    assert [key for key, _ in outcome.cache_puts] == ["k2", "k3"]
    assert outcome.outcomes["ok"] == 5  # the batch's metrics still count every result
    assert outcome.leading_part(2 * VECTOR.nbytes) is None


@pytest.mark.cluster
async def test_a_slot_moved_under_the_writer_thread_is_written_through_redis_py(
    redis_cluster: Any, cluster_url: str
) -> None:
    """redis-py's slot map still names the old master: the thread meets MOVED there, and the
    batch goes through redis-py, which follows it; the next batch is routed by the new map."""
    client = await connect_async_redis(cluster_url)
    thread = WriterThread()
    reply_key = KEYS.replies("moved-client")
    try:
        stream = RequestStream(client, KEYS.requests("mock"), "w")
        writer = ReplyWriter(client, stream, KEYS, _settings(cluster_url), None, thread=thread)
        assert writer.thread is thread
        slot = redis_cluster.slot_of(reply_key)
        target = next(
            p for p in redis_cluster.master_ports() if p != redis_cluster.port_of_slot(slot)
        )
        redis_cluster.migrate_slot(slot, target)  # behind redis-py's back
        outcome = Outcome()
        outcome.result("moved-client", "m:1", VECTOR.data.cast("B"), "float32", cached=False)
        await writer.flush(outcome)
        assert writer.redirected == 1 and await client.xlen(reply_key) == 1
        # the next batch goes on the thread again, to the new master: its map taken afresh
        again = Outcome()
        again.result("moved-client", "m:2", VECTOR.data.cast("B"), "float32", cached=False)
        await writer.flush(again)
        rows = await client.xrange(reply_key)
    finally:
        await thread.aclose()
        await client.aclose()
    assert writer.redirected == 1 and len(rows) == 2
    assert np.array_equal(decode_reply(rows[1][1]).vector(), VECTOR)


def test_reply_entries_pack_up_to_the_bound_per_client_and_keep_the_rest() -> None:
    outcome = Outcome()
    for n in range(MAX_PACKED + 2):
        outcome.error("client-a", f"a:{n}", MalformedMessage("bad"))
        outcome.error("client-b", f"b:{n}", MalformedMessage("bad"))
    outcome.result("client-a", "a:x", VECTOR.data.cast("B"), "float32", cached=True)
    assert outcome.reply_entries() is outcome.replies  # nobody packs
    outcome.packing.add("client-a")
    entries = outcome.reply_entries()
    packed = [fields for client, fields in entries if client == "client-a" and "p" in fields]
    assert [len(decode_packed(_read(fields))) for fields in packed] == [MAX_PACKED, 2]
    assert sum(client == "client-b" for client, _ in entries) == MAX_PACKED + 2
    assert [fields for client, fields in entries if client == "client-a" and "d" in fields]
    ids = [r.request_id for fields in packed for r in decode_packed(_read(fields))]
    assert ids == [f"a:{n}" for n in range(MAX_PACKED + 2)]


def _read(fields: dict[str, Any]) -> dict[bytes, Any]:
    return {name.encode(): value for name, value in fields.items()}
