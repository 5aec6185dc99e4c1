"""Fault scenario on real vLLM workers: kill -9 of one mid-batch, a second takes over.

Marked `scenario` (a long fault scenario) and engine-gated: it runs in ``make test-engines``.
Every request must end in exactly one outcome -- its row -- with none lost and none wrong.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from lmqueue.devstack import LocalRedis
from lmqueue.producer import QueueLM

from .conftest import MODEL, assert_same_row, vllm_worker, wait_live
from .test_vllm_worker import _until_holding

pytestmark = pytest.mark.scenario


async def test_a_vllm_worker_killed_mid_batch_leaves_every_request_one_outcome(
    tmp_path: Path, hf_reference: Any, smol_tokenizer: Any
) -> None:
    with LocalRedis() as server:
        victim = vllm_worker(server.url, "victim", tmp_path, LMQ_BATCH_SIZE="16")
        survivor = vllm_worker(server.url, "survivor", tmp_path, LMQ_BATCH_SIZE="16")
        try:
            wait_live(server.url, [victim, survivor])
            prompts = [
                smol_tokenizer.encode(f"Particle {i} continues the sentence: the river")
                for i in range(160)
            ]
            async with await QueueLM.connect(
                MODEL, redis_url=server.url, connect_timeout_s=60
            ) as lm:
                tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
                held = await _until_holding(server.url, victim.name)
                victim.signal(signal.SIGKILL)
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            assert held > 0 and not errors, errors[:3]
            assert len(outcomes) == len(prompts)  # a late reply of the victim is dropped once
            refs = hf_reference.batch_next_token_logprobs_sync(prompts[::8])
            for row, ref in zip(outcomes[::8], refs, strict=True):
                assert_same_row(row, ref)
            assert survivor.alive and not victim.alive
        finally:
            victim.stop(timeout_s=10)
            assert survivor.stop(timeout_s=60) == 0, survivor.log()[-3000:]
