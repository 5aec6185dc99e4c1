"""``lmq worker --backend vllm`` as a real process on SmolLM2-135M, through a real Redis.

One vLLM worker serves the whole module; a second one is started for the SIGTERM test. Rows
through the queue are compared with the HF backend's float32 rows of the same prompts.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from lmqueue.producer import QueueLM, QueueTrie
from lmqueue.shared.connections import connect_async_redis
from lmqueue.shared.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary
from lmqueue.shared.keys import WORKER_GROUP
from lmqueue.shared.lm.trie import ParallelTokenCharacterTrie

from .conftest import ENGINE_OPTS, KEYS, MODEL, assert_same_row, vllm_worker, wait_live

VOCAB = 49152


async def _connect(url: str) -> QueueLM:
    return await QueueLM.connect(MODEL, redis_url=url, connect_timeout_s=60)


async def test_the_worker_serves_rows_equal_to_the_hf_backends(
    vllm_worker_url: str, hf_reference: Any, prompts: list[list[int]]
) -> None:
    async with await _connect(vllm_worker_url) as lm:
        assert lm.vector_size == VOCAB
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    refs = hf_reference.batch_next_token_logprobs_sync(prompts)
    for row, ref in zip(rows, refs, strict=True):
        assert_same_row(row, ref)


async def test_many_concurrent_calls_sharing_prefixes_get_their_own_rows(
    vllm_worker_url: str, hf_reference: Any, smol_tokenizer: Any
) -> None:
    """128 calls at once: 8 stems, each extended 16 ways (SMC particles after one step)."""
    stems = [
        smol_tokenizer.encode(f"Story {i}: the old lighthouse keeper said that") for i in range(8)
    ]
    prompts = [stem + [1000 + 7 * j] for stem in stems for j in range(16)]
    async with await _connect(vllm_worker_url) as lm:
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    sample = prompts[::9]
    refs = hf_reference.batch_next_token_logprobs_sync(sample)
    for row, ref in zip(rows[::9], refs, strict=True):
        assert_same_row(row, ref)
    assert len({int(r.argmax()) for r in rows}) > 1  # not one row handed to everyone


async def test_bad_prompts_are_typed_errors_and_the_worker_keeps_serving(
    vllm_worker_url: str, hf_reference: Any, prompts: list[list[int]]
) -> None:
    limit = ENGINE_OPTS["max_model_len"] - 1
    at_limit = [(i * 31) % VOCAB for i in range(limit)]
    async with await _connect(vllm_worker_url) as lm:
        assert lm.max_prompt_tokens == limit
        outcomes = await asyncio.gather(
            lm.next_token_logprobs([]),
            lm.next_token_logprobs([VOCAB + 5]),
            lm.next_token_logprobs([3] * (limit + 1)),
            lm.next_token_logprobs(at_limit),
            lm.next_token_logprobs(prompts[0]),
            return_exceptions=True,
        )
    assert isinstance(outcomes[0], EmptyPrompt)
    assert isinstance(outcomes[1], TokenOutOfVocabulary)
    assert isinstance(outcomes[2], PromptTooLong)
    assert isinstance(outcomes[3], torch.Tensor) and outcomes[3].shape == (VOCAB,)
    assert_same_row(outcomes[4], hf_reference.next_token_logprobs_sync(prompts[0]))


async def test_clear_cache_through_the_client_keeps_rows_right(
    vllm_worker_url: str, hf_reference: Any, prompts: list[list[int]]
) -> None:
    async with await _connect(vllm_worker_url) as lm:
        first = await lm.next_token_logprobs(prompts[2])
        lm.clear_cache()
        again = await lm.next_token_logprobs(prompts[2])
    assert again is not first
    assert_same_row(again, hf_reference.next_token_logprobs_sync(prompts[2]))


async def test_trie_masses_on_a_vllm_worker_match_the_local_trie(
    vllm_worker_url: str, hf_reference: Any, prompts: list[list[int]]
) -> None:
    local = ParallelTokenCharacterTrie(hf_reference.byte_vocab)
    async with await _connect(vllm_worker_url) as lm:
        trie = await QueueTrie.create(lm)
        masses = await trie.mass_sum(prompts[0])
        row = await lm.next_token_logprobs(prompts[0])
    expected = local.weight_sum(np.exp(row.numpy().astype(np.float64)))
    np.testing.assert_allclose(masses, expected, rtol=1e-5, atol=1e-9)
    assert masses[0] == pytest.approx(1.0, abs=1e-4)


async def test_sigterm_with_requests_in_flight_answers_each(
    engine_redis: str, tmp_path: Any, hf_reference: Any, smol_tokenizer: Any
) -> None:
    """A second vLLM worker gets SIGTERM while it holds requests: it finishes them (the
    session worker serves the rest), every call ends in its row, and it exits 0."""
    worker = vllm_worker(engine_redis, "vllm-term", tmp_path)
    try:
        wait_live(engine_redis, [worker])
        prompts = [smol_tokenizer.encode(f"Request {i} asks the model about") for i in range(48)]
        async with await _connect(engine_redis) as lm:
            tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
            held = await _until_holding(engine_redis, worker.name)
            worker.signal(signal.SIGTERM)
            rows = await asyncio.gather(*tasks)
        assert held > 0
        assert worker.process is not None and worker.process.wait(60) == 0, worker.log()[-3000:]
        refs = hf_reference.batch_next_token_logprobs_sync(prompts[::6])
        for row, ref in zip(rows[::6], refs, strict=True):
            assert_same_row(row, ref)
    finally:
        worker.stop(timeout_s=30)


async def _until_holding(url: str, consumer: str, timeout_s: float = 30) -> int:
    """Entries `consumer` has read and not yet acknowledged, once there are some."""
    client = await connect_async_redis(url)
    try:
        for _ in range(int(timeout_s / 0.005)):
            try:
                summary = await client.xpending(KEYS.requests(MODEL), WORKER_GROUP)
            except aioredis.ResponseError:
                summary = {}
            for row in summary.get("consumers") or []:
                name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
                if name == consumer and int(row["pending"]):
                    return int(row["pending"])
            await asyncio.sleep(0.005)
    finally:
        await client.aclose()
    raise TimeoutError(f"{consumer} never held a request")
