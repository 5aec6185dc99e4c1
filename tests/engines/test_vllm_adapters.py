"""LoRA adapters on a real vLLM worker: ``lmq worker --backend vllm --adapter NAME=PATH``.

Two random, non-zero PEFT adapters of SmolLM2-135M are made at test time; the worker serves
them and the base model through vLLM's multi-LoRA batching. Each row must equal a plain PEFT
forward of its adapter in float32 (the bound the HF backend meets), with the base and both
adapters asked at once, and again from the shared cache. An adapter added to the running
worker (``lmq adapter add``) is served within seconds.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import make_adapter, peft_reference, reference_logprobs

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import UnknownAdapter
from lmqueue.workers.models import hf_directory

from .conftest import MODEL, vllm_worker, wait_live

NAMES = [None, "a", "b"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three rank-4 adapters (the engine is sized for rank 8, vLLM's smallest bound above 4)."""
    root = tmp_path_factory.mktemp("adapters")
    model_dir = hf_directory(MODEL)
    return {name: make_adapter(model_dir, root / name, seed) for seed, name in enumerate("abc")}


@pytest.fixture(scope="module")
def reference(adapters: dict[str, Path]) -> Any:
    return peft_reference(hf_directory(MODEL), adapters)


@pytest.fixture(scope="module")
def adapter_worker(
    engine_redis: str, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    """A vLLM worker started with adapters a and b (c is added while it runs)."""
    worker = vllm_worker(
        engine_redis,
        "vllm-lora",
        tmp_path_factory.mktemp("vllm-lora-logs"),
        extra_args=["--adapter", f"a={adapters['a']}", "--adapter", f"b={adapters['b']}"],
    )
    try:
        wait_live(engine_redis, [worker])
        yield worker
    finally:
        code = worker.stop(timeout_s=60)
        assert code == 0, worker.log()[-4000:]


def _assert_peft_row(row: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (row - ref).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff:.2e} from the PEFT forward"
    assert int(row.argmax()) == int(ref.argmax())


async def test_base_and_two_adapters_interleaved_equal_peft_and_again_from_the_cache(
    engine_redis: str, adapter_worker: Any, reference: Any, smol_tokenizer: Any
) -> None:
    prompts = [smol_tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):")]
    calls = [(p, name) for p in prompts for name in NAMES]  # base, a, b, base, a, b
    async with await QueueLM.connect(MODEL, redis_url=engine_redis, timeout_s=120) as lm:
        rows = await asyncio.gather(*(lm.next_token_logprobs(p, n) for p, n in calls))
    for row, (prompt, name) in zip(rows, calls, strict=True):
        _assert_peft_row(row, reference_logprobs(reference, prompt, name))
    for i in range(0, len(rows), 3):  # one prompt: three different rows
        base, a, b = rows[i : i + 3]
        assert min((x - y).abs().max() for x, y in ((base, a), (base, b), (a, b))) > 0.01
    async with await QueueLM.connect(MODEL, redis_url=engine_redis, timeout_s=120) as again:
        cached = await asyncio.gather(*(again.next_token_logprobs(p, n) for p, n in calls))
        assert again.stats["cache_hits"] == len(calls) and again.stats["sent"] == 0
    for row, hit in zip(rows, cached, strict=True):
        assert torch.equal(row, hit)


async def test_an_adapter_added_to_the_running_worker_is_served(
    engine_redis: str, adapter_worker: Any, adapters: dict[str, Path], reference: Any
) -> None:
    prompt = [504, 3458, 282, 4649, 314]
    async with await QueueLM.connect(MODEL, redis_url=engine_redis, timeout_s=120) as lm:
        with pytest.raises(UnknownAdapter, match="a, b"):
            await lm.next_token_logprobs(prompt, "c")
        subprocess.run(
            [sys.executable, "-m", "lmqueue", "adapter", "--redis-url", engine_redis,
             "add", MODEL, f"c={adapters['c']}"],
            check=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                row = await lm.next_token_logprobs(prompt, "c")
                break
            except UnknownAdapter:  # the worker loads it at its next refresh
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    _assert_peft_row(row, reference_logprobs(reference, prompt, "c"))
