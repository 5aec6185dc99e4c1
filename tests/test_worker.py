"""The worker against a real redis-server: replies, acks, cache, registry, dead letters."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from lmqueue.shared.keys import KeySpace
from lmqueue.shared.registry import ModelInfo, ModelRegistry, tokenizer_from_files
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.request_stream import Entry
from lmqueue.workers.worker import Worker, _estimated_tokens

KEYS = KeySpace()
MODEL = "mock"


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
def make_worker(aredis, redis_url, backend):
    def make(name: str = "w1", **settings) -> Worker:
        ws = WorkerSettings(
            model=MODEL, backend="mock", redis=RedisSettings(url=redis_url), name=name, **settings
        )
        return Worker(ws, backend, aredis)

    return make


async def _enqueue(aredis, tokens_list, client="c1", **fields):
    for n, tokens in enumerate(tokens_list):
        request = Request(f"{client}:{n}", client, ids_to_bytes(tokens), **fields)
        await aredis.xadd(KEYS.requests(MODEL), encode_request(request))


async def _replies(aredis, client="c1"):
    entries = await aredis.xrange(KEYS.replies(client))
    return {reply.request_id: reply for reply in (decode_reply(fields) for _, fields in entries)}


async def test_queued_requests_are_answered_acked_and_deleted(aredis, make_worker, backend):
    worker = make_worker()
    await worker.publish()
    await _enqueue(aredis, [[1, 2, n] for n in range(40)])
    assert await worker.run_until_idle() == 40
    replies = await _replies(aredis)
    assert len(replies) == 40
    np.testing.assert_array_equal(replies["c1:3"].vector(), backend.logprobs_of([1, 2, 3]))
    assert await aredis.xlen(KEYS.requests(MODEL)) == 0
    pending = await aredis.xpending(KEYS.requests(MODEL), "workers")
    assert pending["pending"] == 0
    assert 0 < await aredis.ttl(KEYS.replies("c1")) <= 600


async def test_results_are_written_to_the_shared_cache_with_a_ttl(aredis, make_worker, backend):
    worker = make_worker(cache_ttl_s=100)
    await worker.publish()
    await _enqueue(aredis, [[4, 5]], dtype="float16")
    await worker.run_until_idle()
    cache = SharedCache(aredis, KEYS, MODEL, backend.revision)
    key = cache.key("float16", ids_to_bytes([4, 5]))
    value = await aredis.get(key)
    assert value == backend.logprobs_of([4, 5]).numpy().astype("<f2").tobytes()
    assert 0 < await aredis.ttl(key) <= 100


async def test_a_cached_prompt_is_answered_without_the_backend(aredis, make_worker, backend):
    worker = make_worker()
    await worker.publish()
    await _enqueue(aredis, [[8, 8]])
    await worker.run_until_idle()
    batches = len(backend.batch_sizes)
    await _enqueue(aredis, [[8, 8]], client="c2")
    await worker.run_until_idle()
    assert len(backend.batch_sizes) == batches
    assert (await _replies(aredis, "c2"))["c2:0"].cached


async def test_a_request_its_client_looked_up_is_looked_up_again_only_if_this_worker_wrote_it(
    aredis, make_worker, backend
):
    worker = make_worker()
    await worker.publish()
    cache = SharedCache(aredis, KEYS, MODEL, backend.revision)
    # in the cache, but not written by this worker: a looked-up request is computed ...
    await aredis.set(cache.key("float32", ids_to_bytes([6, 6])), backend.logprobs_of([6, 6])
                     .numpy().astype("<f4").tobytes())  # fmt: skip
    await _enqueue(aredis, [[6, 6]], client="c1", looked=True)
    await worker.run_until_idle()
    assert not (await _replies(aredis, "c1"))["c1:0"].cached
    computed = len(backend.batch_sizes)
    # ... one not looked up is found there
    await _enqueue(aredis, [[6, 6]], client="c2")
    await worker.run_until_idle()
    assert (await _replies(aredis, "c2"))["c2:0"].cached and len(backend.batch_sizes) == computed
    # written by this worker since: a looked-up request finds it too
    await _enqueue(aredis, [[7, 7]], client="c3", looked=True)
    await worker.run_until_idle()
    await _enqueue(aredis, [[7, 7]], client="c4", looked=True)
    await worker.run_until_idle()
    assert not (await _replies(aredis, "c3"))["c3:0"].cached
    assert (await _replies(aredis, "c4"))["c4:0"].cached


async def test_the_model_is_published_for_clients(aredis, make_worker, smol_tokenizer):
    worker = make_worker()
    await worker.publish()
    registry = ModelRegistry(aredis, KEYS)
    info = await registry.info(MODEL)
    assert isinstance(info, ModelInfo) and info.vocab_size == 49152 and info.revision == "mock-v1"
    vocab = await registry.byte_vocab(MODEL)
    assert vocab[19556] == b"Hello"
    tokenizer = tokenizer_from_files(await registry.tokenizer_files(MODEL))
    assert tokenizer.encode("Hello, my name is") == smol_tokenizer.encode("Hello, my name is")
    assert await registry.live_workers(MODEL, within_s=60) == ["w1"]


async def test_anonymous_garbage_goes_to_the_dead_letter_stream(aredis, make_worker):
    worker = make_worker()
    await worker.publish()
    await aredis.xadd(KEYS.requests(MODEL), {"m": b"\x00garbage"})
    await _enqueue(aredis, [[1]])
    await worker.run_until_idle()
    dead = await aredis.xrange(KEYS.dead_letters(MODEL))
    assert len(dead) == 1 and dead[0][1][b"m"] == b"\x00garbage"
    assert dead[0][1][b"lmq.reason"].startswith(b"MalformedMessage")
    assert (await _replies(aredis))["c1:0"].ok
    assert await aredis.xlen(KEYS.requests(MODEL)) == 0


async def test_a_restarted_worker_first_answers_its_own_pending_entries(aredis, make_worker):
    worker = make_worker(name="stable")
    await worker.publish()
    await _enqueue(aredis, [[1, n] for n in range(5)])
    # a previous incarnation read them and died before acknowledging
    await aredis.xreadgroup("workers", "stable", {KEYS.requests(MODEL): ">"}, count=5)
    assert (await aredis.xpending(KEYS.requests(MODEL), "workers"))["pending"] == 5
    assert await make_worker(name="stable").run_until_idle() == 5
    assert len(await _replies(aredis)) == 5


async def test_the_worker_recreates_its_group_after_redis_lost_everything(aredis, make_worker):
    worker = make_worker(heartbeat_s=0.2)
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    await asyncio.sleep(0.3)
    await aredis.flushall()  # a restart without persistence
    await asyncio.sleep(0.8)  # the next read sees NOGROUP, the heartbeat re-publishes
    await _enqueue(aredis, [[3, 3]])
    for _ in range(100):
        if await aredis.exists(KEYS.replies("c1")):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await serving
    assert (await _replies(aredis))["c1:0"].ok
    assert await ModelRegistry(aredis, KEYS).is_published(MODEL)


async def test_a_stopped_worker_finishes_its_in_flight_batch(aredis, redis_url, smol_tokenizer):
    slow = MockAsyncLM(smol_tokenizer, batch_delay_s=0.5)
    settings = WorkerSettings(model=MODEL, backend="mock", redis=RedisSettings(url=redis_url))
    worker = Worker(settings, slow, aredis)
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.serve(stop))
    await asyncio.sleep(0.2)
    await _enqueue(aredis, [[1, n] for n in range(8)])
    await asyncio.sleep(0.2)  # read, now computing
    stop.set()
    await serving
    assert len(await _replies(aredis)) == 8
    assert await ModelRegistry(aredis, KEYS).live_workers(MODEL, within_s=60) == []


async def test_a_batch_longer_than_a_third_of_the_claim_timeout_keeps_its_entries_fresh(
    aredis, redis_url, smol_tokenizer
):
    slow = MockAsyncLM(smol_tokenizer, batch_delay_s=0.9)
    settings = WorkerSettings(
        model=MODEL, backend="mock", redis=RedisSettings(url=redis_url), claim_idle_ms=300
    )
    worker = Worker(settings, slow, aredis)
    await worker.publish()
    await _enqueue(aredis, [[2, n] for n in range(4)])
    answering = asyncio.create_task(worker.run_until_idle())
    idle_ms = []
    for _ in range(60):  # sampled while the 0.9 s forward runs: touched every 0.1 s
        await asyncio.sleep(0.02)
        rows = await aredis.xpending_range(KEYS.requests(MODEL), "workers", "-", "+", 10)
        if answering.done():
            break
        if rows:  # read, and not answered yet
            idle_ms.append(max(row["time_since_delivered"] for row in rows))
    assert await answering == 4
    assert len(idle_ms) >= 20, idle_ms  # it held them for most of the forward
    assert max(idle_ms) < 300, idle_ms  # never idle long enough for a janitor to take them
    pending = await aredis.xpending(KEYS.requests(MODEL), "workers")
    assert pending["pending"] == 0


async def test_the_dead_letter_reason_does_not_lose_the_original_fields(aredis, make_worker):
    worker = make_worker()
    await worker.publish()
    fields = {"m": msgpack.packb({"v": 1, "client": "bad id!"}), "extra": b"kept"}
    await aredis.xadd(KEYS.requests(MODEL), fields)
    await worker.run_until_idle()
    ((_, dead_fields),) = await aredis.xrange(KEYS.dead_letters(MODEL))
    assert dead_fields[b"extra"] == b"kept" and dead_fields[b"lmq.entry_id"]


@pytest.mark.parametrize("tokens", [1, 8, 70, 20_000])
def test_a_requests_token_estimate_is_its_prompt_whatever_its_optional_fields(tokens):
    """The fair share charges a request its prompt's tokens at pick time: optional fields
    (claims, packs, an adapter, a long client id) must not count as tokens."""
    ids = ids_to_bytes(list(range(tokens)))
    plain = Request("c:1", "c", ids)
    full = Request("c-" + "x" * 40 + ":123", "c-" + "x" * 40, ids, deadline_ms=1 << 41,
                   claims=True, adapter="tuned-1", packs=True)  # fmt: skip
    for request in (plain, full):
        entry = Entry("1-0", {b"m": encode_request(request)["m"]})
        assert _estimated_tokens(entry) == tokens


async def test_a_read_request_is_charged_its_prompts_tokens_and_a_malformed_one_its_estimate(
    aredis, make_worker
):
    """Read into the fair share, a decoded request is charged its prompt's tokens (decoded
    as read: `Entry.request`), one that does not decode its envelope's estimate."""
    worker = make_worker()
    await worker.publish()
    await _enqueue(aredis, [list(range(3)), list(range(70))])
    await aredis.xadd(KEYS.requests(MODEL), {b"m": b"x" * 300})
    try:
        await worker._read_into_scheduler(None)
    finally:
        await worker.lanes.reader.aclose()  # its connection of its own (`ReadConnection`)
    picks = worker.scheduler.pick(10)
    assert [pick.tokens for pick in picks] == [3, 70, 59]
    decoded = [entry._decoded for _, entry in (pick.item for pick in picks)]
    assert [type(d).__name__ for d in decoded] == ["Request", "Request", "MalformedMessage"]


def test_an_envelope_without_readable_tokens_is_estimated_by_its_size():
    assert _estimated_tokens(Entry("1-0", {b"m": b"x" * 300})) == 59
    assert _estimated_tokens(Entry("1-0", {b"m": b"\xa6tokens"})) == 1
    assert _estimated_tokens(Entry("1-0", {})) == 1
