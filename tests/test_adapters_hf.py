"""LoRA adapters on the hf backend (`BatchedLora`), in-process and through a worker.

Adapters are made at test time with PEFT (random, non-zero LoRA weights on attention and MLP
projections), and every row is compared with a plain in-process PEFT forward of its adapter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import make_adapter, peft_reference, reference_logprobs

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import UnknownAdapter
from lmqueue.workers.backends.hf import AsyncTransformer
from workers_in_threads import ThreadedWorker

TOLERANCE = 1e-4
NAMES = [None, "a", "b"]


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        name: make_adapter(tiny_model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tiny_adapters: dict) -> Any:
    return peft_reference(tiny_model_dir, tiny_adapters)


def _assert_rows_match(rows: list, prompts: list, names: list, reference: Any) -> None:
    for prompt, name, row in zip(prompts, names, rows, strict=True):
        expected = reference_logprobs(reference, prompt, name)
        assert (torch.as_tensor(row) - expected).abs().max().item() <= TOLERANCE, (name, prompt)


async def test_one_forward_serves_rows_of_the_base_and_two_adapters_each_equal_to_peft(
    tiny_model_dir: Path, tiny_adapters: dict, reference: Any
):
    lm = AsyncTransformer.from_name(str(tiny_model_dir), timeout=0.05)
    try:
        for name, path in tiny_adapters.items():
            await lm.load_adapter(name, str(path))
        prompt = [1, 50, 60, 70]
        rows = await asyncio.gather(*(lm.next_token_logprobs(prompt, n) for n in NAMES))
        assert lm.stats.forwards == 1 and lm.stats.rows == 3
        _assert_rows_match(rows, [prompt] * 3, NAMES, reference)
        assert min((rows[i] - rows[j]).abs().max() for i, j in ((0, 1), (0, 2), (1, 2))) > 0.01
        longer = [prompt + [80, 90]] * 3  # each extends its own adapter's KV, never another's
        rows = await asyncio.gather(
            *(lm.next_token_logprobs(p, n) for p, n in zip(longer, NAMES, strict=True))
        )
        assert lm.stats.reused_tokens == 3 * len(prompt)
        _assert_rows_match(rows, longer, NAMES, reference)
        uncached = [lm.next_token_logprobs_uncached(prompt, n) for n in NAMES]
        _assert_rows_match(uncached, [prompt] * 3, NAMES, reference)
        with pytest.raises(UnknownAdapter, match="loaded: a, b"):
            await lm.next_token_logprobs(prompt, "c")
        await lm.unload_adapter("b")
        assert lm.adapter_names == {"a"} and lm.cache.get(tuple(prompt), "b") is None
        lm.clear_cache()
        fresh = await asyncio.gather(*(lm.next_token_logprobs(prompt, n) for n in NAMES[:2]))
        _assert_rows_match(fresh, [prompt] * 2, NAMES[:2], reference)
        await lm.load_adapter("a", str(tiny_adapters["b"]))  # a name given other weights
        await lm.unload_adapter("nope")
        _assert_rows_match([await lm.next_token_logprobs(prompt, "a")], [prompt], ["b"], reference)
        await lm.unload_adapter("a")  # the last one: a plain model again
        assert lm.adapter_names == frozenset() and lm.cache.get(tuple(prompt), "a") is None
        _assert_rows_match([await lm.next_token_logprobs(prompt)], [prompt], [None], reference)
    finally:
        await lm.aclose()


async def test_through_a_worker_three_interleaved_rows_match_peft_and_again_from_the_cache(
    tiny_model_dir: Path, tiny_adapters: dict, reference: Any, redis_url: str
):
    backend = AsyncTransformer.from_name(str(tiny_model_dir), timeout=0.05)
    adapters = {name: str(path) for name, path in tiny_adapters.items()}
    worker = ThreadedWorker(backend, redis_url, model="tiny", adapters=adapters).start()
    try:
        prompts = [[1, 2, 3, n] for n in range(4)]
        calls = [(p, n) for p in prompts for n in NAMES]  # interleaved: base, a, b, base, ...
        async with await QueueLM.connect("tiny", redis_url=redis_url, timeout_s=60) as lm:
            rows = await asyncio.gather(*(lm.next_token_logprobs(p, n) for p, n in calls))
        assert backend.stats.forwards == 1 and backend.stats.rows == 12
        _assert_rows_match(rows, [p for p, _ in calls], [n for _, n in calls], reference)
        async with await QueueLM.connect("tiny", redis_url=redis_url, timeout_s=60) as again:
            cached = await asyncio.gather(*(again.next_token_logprobs(p, n) for p, n in calls))
            assert again.stats["cache_hits"] == 12 and again.stats["sent"] == 0
        for row, hit in zip(rows, cached, strict=True):
            assert torch.equal(row, hit)
    finally:
        worker.stop()


@pytest.mark.slow
async def test_smollm2_serves_a_mixed_adapter_batch_equal_to_peft(
    smol_tokenizer: Any, tmp_path: Path
):
    from lmqueue.workers.models import hf_directory

    model_dir = hf_directory("smollm2-135m")
    adapters = {
        "a": make_adapter(model_dir, tmp_path / "a", 1),
        "b": make_adapter(model_dir, tmp_path / "b", 2),
    }
    reference = peft_reference(model_dir, adapters)
    lm = AsyncTransformer.from_name("smollm2-135m", timeout=0.05)
    try:
        for name, path in adapters.items():
            await lm.load_adapter(name, str(path))
        stem = smol_tokenizer.encode("The capital of France is")
        rows = await asyncio.gather(*(lm.next_token_logprobs(stem, n) for n in NAMES))
        assert lm.stats.forwards == 1
        _assert_rows_match(rows, [stem] * 3, NAMES, reference)
        assert min((rows[i] - rows[j]).abs().max() for i, j in ((0, 1), (0, 2), (1, 2))) > 0.01
    finally:
        await lm.aclose()
