"""Partitioned request streams: a lineage stays on its owner, idle workers steal, ownership
follows the live workers, and every tenant, quota and cluster path works with partitions."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from lmqueue.producer import QueueLM
from lmqueue.shared.connections import connect_async_redis, sync_redis
from lmqueue.shared.errors import SettingsError
from lmqueue.shared.keys import KeySpace
from lmqueue.shared.partitions import (
    LineageMemory,
    Partitioning,
    assign_partitions,
    block_partition,
    owned_partitions,
)
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.settings import ClientSettings, RedisSettings, WorkerSettings
from lmqueue.shared.tenants import TenantConfig
from lmqueue.shared.wire import Request, decode_reply, encode_request, ids_to_bytes
from lmqueue.tenant_admin import TenantAdmin
from lmqueue.workers.backends.mock import MockAsyncLM
from lmqueue.workers.worker import Worker
from workers_in_threads import ThreadedWorker

MODEL = "mock"
KEYS = KeySpace()


def _bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _prompt(tokens: Sequence[int]) -> PromptKey:
    return PromptKey.of_ids(tokens)


# -- choosing a partition (pure) ---------------------------------------------------------------
def test_every_continuation_of_a_prompt_goes_to_the_prompts_partition() -> None:
    rng = np.random.default_rng(1)
    partitioning = Partitioning(16, block_tokens=32)
    for _ in range(20):
        prompt = rng.integers(0, 49152, size=100).tolist()
        first = partitioning.of(_prompt(prompt))
        particles = [prompt + rng.integers(0, 49152, size=steps).tolist() for steps in range(1, 30)]
        assert {Partitioning(16).of(_prompt(p)) for p in particles} == {first}


def test_a_short_prompts_lineage_stays_together_through_the_clients_memory() -> None:
    partitioning = Partitioning(16, block_tokens=32)
    prompt = [5, 6, 7]  # shorter than the block: the stateless hash alone would hop
    chosen = {partitioning.of(_prompt(prompt))}
    lineage = list(prompt)
    for token in range(40):
        lineage.append(100 + token)
        chosen.add(partitioning.of(_prompt(lineage)))
    assert len(chosen) == 1
    stateless = {
        block_partition(_bytes(prompt + list(range(100, 100 + n))), 16, 32) for n in range(30)
    }
    assert len(stateless) > 1  # what the memory prevents


def test_different_prompts_spread_over_every_partition() -> None:
    rng = np.random.default_rng(2)
    partitioning = Partitioning(8)
    counts = Counter(partitioning.of(_prompt(rng.integers(0, 49152, size=40))) for _ in range(800))
    assert set(counts) == set(range(8))
    assert max(counts.values()) < 2 * min(counts.values())


def test_lineage_memory_is_bounded() -> None:
    memory = LineageMemory(capacity=10)
    for i in range(100):
        memory.remember(_bytes([i, i + 1]), i % 3)
    assert len(memory) == 10
    assert memory.ancestor(_bytes([99, 100, 7])) == 99 % 3
    assert memory.ancestor(_bytes([0, 1, 7])) is None  # evicted


def test_one_partition_means_the_one_stream_of_before() -> None:
    assert Partitioning(1).of(_prompt([1, 2, 3])) == 0
    assert KEYS.requests(MODEL) == "lmq:default:model:{mock}:requests"
    assert KEYS.requests(MODEL, 3) == "lmq:default:model:{mock:3}:requests"
    assert KEYS.quota_copies(MODEL, 1) == [KEYS.quota(MODEL)]
    assert KEYS.quota_copies(MODEL, 2) == [
        "lmq:default:model:{mock}:quota", "lmq:default:model:{mock:0}:quota",
        "lmq:default:model:{mock:1}:quota",
    ]  # fmt: skip


# -- owning partitions (pure) -------------------------------------------------------------------
def test_ownership_is_balanced_complete_and_the_same_from_every_worker() -> None:
    workers = ["gpu-a", "gpu-b", "gpu-c"]
    table = assign_partitions(workers, 16)
    assert Counter(table).most_common()[0][1] - min(Counter(table).values()) <= 1
    assert assign_partitions(list(reversed(workers)), 16) == table
    owned = [owned_partitions(w, workers, 16) for w in workers]
    assert sorted(p for parts in owned for p in parts) == list(range(16))


def test_a_joining_worker_takes_partitions_without_reshuffling_the_rest() -> None:
    before = assign_partitions([f"w{i}" for i in range(4)], 64)
    after = assign_partitions([f"w{i}" for i in range(5)], 64)
    moved = sum(b != a for b, a in zip(before, after, strict=True))
    assert Counter(after)["w4"] >= 12
    assert moved <= 64 // 2  # far from a full reshuffle (a modulo scheme moves ~80%)


# -- workers ------------------------------------------------------------------------------------
class RecordingMock(MockAsyncLM):
    """A mock that remembers every prompt it computed."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.seen: list[tuple[int, ...]] = []

    async def logprobs_batch(self, prompts: Any) -> list[Any]:
        self.seen.extend(tuple(int(t) for t in token_ids) for _, token_ids in prompts)
        return await super().logprobs_batch(prompts)


def _lineages(count: int, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, 40000, size=length).tolist() for _ in range(count)]


async def _until(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def _start(smol_tokenizer: Any, url: str, name: str, **settings: Any) -> ThreadedWorker:
    settings.setdefault("heartbeat_s", 2.0)  # ownership is stable while heartbeats are on time
    return ThreadedWorker(RecordingMock(smol_tokenizer), url, name=name, partitions=4,
                          **settings).start()  # fmt: skip


def _owned(thread: ThreadedWorker) -> frozenset[int]:
    assert thread.worker is not None
    return thread.worker.lanes.reader.owned


async def test_two_workers_each_answer_only_the_lineages_of_their_own_partitions(
    any_redis_url: str, smol_tokenizer: Any
) -> None:
    threads = [_start(smol_tokenizer, any_redis_url, n, steal_after_ms=60_000) for n in "ab"]
    try:
        await _until(lambda: not _owned(threads[0]) & _owned(threads[1]))
        assert _owned(threads[0]) | _owned(threads[1]) == frozenset(range(4))
        lm = await QueueLM.connect(MODEL, redis_url=any_redis_url)
        reference = MockAsyncLM(smol_tokenizer)
        try:
            programs = [p[:30] for p in _lineages(8)]
            particles = [list(program) for program in programs for _ in range(4)]
            for step in range(6):  # 8 programs, 4 particles each, one token a step
                for i, particle in enumerate(particles if step else []):
                    particle.append(1000 * step + i)
                prompts = [list(particle) for particle in particles]
                got = await lm.batch_next_token_logprobs(prompts)
                want = torch.stack([reference.logprobs_of(p) for p in prompts])
                assert torch.equal(got.cpu(), want)
        finally:
            await lm.close()
        where = {}
        for thread in threads:
            for prompt in thread.backend.seen:
                where.setdefault(prompt[:30], set()).add(thread.settings.name)
        assert all(len(names) == 1 for names in where.values()), where
        assert {name for names in where.values() for name in names} == {"a", "b"}
        assert all(t.worker is not None and t.worker.lanes.reader.stolen == 0 for t in threads)
    finally:
        for thread in threads:
            thread.stop()


async def test_an_idle_worker_steals_a_silent_owners_partitions_then_owns_them(
    redis_url: str, smol_tokenizer: Any
) -> None:
    admin = await connect_async_redis(redis_url)

    async def ghost_beats() -> None:  # a worker that looks live but never reads
        while True:
            await admin.zadd(KEYS.model_workers(MODEL), {"ghost": int(time.time() * 1000)})
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(ghost_beats())
    await asyncio.sleep(0.2)
    thread = await asyncio.to_thread(
        _start, smol_tokenizer, redis_url, "alive", steal_after_ms=20, heartbeat_s=0.5
    )
    try:
        assert len(_owned(thread)) == 2  # the ghost owns the other two
        lm = await QueueLM.connect(MODEL, redis_url=redis_url)
        try:
            prompts = [p[:20] for p in _lineages(40)]
            got = await asyncio.wait_for(lm.batch_next_token_logprobs(prompts), 20)
            assert got.shape[0] == 40
        finally:
            await lm.close()
        assert thread.worker is not None and thread.worker.lanes.reader.stolen > 0
        beating.cancel()  # the ghost dies: its heartbeat expires, the survivor owns everything
        await _until(lambda: _owned(thread) == frozenset(range(4)))
        registry, labels = thread.worker.metrics.registry, {"model": MODEL}
        assert registry.get_sample_value("lmq_partitions_owned", labels) == 4
        stolen = registry.get_sample_value("lmq_stolen_entries_total", labels)
        assert stolen == thread.worker.lanes.reader.stolen
    finally:
        beating.cancel()
        thread.stop()
        await admin.aclose()


async def test_a_tenants_entries_of_every_partition_are_answered_as_one_part(
    any_redis_url: str, smol_tokenizer: Any
) -> None:
    """A fair batch holding a tenant's entries of four partitions is processed and written
    once (one backend call, one write), each entry acknowledged on its own stream; on a
    cluster the four streams live on different masters."""
    client = await connect_async_redis(any_redis_url)
    backend = RecordingMock(smol_tokenizer)
    settings = WorkerSettings(model=MODEL, backend="mock", redis=RedisSettings(url=any_redis_url),
                              name="w", partitions=4)  # fmt: skip
    worker = Worker(settings, backend, client)
    try:
        await worker.publish()
        prompts = {}
        for partition in range(4):
            for n in range(6):
                tokens = [partition + 1, n + 1, 7]
                request = Request(
                    f"c1:{partition}:{n}", "c1", ids_to_bytes(tokens), claims=n % 2 == 0
                )
                prompts[request.request_id] = tokens
                await client.xadd(KEYS.requests(MODEL, partition), encode_request(request))
        assert await worker.run_until_idle() == 24
        replies = [decode_reply(fields) for _, fields in await client.xrange(KEYS.replies("c1"))]
        streams = [KEYS.requests(MODEL, p) for p in range(4)]
        left = [await client.xlen(stream) for stream in streams]
        pending = [(await client.xpending(stream, "workers"))["pending"] for stream in streams]
    finally:
        await worker.writer_thread.aclose()
        await client.aclose()
    assert sorted(reply.request_id for reply in replies) == sorted(prompts)
    assert sum(1 for reply in replies if reply.claim) == 12  # claim-checks: their entries stored
    for reply in replies:
        if not reply.claim:
            want = backend.logprobs_of(prompts[reply.request_id]).numpy()
            np.testing.assert_array_equal(reply.vector(), want)
    assert left == [0, 0, 0, 0] and pending == [0, 0, 0, 0]
    assert worker.metrics.batches_total == 1 and backend.batch_sizes == [24]
    assert worker.writer_thread.jobs == 2, worker.writer_thread.jobs  # the write, then closing


async def test_a_worker_refuses_a_partition_count_its_live_peers_do_not_share(
    redis_url: str, smol_tokenizer: Any
) -> None:
    thread = _start(smol_tokenizer, redis_url, "four")
    settings = WorkerSettings(model=MODEL, backend="mock", redis=RedisSettings(url=redis_url),
                              name="two", partitions=2)  # fmt: skip
    client = await connect_async_redis(redis_url)
    try:
        with pytest.raises(SettingsError, match="LMQ_PARTITIONS"):
            await Worker(settings, MockAsyncLM(smol_tokenizer), client).publish()
    finally:
        await client.aclose()
        thread.stop()


async def test_a_tenant_uses_a_partitioned_model_with_its_quotas_in_every_partition(
    any_redis_url: str, smol_tokenizer: Any
) -> None:
    admin = sync_redis(any_redis_url)
    tenants = TenantAdmin(admin, any_redis_url)
    thread = _start(smol_tokenizer, tenants.worker_user(), "w", steal_after_ms=20)
    url = tenants.add(TenantConfig("carol", max_inflight=500))
    try:
        carol = KeySpace(tenant="carol")
        for key in carol.quota_copies(MODEL, 4):  # written at once by `lmq tenant add`
            assert admin.hget(key, "max_inflight") == b"500"
        lm = await QueueLM.connect(MODEL, redis_url=url, settings=ClientSettings(timeout_s=20))
        try:
            prompts = [p[:12] for p in _lineages(24)]
            got = await lm.batch_next_token_logprobs(prompts)
            want = torch.stack([thread.backend.logprobs_of(p) for p in prompts])
            assert torch.equal(got.cpu(), want)
        finally:
            await lm.close()
        added = [admin.xinfo_stream(carol.requests(MODEL, p))["entries-added"] for p in range(4)]
        assert sum(added) == 24 and sum(1 for n in added if n) >= 2, added
    finally:
        thread.stop()
        tenants.remove("carol")
        tenants._acl("DELUSER", "lmq-worker")
        admin.close()
