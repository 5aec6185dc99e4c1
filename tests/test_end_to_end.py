"""End to end: real worker processes, a real redis-server, hundreds of concurrent futures."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import redis
import torch
import uvloop

from lmqueue.devstack import LocalRedis, WorkerProcess
from lmqueue.producer import QueueLM
from lmqueue.shared.errors import EmptyPrompt, TokenOutOfVocabulary, UnknownModel
from lmqueue.shared.keys import KeySpace
from lmqueue.workers.backends.mock import MockAsyncLM


@pytest.fixture(scope="module")
def e2e_redis():
    """A server of this module's own: its workers outlive single tests (no per-test flush)."""
    with LocalRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def mock_workers(e2e_redis, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    workers = [
        WorkerProcess("smollm2-135m", "mock", e2e_redis, f"e2e-{i}", log_dir=log_dir).start()
        for i in range(2)
    ]
    # `lmq submit` asks once and reports an unpublished model at once (exit 2): wait for it
    keys = KeySpace("lmq", "default")
    client = redis.Redis.from_url(e2e_redis)
    deadline = time.monotonic() + 120
    while not client.exists(keys.model_info("smollm2-135m")) and time.monotonic() < deadline:
        time.sleep(0.1)
    client.close()
    yield workers
    for worker in workers:
        assert worker.stop() == 0, worker.log()


@pytest.fixture
def redis_url(e2e_redis):
    return e2e_redis


async def test_two_worker_processes_answer_hundreds_of_futures_exactly(
    mock_workers, redis_url, smol_tokenizer
):
    reference = MockAsyncLM(smol_tokenizer)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 49152, size=int(rng.integers(1, 40))).tolist() for _ in range(400)]
    prompts += prompts[:50]  # repeats share in-flight requests
    async with await QueueLM.connect(
        "smollm2-135m", redis_url=redis_url, connect_timeout_s=60
    ) as lm:
        results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        stats = lm.stats
    for prompt, result in zip(prompts, results, strict=True):
        assert torch.equal(result, reference.logprobs_of(prompt))
    assert stats["sent"] + stats["cache_hits"] == 400 and stats["inflight"] == 0


def test_a_client_on_uvloop_gets_exact_results(mock_workers, redis_url, smol_tokenizer):
    """uvloop's transports take no attributes of asyncio's own: connecting once failed there
    (``transport.max_size``), and commands go out by ``writelines`` instead of ``sendmsg``."""
    reference = MockAsyncLM(smol_tokenizer)
    prompts = [[index, 5, index % 7] for index in range(200)]

    async def calls() -> list[torch.Tensor]:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with await QueueLM.connect(
            "smollm2-135m", redis_url=redis_url, connect_timeout_s=60
        ) as lm:
            return await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))

    results = uvloop.run(calls())
    for prompt, result in zip(prompts, results, strict=True):
        assert torch.equal(result, reference.logprobs_of(prompt))


@pytest.mark.parametrize("setting", [10_000, 0])
async def test_connecting_raises_the_young_collection_threshold_unless_told_not_to(
    mock_workers, redis_url, setting, interpreter_gc_thresholds
):
    async with await QueueLM.connect(
        "smollm2-135m", redis_url=redis_url, connect_timeout_s=60, gc_young_threshold=setting
    ):
        assert gc.get_threshold() == (setting or 700, 10, 10)


async def test_bad_inputs_fail_on_their_own_futures_and_the_rest_succeed(mock_workers, redis_url):
    async with await QueueLM.connect(
        "smollm2-135m", redis_url=redis_url, connect_timeout_s=60
    ) as lm:
        outcomes = await asyncio.gather(
            lm.next_token_logprobs([1, 2]),
            lm.next_token_logprobs([]),
            lm.next_token_logprobs([10**9]),
            lm.next_token_logprobs([3, 4]),
            return_exceptions=True,
        )
    assert isinstance(outcomes[1], EmptyPrompt)
    assert isinstance(outcomes[2], TokenOutOfVocabulary)
    assert outcomes[0].shape == outcomes[3].shape == (49152,)


async def test_an_unknown_model_fails_with_a_typed_error(mock_workers, redis_url):
    async with await QueueLM.connect("smollm2-135m", redis_url=redis_url, connect_timeout_s=60):
        pass
    with pytest.raises(UnknownModel):
        await QueueLM.connect("no-such-model", redis_url=redis_url, connect_timeout_s=0.2)


def test_a_worker_for_an_unknown_model_exits_with_a_clear_message(redis_url, tmp_path):
    worker = WorkerProcess("not-a-model", "mock", redis_url, "bad", log_dir=tmp_path).start()
    assert worker.process is not None and worker.process.wait(60) == 2
    assert "unknown model 'not-a-model'" in worker.log()


def test_lmq_submit_prints_the_most_likely_next_tokens(mock_workers, redis_url):
    env = {**os.environ, "REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "lmqueue", "submit", "The cat sat on the", "--top-k", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.strip().splitlines()
    assert header.split() == ["token", "logprob", "prob", "text"]
    assert len(lines) == 3
    logprobs = [float(line.split()[1]) for line in lines]
    probabilities = [float(line.split()[2]) for line in lines]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < probabilities[0] <= 1
    assert all(abs(math.exp(lp) - p) < 1e-3 for lp, p in zip(logprobs, probabilities, strict=True))


async def test_hf_worker_processes_match_the_in_process_backend(
    e2e_redis, tiny_model_dir, tmp_path
):
    """Two real HF workers on a tiny Llama: results through the queue equal a local forward."""
    from transformers import AutoModelForCausalLM

    from lmqueue.workers.backends.hf import AsyncTransformer
    from lmqueue.workers.models import load_tokenizer

    name = str(tiny_model_dir)
    workers = [
        WorkerProcess(name, "hf", e2e_redis, f"hf-{i}", log_dir=tmp_path).start() for i in range(2)
    ]
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        reference = AsyncTransformer(model, load_tokenizer(name))
        rng = np.random.default_rng(3)
        stem = rng.integers(0, 49152, size=12).tolist()
        prompts = [
            stem + rng.integers(0, 49152, size=int(rng.integers(1, 6))).tolist() for _ in range(120)
        ]
        async with await QueueLM.connect(name, redis_url=e2e_redis, connect_timeout_s=90) as lm:
            results = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            expected = reference.next_token_logprobs_uncached(prompt)
            assert torch.allclose(result, expected, atol=1e-4)
    finally:
        for worker in workers:
            assert worker.stop() == 0, worker.log()
