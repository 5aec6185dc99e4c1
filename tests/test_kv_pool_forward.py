"""Rows through the KV pool equal a plain forward (float32, 1e-4): shared prefixes, siblings,
evictions, scattered slots, out-of-memory splits, decode graphs, and an unfit KV layout."""

from __future__ import annotations

import functools
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_backends import backend_factory

from lmqueue.shared.errors import UnknownAdapter
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.workers.backends.decode_graphs import DecodeGraphs, bucket_of
from lmqueue.workers.backends.hf import AsyncTransformer
from lmqueue.workers.backends.padded_batch import forward_options

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def vocab(smol_tokenizer: Any) -> dict[str, Any]:
    byte_vocab, str_vocab = decode_vocab(smol_tokenizer)
    return {"byte_vocab": byte_vocab, "str_vocab": str_vocab}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture
async def make_lm(
    model: Any, smol_tokenizer: Any, vocab: dict[str, Any]
) -> AsyncIterator[Callable[..., AsyncTransformer]]:
    """Build backends over the model; all are closed after the test."""
    async with backend_factory(model, smol_tokenizer, vocab, timeout=0.01) as make:
        yield make


def assert_plain(lm: AsyncTransformer, prompts: list[list[int]], rows: list[Any]) -> None:
    for prompt, row in zip(prompts, rows, strict=True):
        assert isinstance(row, torch.Tensor), row
        expected = lm.next_token_logprobs_uncached(prompt)
        assert torch.allclose(row, expected, atol=TOLERANCE, rtol=0), prompt


def assert_no_slot_lost(lm: AsyncTransformer) -> None:
    pool = lm.cache.pool
    assert pool is not None
    lm.cache._check_invariants()
    assert lm.cache.kv_tokens + pool.free_slots + pool.quarantined_slots == pool.capacity


async def smc_steps(
    lm: AsyncTransformer, particles: int, steps: int, seed: int = 0, prompt_len: int = 9
) -> None:
    """An SMC-shaped workload through `logprobs_batch`: particles extend by a token a step and
    are resampled (copies of one another become siblings); every row checked."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 4000) for _ in range(prompt_len)]
    paths = [list(prompt) for _ in range(particles)]
    for _ in range(steps):
        for path in paths:
            path.append(rng.randrange(1, 4000))
        rows = await lm.logprobs_batch([(None, path) for path in paths])
        assert_plain(lm, paths, rows)
        assert_no_slot_lost(lm)
        paths = [list(rng.choice(paths)) for _ in paths]  # resample: siblings share pasts


async def test_an_smc_workload_through_the_pool_matches_the_plain_forward(
    make_lm: Callable,
) -> None:
    lm = make_lm(max_kv_tokens=2000, batch_size=64)
    await smc_steps(lm, particles=12, steps=6)
    assert lm.stats.reused_tokens > 0 and lm.stats.forwards == 6  # one forward a step


async def test_under_constant_eviction_rows_stay_exact_and_no_slot_is_lost(
    make_lm: Callable,
) -> None:
    lm = make_lm(max_kv_tokens=40, batch_size=64)  # less than one step's pasts
    await smc_steps(lm, particles=8, steps=8, seed=1)
    assert lm.cache.kv_tokens <= 40


async def test_pasts_whose_slots_are_scattered_over_the_pool_gather_right(
    make_lm: Callable,
) -> None:
    lm = make_lm(max_kv_tokens=400, batch_size=64)
    pool = lm.cache.pool
    assert pool is not None
    rng = np.random.default_rng(3)
    shuffled = rng.permutation(pool.allocate(pool.free_slots))  # free them in random order
    pool.free(shuffled)
    prompts = [[5, 6, 7, 8, 9, 10, 11, n] for n in range(6)]
    first = await lm.logprobs_batch([(None, p) for p in prompts])
    stored = [lm.cache.kv_prefix(p, len(p))[0] for p in prompts]
    assert any(np.any(np.diff(slots) != 1) for slots in stored)  # not contiguous
    longer = [p + [12, 13] for p in prompts]
    second = await lm.logprobs_batch([(None, p) for p in longer])
    assert_plain(lm, prompts + longer, first + second)
    assert_no_slot_lost(lm)


async def test_a_pooled_batch_out_of_memory_splits_and_keeps_every_rows_kv(
    make_lm: Callable, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = model.forward

    @functools.wraps(original)
    def small_batches_only(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", small_batches_only)
    lm = make_lm(max_kv_tokens=500, batch_size=64)
    prompts = [[9, 8, 7, n] for n in range(5)]
    rows = await lm.logprobs_batch([(None, p) for p in prompts])
    monkeypatch.setattr(model, "forward", original)
    assert lm.stats.oom_splits >= 2
    assert all(lm.cache.kv_prefix(p, len(p))[1] == len(p) for p in prompts)
    longer = [p + [1] for p in prompts]
    assert_plain(lm, prompts + longer, rows + await lm.logprobs_batch([(None, p) for p in longer]))
    assert_no_slot_lost(lm)


async def test_a_batch_call_answers_cached_rows_at_once_and_an_unknown_adapter_by_row(
    make_lm: Callable,
) -> None:
    lm = make_lm(max_kv_tokens=200)
    first = await lm.logprobs_batch([(None, [1, 2, 3])])
    forwards = lm.stats.forwards
    again, unknown = await lm.logprobs_batch([(None, [1, 2, 3]), ("nope", [1, 2])])
    assert again is first[0] and lm.stats.forwards == forwards
    assert isinstance(unknown, UnknownAdapter)


@pytest.mark.parametrize("particles", [5, 8, 11])
async def test_decode_graph_replays_equal_the_plain_forward(
    make_lm: Callable, model: Any, particles: int
) -> None:
    """The static-buffer path of CUDA graphs, emulated on the CPU: bucketing rows to a power
    of two and pasts to a multiple of 64 changes no row."""
    lm = make_lm(max_kv_tokens=2000, batch_size=64)
    pool = lm.cache.pool
    assert pool is not None
    graphs = DecodeGraphs(model, pool, forward_options(model), 32_768, emulate=True)
    lm._graphs = graphs
    await smc_steps(lm, particles=particles, steps=6, seed=particles, prompt_len=60)
    assert graphs.replays == 5  # every step but the first (its rows run 61 new tokens)
    assert graphs.captures == 2  # pasts of 61-64, then 65: buckets of 64 and 128 positions
    assert bucket_of(particles, 64) == (max(8, 1 << (particles - 1).bit_length()), 64)


async def test_a_model_whose_kv_does_not_fit_the_pool_runs_without_reuse(
    make_lm: Callable, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text_config = model.config.get_text_config()
    monkeypatch.setattr(text_config, "head_dim", text_config.head_dim * 2, raising=False)
    lm = make_lm(max_kv_tokens=200)
    monkeypatch.undo()  # the model computes with its real head size; the pool was sized wrong
    prompts = [[3, 4, 5], [3, 4, 6]]
    rows = await lm.logprobs_batch([(None, p) for p in prompts])
    assert lm.cache.pool is None and lm.cache.kv_tokens == 0
    more = await lm.logprobs_batch([(None, p + [7]) for p in prompts])
    assert_plain(lm, prompts + [p + [7] for p in prompts], rows + more)
