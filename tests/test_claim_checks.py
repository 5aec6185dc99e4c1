"""Claim-checks: results the worker cached travel as cache keys, and every miss still ends once.

The worker and the client share one event loop here (the worker serves as a task), against
real redis-servers: the session's queue instance and, where a test says so, a separate cache
instance of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lmqueue.devstack import LocalRedis
from lmqueue.producer import QueueLM
from lmqueue.producer import submitter as submitter_module
from lmqueue.producer.claims import ClaimResolver
from lmqueue.shared.connections import async_redis
from lmqueue.shared.errors import MalformedMessage
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.settings import RedisSettings, WorkerSettings
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import (
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_claim,
    encode_request,
    ids_to_bytes,
)
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.worker import Worker

KEYS = KeySpace()
PROMPTS = [[5, 6, n] for n in range(40)]


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
def cache_server() -> Iterator[LocalRedis]:
    """A separate cache instance, as ops/redis/cache.conf runs it."""
    with LocalRedis(maxmemory="64mb", policy="allkeys-lru") as server:
        yield server


@contextlib.asynccontextmanager
async def serving(backend: Any, redis_url: str, cache_url: str | None = None) -> AsyncIterator:
    """A worker serving from a task of this loop, with its cache on `cache_url` if given."""
    settings = WorkerSettings(
        model="mock", backend="mock", name="claims-worker",
        redis=RedisSettings(url=redis_url, cache_url=cache_url, stall_timeout_s=2),
    )  # fmt: skip
    redis = async_redis(redis_url)
    cache_redis = async_redis(cache_url) if cache_url else None
    worker = Worker(settings, backend, redis, cache_redis)
    await worker.publish()
    stop = asyncio.Event()
    task = asyncio.create_task(worker.serve(stop))
    try:
        yield worker
    finally:
        stop.set()
        await task
        await redis.aclose()
        if cache_redis is not None:
            await cache_redis.aclose()


async def _answers(lm: QueueLM, backend: Any) -> None:
    """Every prompt's result, bit for bit the backend's own."""
    out = await lm.batch_next_token_logprobs(PROMPTS)
    assert torch.equal(out, torch.stack([backend.logprobs_of(p) for p in PROMPTS]))


#: What the queue instance receives when every vector goes through it, at least.
INLINE_BYTES = len(PROMPTS) * 49152 * 4


async def _bytes_received(redis_url: str) -> int:
    """Bytes the Redis at `redis_url` has received from all clients so far."""
    redis = async_redis(redis_url)
    try:
        return int((await redis.info("stats"))["total_net_input_bytes"])
    finally:
        await redis.aclose()


async def test_cached_results_travel_as_claim_checks_on_one_instance(backend, redis_url):
    async with serving(backend, redis_url) as worker:
        lm = await QueueLM.connect("mock", redis_url=redis_url, use_shared_cache=False)
        async with lm:
            await _answers(lm, backend)
            assert lm.stats["claims_resolved"] == len(PROMPTS)
            assert lm.stats["claims_missed"] == 0 and lm.stats["sent"] == len(PROMPTS)
    assert worker.answered == len(PROMPTS)


async def test_claims_are_read_from_a_separate_cache_instance(backend, redis_url, cache_server):
    async with serving(backend, redis_url, cache_server.url):
        lm = await QueueLM.connect(
            "mock", redis=RedisSettings(url=redis_url, cache_url=cache_server.url)
        )
        async with lm:
            before = await _bytes_received(redis_url)
            await _answers(lm, backend)
            queue_bytes = await _bytes_received(redis_url) - before
            assert lm.stats["claims_resolved"] == len(PROMPTS)
    # the queue carried headers only: every vector went through the cache instance
    assert queue_bytes < INLINE_BYTES / 20


async def test_float16_claims_resolve_to_float32_tensors(backend, redis_url):
    async with serving(backend, redis_url):
        async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype="float16") as lm:
            out = await lm.next_token_logprobs([9, 9, 9])
            assert lm.stats["claims_resolved"] == 1
    half = backend.logprobs_of([9, 9, 9]).numpy().astype(np.float16).astype(np.float32)
    assert out.dtype == torch.float32 and np.array_equal(out.numpy(), half)


async def test_float16_claims_stay_float16_with_half_results(backend, redis_url):
    async with serving(backend, redis_url):
        async with await QueueLM.connect(
            "mock", redis_url=redis_url, wire_dtype="float16", half_results=True
        ) as lm:
            out = await lm.next_token_logprobs([9, 9, 8])
            assert lm.stats["claims_resolved"] == 1
            lm.channel.reader.pipe = lm.channel.claims.pipe = lm.channel.reader.thread = None
            through_redis_py = await lm.next_token_logprobs([9, 9, 7])  # rediss:// URLs' path
            assert lm.stats["claims_resolved"] == 2
    for tensor, prompt in ((out, [9, 9, 8]), (through_redis_py, [9, 9, 7])):
        half = backend.logprobs_of(prompt).numpy().astype(np.float16)
        assert tensor.dtype == torch.float16 and np.array_equal(tensor.numpy(), half)


class _Evicting:
    """Cache clients whose keys are evicted between the worker's SET and the client's GET."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def mget(self, keys: list[str]) -> list[bytes | None]:  # as redis-py
        await self.inner.delete(*keys)
        return list(await self.inner.mget(keys))

    async def execute(self, *commands: tuple[Any, ...]) -> list[Any]:  # as RespPipe
        (_, *keys), *_ = commands
        await self.inner.execute(("DEL", *keys))
        return await self.inner.execute(*commands)


class _EvictingSocket(_Evicting):
    """The reply thread's cache connection, its keys evicted before each MGET."""

    def execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:  # type: ignore[override]
        (_, *keys), *_ = commands
        self.inner.execute([("DEL", *keys)])
        return list(self.inner.execute(commands))

    def interrupt(self) -> None:
        self.inner.interrupt()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def sent_requests(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every request the clients of this test encode for a request stream, in order."""
    sent: list[Any] = []

    def recording(request: Any) -> dict[str, bytes]:
        sent.append(request)
        return encode_request(request)

    monkeypatch.setattr(submitter_module, "encode_request", recording)
    return sent


async def test_a_client_says_which_requests_it_looked_up_in_the_shared_cache(
    backend, redis_url, sent_requests
):
    async with serving(backend, redis_url):
        async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=10) as lm:
            await lm.next_token_logprobs([3, 1, 4])
        async with await QueueLM.connect(
            "mock", redis_url=redis_url, timeout_s=10, use_shared_cache=False
        ) as lm:
            await lm.next_token_logprobs([3, 1, 5])
    assert [(r.token_bytes, r.looked) for r in sent_requests] == [
        (ids_to_bytes([3, 1, 4]), True), (ids_to_bytes([3, 1, 5]), False)
    ]  # fmt: skip


@pytest.mark.parametrize("path", ["thread", "pipe", "redis-py"])
async def test_an_evicted_claim_is_asked_again_inline_and_ends_once(
    backend, redis_url, path, sent_requests
):
    async with serving(backend, redis_url) as worker:
        async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=10) as lm:
            thread = lm.channel.reader.thread
            assert thread is not None and thread.cache is not None
            if path == "thread":
                thread.cache = _EvictingSocket(thread.cache)  # type: ignore[assignment]
            else:
                lm.channel.reader.thread = None  # read on the event loop
            if path == "pipe":
                lm.channel.claims.pipe = _Evicting(lm.channel.claims.pipe)
            elif path == "redis-py":
                claims = lm.channel.claims
                claims.pipe, claims.redis = None, _Evicting(claims.redis)
            await _answers(lm, backend)
            stats = lm.stats
    assert stats["claims_missed"] == len(PROMPTS) and stats["claims_resolved"] == 0
    assert stats["sent"] == 2 * len(PROMPTS) and stats["duplicate_replies"] == 0
    assert stats["inflight"] == 0 and worker.answered == 2 * len(PROMPTS)
    # asked again without looking in the shared cache first, nor saying it looked
    assert [(r.claims, r.looked) for r in sent_requests] == (
        [(True, True)] * len(PROMPTS) + [(False, False)] * len(PROMPTS)
    )


async def test_a_client_on_another_cache_than_the_workers_still_gets_every_result(
    backend, redis_url, cache_server
):
    async with serving(backend, redis_url, cache_server.url):
        # told to look for cached results in the queue instance, where there are none
        lm = await QueueLM.connect("mock", redis_url=redis_url, cache_url=redis_url, timeout_s=10)
        async with lm:
            await _answers(lm, backend)
            assert lm.stats["claims_missed"] == len(PROMPTS)


async def test_a_client_given_only_the_queue_url_finds_the_workers_cache_in_the_registry(
    backend, redis_url, cache_server
):
    async with serving(backend, redis_url, cache_server.url) as worker:
        async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=10) as lm:
            assert lm.info.cache_address == cache_server.url
            await _answers(lm, backend)
            stats = lm.stats
    assert stats["claims_resolved"] == len(PROMPTS) and stats["claims_missed"] == 0
    assert worker.answered == len(PROMPTS)


async def test_a_failed_cache_write_sends_the_results_inline(backend, redis_url):
    with LocalRedis(maxmemory="1mb", policy="noeviction") as full:  # refuses 192 KB values
        async with serving(backend, redis_url, full.url):
            lm = await QueueLM.connect(
                "mock", redis=RedisSettings(url=redis_url, cache_url=full.url),
                use_shared_cache=False,
            )  # fmt: skip
            async with lm:
                before = await _bytes_received(redis_url)
                await _answers(lm, backend)
                queue_bytes = await _bytes_received(redis_url) - before
                assert lm.stats["claims_resolved"] == lm.stats["claims_missed"] == 0
    assert queue_bytes > INLINE_BYTES


async def test_an_unreachable_cache_sends_the_results_inline(backend, redis_url):
    with LocalRedis() as gone:
        url = gone.url
    async with serving(backend, redis_url, url):
        lm = await QueueLM.connect(
            "mock", redis=RedisSettings(url=redis_url, cache_url=url), use_shared_cache=False
        )
        async with lm:
            await _answers(lm, backend)
            assert lm.stats["claims_resolved"] == lm.stats["claims_missed"] == 0


async def test_requests_that_do_not_ask_for_claims_get_inline_replies(backend, redis_url):
    async with serving(backend, redis_url):
        async with await QueueLM.connect("mock", redis_url=redis_url) as lm:
            lm.channel.claims._paused_until = float("inf")  # as after many misses
            await _answers(lm, backend)
            assert lm.stats["claims_resolved"] == lm.stats["claims_missed"] == 0


class _Empty:
    async def mget(self, keys: list[str]) -> list[None]:
        return [None] * len(keys)


async def test_claims_pause_when_most_of_them_miss():
    resolver = ClaimResolver(_Empty())
    claims = [Reply(f"c:{n}", claim=f"k{n}") for n in range(64)]
    found, missed = await resolver.fetch(claims)
    assert not found and len(missed) == 64
    assert not resolver.enabled


def test_a_claim_check_reply_names_its_key_and_carries_no_vector():
    fields = {k.encode(): v for k, v in encode_claim("c:1", "lmq:k", "float16").items()}
    reply = decode_reply(fields)
    assert reply.ok and reply.claim == "lmq:k" and reply.payload is None
    assert reply.dtype == "float16" and b"d" not in fields
    with pytest.raises(MalformedMessage, match="claim-check"):
        reply.vector()


def test_a_claim_check_with_a_payload_too_is_malformed():
    fields = {k.encode(): v for k, v in encode_claim("c:1", "lmq:k", "float32").items()}
    with pytest.raises(MalformedMessage) as caught:
        decode_reply({**fields, b"d": b"\x00" * 4})
    assert caught.value.data["request_id"] == "c:1"


@pytest.mark.parametrize("claims", [True, False])
def test_requests_say_whether_they_resolve_claims(claims):
    request = Request("c:1", "c", ids_to_bytes([1, 2]), claims=claims)
    envelope = encode_request(request)
    assert decode_request({b"m": envelope["m"]}) == request
    assert (b"claims" in envelope["m"]) == claims  # requests without it look as before


async def test_without_resp_pipes_replies_and_claims_go_through_redis_py(backend, redis_url):
    """The path of rediss:// URLs, which `RespPipe` does not speak."""
    async with serving(backend, redis_url):
        async with await QueueLM.connect("mock", redis_url=redis_url) as lm:
            lm.channel.reader.pipe = lm.channel.claims.pipe = lm.channel.reader.thread = None
            await _answers(lm, backend)
            assert lm.stats["claims_resolved"] == len(PROMPTS)
        async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype="float16") as lm:
            lm.channel.reader.pipe = lm.channel.claims.pipe = lm.channel.reader.thread = None
            out = await lm.next_token_logprobs([3, 3, 3])
    half = backend.logprobs_of([3, 3, 3]).numpy().astype(np.float16).astype(np.float32)
    assert np.array_equal(out.numpy(), half)


async def test_a_refused_entry_in_the_replies_pipeline_pauses_claims(
    backend, redis_url, monkeypatch
):
    """On one instance the cache entry and its claim-check go out together; if Redis refuses
    the entry alone (an ACL, say), its client asks again inline and the worker stops claiming."""

    def refused(items: Any, ttl_s: int) -> list[tuple[Any, ...]]:
        return [("SET", key) for key, _ in items]  # wrong arity: an error for the entry only

    async with serving(backend, redis_url) as worker:
        monkeypatch.setattr(SharedCache, "set_commands", staticmethod(refused))
        async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=10) as lm:
            await _answers(lm, backend)
            missed = lm.stats["claims_missed"]
            assert 0 < missed <= len(PROMPTS) and worker.writer.claims_paused_until > 0
            lm.clear_cache()
            await _answers(lm, backend)  # paused: inline from the start
            assert lm.stats["claims_missed"] == missed and lm.stats["claims_resolved"] == 0
            assert lm.stats["duplicate_replies"] == 0
