"""`AsyncVirtualLM` on real vLLM (CPU), in this process: rows, chunks, caches, limits, close.

Rows are compared with the HF backend's float32 rows of the same prompts (max abs diff <=
1e-4, argmax equal). The engine runs with ``max_num_batched_tokens=64``, so the long prompts
are prefilled in chunks, and with vLLM's stats on, so its own prefix-cache counters are read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmqueue.shared.errors import Cancelled, EmptyPrompt, PromptTooLong, TokenOutOfVocabulary

from .conftest import ENGINE_OPTS, MODEL, assert_same_row


@pytest.fixture(scope="module")
def lm() -> Iterator[Any]:
    from lmqueue.workers.backends.vllm import AsyncVirtualLM

    backend = AsyncVirtualLM.from_name(
        MODEL, engine_opts={**ENGINE_OPTS, "disable_log_stats": False}, cache_size=64
    )
    yield backend
    backend.close()


def prefix_cache_hits(lm: Any) -> int:
    """vLLM's own counter of prompt tokens served from its prefix cache."""
    metrics = lm._driver.call(lambda engine: engine.get_metrics())
    return sum(int(m.value) for m in metrics if m.name == "vllm:prefix_cache_hits")


def test_limits_and_revision_come_from_the_engine(lm: Any) -> None:
    assert lm.vector_size == 49152 and lm.max_prompt_tokens == ENGINE_OPTS["max_model_len"] - 1
    assert lm.revision.endswith("+vllm-float32")


async def test_concurrent_rows_equal_the_hf_backends(
    lm: Any, hf_reference: Any, prompts: list[list[int]]
) -> None:
    assert max(len(p) for p in prompts) > ENGINE_OPTS["max_num_batched_tokens"]  # chunked
    lm.clear_cache()
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts * 2))
    refs = hf_reference.batch_next_token_logprobs_sync(prompts)
    for i, row in enumerate(rows):
        assert_same_row(row, refs[i % len(prompts)])


def test_the_sync_batch_equals_the_hf_backends(
    lm: Any, hf_reference: Any, prompts: list[list[int]]
) -> None:
    lm.clear_cache()
    rows = lm.batch_next_token_logprobs_sync([*prompts, prompts[0]])
    refs = hf_reference.batch_next_token_logprobs_sync([*prompts, prompts[0]])
    for row, ref in zip(rows, refs, strict=True):
        assert_same_row(row, ref)


async def test_prompts_sharing_a_prefix_hit_vllms_prefix_cache(
    lm: Any, hf_reference: Any, smol_tokenizer: Any
) -> None:
    """32 concurrent calls extend one prefix of a full KV block: vLLM counts the hits."""
    block = lm._driver.call(lambda engine: engine.vllm_config.cache_config.block_size)
    lm.clear_cache()
    text = "In a village of La Mancha, the name of which I have no desire to recall, " * 12
    prefix = smol_tokenizer.encode(text)[: block + 4]
    prompts = [prefix + [100 + i, 200 + i] for i in range(32)]
    before = prefix_cache_hits(lm)
    await lm.next_token_logprobs(prompts[0])  # fills the cache with the prefix's blocks
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts[1:]))
    assert prefix_cache_hits(lm) - before >= 31 * block  # the full block, for each
    refs = hf_reference.batch_next_token_logprobs_sync(prompts[1:9])
    for row, ref in zip(rows[:8], refs, strict=True):
        assert_same_row(row, ref)


async def test_clear_cache_drops_results_and_vllms_prefix_cache(
    lm: Any, prompts: list[list[int]]
) -> None:
    long = prompts[2]
    first = await lm.next_token_logprobs(long)
    assert await lm.next_token_logprobs(long) is first  # lmqueue's result cache
    lm.clear_cache()
    hits = prefix_cache_hits(lm)
    again = await lm.next_token_logprobs(long)
    assert again is not first and prefix_cache_hits(lm) == hits  # recomputed from scratch
    torch.testing.assert_close(again, first, atol=1e-4, rtol=0)
    lm.clear_cache()
    await lm.next_token_logprobs(long[:-1] + [long[-1] + 1])  # same prefix, new last token
    await lm.next_token_logprobs(long)
    assert prefix_cache_hits(lm) > hits  # without a clear, the prefix is served from cache


async def test_a_prompt_at_the_length_limit_is_served_and_one_past_it_refused(lm: Any) -> None:
    limit = lm.max_prompt_tokens
    row = await lm.next_token_logprobs([(i * 37) % 49152 for i in range(limit)])
    assert row.shape == (49152,) and abs(row.exp().sum().item() - 1) < 1e-3
    with pytest.raises(PromptTooLong):
        await lm.next_token_logprobs([5] * (limit + 1))


async def test_bad_prompts_fail_alone_and_the_engine_keeps_serving(lm: Any) -> None:
    outcomes = await asyncio.gather(
        lm.next_token_logprobs([]),
        lm.next_token_logprobs([49152 + 3]),
        lm.next_token_logprobs([1, 2, 3]),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], EmptyPrompt)
    assert isinstance(outcomes[1], TokenOutOfVocabulary)
    assert isinstance(outcomes[2], torch.Tensor)


async def test_reset_cancels_live_queries_and_the_engine_keeps_serving(lm: Any) -> None:
    lm.clear_cache()
    tasks = [asyncio.create_task(lm.next_token_logprobs([7, 8, i])) for i in range(16)]
    await asyncio.sleep(0)
    lm.reset_async_queries()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, torch.Tensor | Cancelled) for o in outcomes)
    assert (await lm.next_token_logprobs([7, 8, 9])).shape == (49152,)


def test_a_closed_backend_refuses_calls_at_once(lm: Any) -> None:
    """Last in this module: closing releases vLLM; later calls get `Cancelled`, never hang."""
    lm.close()
    with pytest.raises(Cancelled):
        lm.next_token_logprobs_sync([1, 2])
    with pytest.raises(Cancelled):
        lm._driver.submit([((1,), lambda result: None)])
