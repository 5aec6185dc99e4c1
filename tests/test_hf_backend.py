"""`AsyncTransformer` on a tiny real Llama (once on SmolLM2): batching, KV reuse, bounds, faults."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_backends import backend_factory

from lmqueue.shared.errors import (
    BadRequest,
    Cancelled,
    EmptyPrompt,
    ModelError,
    PromptTooLong,
    TokenOutOfVocabulary,
)
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.workers.backends import AsyncTransformer
from lmqueue.workers.backends.batch_inputs import BatchInputs, Row, attention_mask
from lmqueue.workers.backends.padded_batch import kv_argument

TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def vocab(smol_tokenizer: Any) -> dict[str, Any]:
    """The decoded vocabulary, once: backends built per test skip decoding it."""
    byte_vocab, str_vocab = decode_vocab(smol_tokenizer)
    return {"byte_vocab": byte_vocab, "str_vocab": str_vocab}


@pytest.fixture(scope="session", params=["sdpa", "eager"])
def tiny_model(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Any:
    """The tiny Llama, under each attention implementation whose mask we build."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=request.param)


@pytest.fixture
async def make_lm(
    tiny_model: Any, smol_tokenizer: Any, vocab: dict[str, Any]
) -> AsyncIterator[Callable[..., AsyncTransformer]]:
    """Build backends over the tiny model; all are closed after the test."""
    async with backend_factory(tiny_model, smol_tokenizer, vocab) as make:
        yield make


@pytest.fixture
def forward_shapes(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple]]:
    """``(rows, new tokens, past tokens)`` of every forward the tiny model runs."""
    shapes: list[tuple[int, int, int]] = []
    original = tiny_model.forward

    @functools.wraps(original)
    def recording(*args: Any, **kwargs: Any) -> Any:
        past = kwargs.get(kv_argument(tiny_model))
        past_len = past.get_seq_length() if past is not None else 0
        shapes.append((*kwargs["input_ids"].shape, past_len))
        return original(*args, **kwargs)

    monkeypatch.setattr(tiny_model, "forward", recording)
    yield shapes


def patch_forward(model: Any, monkeypatch: pytest.MonkeyPatch, before: Callable) -> None:
    """Call ``before(input_ids)`` ahead of each forward of `model` (to fail or stall it)."""
    original = model.forward

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        before(kwargs["input_ids"])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", patched)


def assert_matches_uncached(lm: AsyncTransformer, prompts: list[list[int]], rows: Any) -> None:
    for prompt, row in zip(prompts, rows, strict=True):
        assert row.dtype == torch.float32 and row.device.type == "cpu"
        assert row.shape == (lm.vector_size,) and torch.isfinite(row).all()
        expected = lm.next_token_logprobs_uncached(prompt)
        assert torch.allclose(row, expected, atol=TOLERANCE, rtol=0), prompt


def family(rng: random.Random) -> list[list[int]]:
    """Prompts that share, extend and diverge from a common stem, with different lengths."""
    stem = [rng.randrange(1, 5000) for _ in range(12)]
    prompts = [stem, stem[:3], stem[:7] + [rng.randrange(5000)], [rng.randrange(5000)]]
    prompts += [stem + [rng.randrange(5000) for _ in range(k)] for k in (1, 2, 5)]
    prompts += [stem[:5] + [rng.randrange(5000) for _ in range(9)]]
    return prompts


# -- results ---------------------------------------------------------------------------------------
async def test_concurrent_batches_reusing_kv_match_the_uncached_forward(make_lm: Callable) -> None:
    lm = make_lm(timeout=0.005)
    rng = random.Random(0)
    prompts = family(rng)
    for _round in range(3):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        assert_matches_uncached(lm, prompts, rows)
        prompts = [p + [rng.randrange(5000)] for p in prompts]
    assert lm.stats.new_tokens < sum(len(p) for p in prompts) * 3  # pasts were reused


async def test_sequential_and_synchronous_calls_match_the_uncached_forward(
    make_lm: Callable,
) -> None:
    lm = make_lm(timeout=0.0)
    prompts = family(random.Random(1))
    rows = [await lm.next_token_logprobs(p) for p in prompts]
    assert_matches_uncached(lm, prompts, rows)
    lm.clear_cache()
    assert_matches_uncached(lm, prompts, [lm.next_token_logprobs_sync(p) for p in prompts])
    assert_matches_uncached(lm, prompts, await lm.batch_next_token_logprobs(prompts))
    assert_matches_uncached(lm, prompts, lm.batch_next_token_logprobs_sync(prompts))


async def test_after_cache_kv_an_extension_runs_only_its_new_tokens(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    lm = make_lm(timeout=0.0)
    prompt = list(range(100, 130))
    lm.cache_kv(prompt)
    assert lm.cache.kv_tokens == 30

    row = await lm.next_token_logprobs(prompt + [7])
    assert forward_shapes[-1] == (1, 1, 30)
    row2 = await lm.next_token_logprobs(prompt[:10] + [7, 8])
    assert forward_shapes[-1] == (1, 2, 10)  # the shared 10 positions came from the cache
    assert_matches_uncached(lm, [prompt + [7], prompt[:10] + [7, 8]], [row, row2])


async def test_reused_tokens_says_what_a_forward_would_take_from_the_prefix_cache(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    """What the worker charges a tenant's fair share: a prompt's positions minus these."""
    lm = make_lm(timeout=0.0)
    prompt = list(range(100, 130))
    assert lm.reused_tokens([(None, prompt + [7])]) == 0
    await lm.next_token_logprobs(prompt)
    extension, stored = prompt + [7, 8], prompt
    assert lm.reused_tokens([(None, extension), (None, stored), (None, [5, 6])]) == 30 + 30
    await lm.next_token_logprobs(extension)
    assert forward_shapes[-1][1] == len(extension) - 30  # what it said was reused was
    assert lm.reused_tokens([(None, extension)]) == len(extension)  # now a stored result


async def test_results_stay_exact_under_tight_bounds_and_constant_eviction(
    make_lm: Callable,
) -> None:
    lm = make_lm(timeout=0.002, max_kv_tokens=25, cache_size=6, batch_size=4)
    rng = random.Random(2)
    particles = [[rng.randrange(5000) for _ in range(6)] for _ in range(6)]
    for step in range(12):
        particles = [p + [rng.randrange(5000)] for p in particles]
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        lm.cache._check_invariants()
        assert lm.cache.kv_tokens <= 25 and lm.cache.num_results <= 6
        if step % 4 == 3:
            assert_matches_uncached(lm, particles, rows)


async def test_memory_stays_bounded_over_a_long_random_workload(make_lm: Callable) -> None:
    lm = make_lm(timeout=0.001, max_kv_tokens=60, cache_size=20)
    rng = random.Random(3)
    particles = [[rng.randrange(50) for _ in range(4)] for _ in range(8)]
    for _step in range(40):
        for i, particle in enumerate(particles):
            if rng.random() < 0.15:  # resample: copy another particle
                particles[i] = list(particles[rng.randrange(len(particles))])
            else:
                particle.append(rng.randrange(50))
            particles[i] = particles[i][-30:] if len(particles[i]) < 60 else particles[i][:4]
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in particles))
        lm.cache._check_invariants()
        assert lm.cache.kv_tokens <= 60 and lm.cache.num_results <= 20
        assert lm.cache.num_nodes() <= 2 * (20 + 60) + 1


def test_padding_queries_see_themselves_and_real_tokens_see_exactly_their_causal_past(
    tiny_model: Any,
) -> None:
    rows = [Row(np.arange(0), (5, 6)), Row(np.arange(2, 5), (7,)), Row(np.arange(2, 3), (8, 9, 10))]
    real = BatchInputs.of(rows, width_past=3, width_new=3, device="cpu").real
    mask = attention_mask(tiny_model, real, width_past=3, width_new=3)
    visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    assert visible.any(dim=-1).all()  # no query row is fully masked
    # row 0: past none; new tokens in slots 4, 5 (slot 3 is padding and sees only itself)
    assert visible[0, 0].tolist() == [False, False, False, True, False, False]
    assert visible[0, 2].tolist() == [False, False, False, False, True, True]
    # row 2: one past token in slot 0, new tokens in slots 3..5
    assert visible[2, 1].tolist() == [True, False, False, True, True, False]


# -- batching --------------------------------------------------------------------------------------
async def test_identical_concurrent_prompts_are_computed_once(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    lm = make_lm(timeout=0.01)
    rows = await asyncio.gather(*(lm.next_token_logprobs([1, 2, 3]) for _ in range(8)))
    assert forward_shapes == [(1, 3, 0)]
    assert all(row is rows[0] for row in rows)


async def test_identical_calls_fill_a_batch_like_distinct_ones(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    lm = make_lm(timeout=30.0, batch_size=4)
    calls = asyncio.gather(*(lm.next_token_logprobs([7, 8]) for _ in range(4)))
    await asyncio.wait_for(calls, timeout=5.0)  # no 30 s wait: four callers make a full batch
    assert forward_shapes == [(1, 2, 0)]


async def test_a_forward_holds_at_most_batch_size_queries(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    lm = make_lm(timeout=0.01, batch_size=3)
    await asyncio.gather(*(lm.next_token_logprobs([i, i + 1]) for i in range(10)))
    assert max(rows for rows, _, _ in forward_shapes) == 3
    assert sum(rows for rows, _, _ in forward_shapes) == 10


async def test_a_forward_holds_at_most_max_batch_tokens_padded_new_tokens(
    make_lm: Callable, forward_shapes: list[tuple]
) -> None:
    lm = make_lm(timeout=0.01, max_batch_tokens=12)
    prompts = [[100 * n + i for i in range(n)] for n in (2, 9, 3, 4, 20, 1, 5)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    assert all(rows * width <= 12 or rows == 1 for rows, width, _ in forward_shapes)
    assert (1, 20, 0) in forward_shapes  # longer than the limit: runs alone
    assert sum(rows for rows, _, _ in forward_shapes) == len(prompts)
    assert_matches_uncached(lm, prompts, rows)


@pytest.mark.parametrize(
    ("split", "costs", "forwards"),
    [
        (True, (0.0, 0.001), [(4, 8), (4, 1)]),
        (True, (0.05, 0.000001), [(8, 8)]),
        (True, None, [(8, 8)]),
        (False, (0.0, 0.001), [(8, 8)]),
    ],
    ids=["time-follows-slots", "fixed-cost-dominates", "not-fitted", "off"],
)
async def test_decode_rows_beside_prompts_run_on_their_own_where_that_is_faster(
    make_lm: Callable,
    forward_shapes: list[tuple],
    tiny_model: Any,
    monkeypatch: Any,
    split: bool,
    costs: tuple[float, float] | None,
    forwards: list[tuple[int, int]],
) -> None:
    lm = make_lm(timeout=0.05, shape_split=split)
    if split:
        monkeypatch.setattr(lm.shape_split, "costs", lambda: costs)
    else:
        assert lm.shape_split is None
    stems = [[7, 11 + i, 13, 17, 19] for i in range(4)]
    await lm.batch_next_token_logprobs(stems)  # their KV is stored: extensions decode one token
    forward_shapes.clear()
    decode = [stem + [23] for stem in stems]
    prompts = [[100 + 10 * i + j for j in range(8)] for i in range(4)]
    patch_forward(tiny_model, monkeypatch, lambda ids: time.sleep(0.1))
    loop = asyncio.get_running_loop()
    done_at: dict[int, float] = {}
    calls = [asyncio.create_task(lm.next_token_logprobs(p)) for p in decode + prompts]
    for i, call in enumerate(calls):
        call.add_done_callback(lambda _, i=i: done_at.setdefault(i, loop.time()))
    rows = await asyncio.gather(*calls)
    assert [(n, width) for n, width, _ in forward_shapes] == forwards
    assert lm.stats.shape_splits == len(forwards) - 1
    decoded_s, prompted_s = min(done_at[i] for i in range(4)), max(done_at[i] for i in range(4, 8))
    # split, the prompts are answered first: the decode rows end the batch, in a forward of
    # their own (their callers' next calls come back while the backend waits for them)
    assert (decoded_s - prompted_s > 0.05) == (len(forwards) == 2)
    assert_matches_uncached(lm, decode + prompts, rows)


async def test_a_cancelled_split_batch_fails_every_query_of_both_forwards(
    make_lm: Callable, tiny_model: Any, monkeypatch: Any
) -> None:
    lm = make_lm(timeout=0.05)  # splitting by default, where the fit says it pays
    monkeypatch.setattr(lm.shape_split, "costs", lambda: (0.0, 0.001))
    await lm.batch_next_token_logprobs([[5, 6, 7]])
    patch_forward(tiny_model, monkeypatch, lambda ids: time.sleep(0.2))
    calls = [asyncio.create_task(lm.next_token_logprobs(p)) for p in ([5, 6, 7, 8], [9] * 8)]
    await asyncio.sleep(0.1)  # the first (the prompt's) forward runs
    for task in list(lm._forwards):
        task.cancel()
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        assert isinstance(outcome, Cancelled)
    await asyncio.sleep(0.15)  # the forward thread finishes the forward it had begun
    assert torch.allclose(  # and the backend keeps serving
        await lm.next_token_logprobs([5, 6, 7, 8]),
        lm.next_token_logprobs_uncached([5, 6, 7, 8]),
        atol=TOLERANCE,
        rtol=0,
    )


async def test_queries_arriving_during_a_forward_go_into_the_next_one(
    make_lm: Callable, forward_shapes: list[tuple], tiny_model: Any, monkeypatch: Any
) -> None:
    patch_forward(tiny_model, monkeypatch, lambda ids: time.sleep(0.1))
    lm = make_lm(timeout=0.0)
    first = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.03)  # the first forward is running
    later = [asyncio.create_task(lm.next_token_logprobs([3, i])) for i in range(3)]
    await asyncio.gather(first, *later)
    assert [rows for rows, _, _ in forward_shapes] == [1, 3]


# -- faults and the event loop ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "oom", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("out of memory (fake)")]
)
async def test_out_of_memory_splits_the_batch_until_it_fits(
    make_lm: Callable, tiny_model: Any, monkeypatch: Any, oom: Exception
) -> None:
    sizes: list[int] = []

    def limit_rows(ids: torch.Tensor) -> None:
        if ids.shape[0] > 2:
            raise oom
        sizes.append(ids.shape[0])

    patch_forward(tiny_model, monkeypatch, limit_rows)
    lm = make_lm(timeout=0.01)
    prompts = [[i, i + 1, i + 2] for i in range(7)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    assert sum(sizes) == 7 and max(sizes) <= 2 and lm.stats.oom_splits >= 3
    assert_matches_uncached(lm, prompts, rows)


async def test_a_single_row_out_of_memory_fails_that_query_with_model_error(
    make_lm: Callable, tiny_model: Any, monkeypatch: Any
) -> None:
    def refuse_long(ids: torch.Tensor) -> None:
        if ids.shape[1] > 10:
            raise torch.OutOfMemoryError("CUDA out of memory")

    patch_forward(tiny_model, monkeypatch, refuse_long)
    lm = make_lm(timeout=0.01, max_batch_tokens=10)
    short, long = await asyncio.gather(
        lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([3] * 11), return_exceptions=True
    )
    assert isinstance(long, ModelError) and isinstance(long.__cause__, torch.OutOfMemoryError)
    assert_matches_uncached(lm, [[1, 2]], [short])


async def test_a_failing_forward_fails_exactly_its_queries_and_the_backend_keeps_serving(
    make_lm: Callable, tiny_model: Any, monkeypatch: Any
) -> None:
    def poison(ids: torch.Tensor) -> None:
        if (ids == 666).any():
            raise RuntimeError("kernel exploded")

    patch_forward(tiny_model, monkeypatch, poison)
    lm = make_lm(timeout=0.01, batch_size=3)
    prompts = [[1, 666], [2, 3], [4, 5], [6, 7], [8, 9]]  # first forward: rows 0-2
    results = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in prompts), return_exceptions=True
    )
    assert all(isinstance(r, ModelError) for r in results[:3])
    assert isinstance(results[0].__cause__, RuntimeError)
    assert_matches_uncached(lm, prompts[3:], results[3:])
    assert_matches_uncached(lm, [[2, 3]], [await lm.next_token_logprobs([2, 3])])
    with pytest.raises(ModelError):
        lm.next_token_logprobs_sync([666])


async def test_the_event_loop_keeps_running_during_a_slow_forward(
    make_lm: Callable, tiny_model: Any, monkeypatch: Any
) -> None:
    patch_forward(tiny_model, monkeypatch, lambda ids: time.sleep(0.3))
    lm = make_lm(timeout=0.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    await lm.next_token_logprobs([1, 2, 3])
    ticking.cancel()
    assert ticks >= 10


async def test_reset_async_queries_fails_queued_queries_with_cancelled(
    make_lm: Callable,
) -> None:
    lm = make_lm(timeout=30.0)
    tasks = [asyncio.create_task(lm.next_token_logprobs([i, 1])) for i in range(4)]
    await asyncio.sleep(0)
    lm.reset_async_queries()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, Cancelled) for r in results)
    lm.timeout = 0.0
    assert_matches_uncached(lm, [[0, 1]], [await lm.next_token_logprobs([0, 1])])


async def test_a_caller_that_cancels_does_not_cancel_an_identical_query(
    make_lm: Callable,
) -> None:
    lm = make_lm(timeout=0.02)
    leaving = asyncio.create_task(lm.next_token_logprobs([4, 5]))
    staying = asyncio.create_task(lm.next_token_logprobs([4, 5]))
    await asyncio.sleep(0)
    leaving.cancel()
    assert_matches_uncached(lm, [[4, 5]], [await staying])
    assert leaving.cancelled()


async def test_aclose_cancels_queued_queries_and_refuses_new_ones(make_lm: Callable) -> None:
    lm = make_lm(timeout=30.0)
    queued = asyncio.create_task(lm.next_token_logprobs([1]))
    await asyncio.sleep(0)
    await lm.aclose()
    with pytest.raises(Cancelled):
        await queued
    with pytest.raises(Cancelled):
        await lm.next_token_logprobs([1])


# -- inputs, caches, loading -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([], EmptyPrompt),
        ([1.5, 2], TokenOutOfVocabulary),
        ([-1], TokenOutOfVocabulary),
        ([49152], TokenOutOfVocabulary),
        ("abc", TokenOutOfVocabulary),
        ([1] * 513, PromptTooLong),
    ],
)
async def test_bad_prompts_raise_typed_errors(
    make_lm: Callable, prompt: Any, error: type[Exception]
) -> None:
    lm = make_lm()
    with pytest.raises(error):
        await lm.next_token_logprobs(prompt)
    for call in (lm.next_token_logprobs_sync, lm.next_token_logprobs_uncached, lm.cache_kv):
        with pytest.raises(error):
            call(prompt)


async def test_an_adapter_name_is_a_bad_request(make_lm: Callable) -> None:
    with pytest.raises(BadRequest, match="LoRA"):
        await make_lm().next_token_logprobs([1], lora_name="x")


async def test_clearing_the_kv_keeps_results_and_clearing_the_cache_drops_them(
    make_lm: Callable,
) -> None:
    lm = make_lm(timeout=0.0)
    row = await lm.next_token_logprobs([1, 2, 3])
    lm.clear_kv_cache()
    assert lm.cache.kv_tokens == 0 and await lm.next_token_logprobs([1, 2, 3]) is row
    lm.clear_cache()
    assert lm.cache.num_results == 0
    assert torch.equal(await lm.next_token_logprobs([1, 2, 3]), row)


async def test_model_limits_and_revision_are_published(make_lm: Callable) -> None:
    lm = make_lm(revision="r1")
    assert (lm.vector_size, lm.max_prompt_tokens, lm.revision) == (49152, 512, "r1")


def test_from_name_loads_the_model_and_names_its_revision(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmqueue.workers.models as models

    loaded: list[dict[str, Any]] = []
    real_load = models.load_causal_lm
    monkeypatch.setattr(
        models, "load_causal_lm", lambda name, opts: loaded.append(opts) or real_load(name, {})
    )
    plain = AsyncTransformer.from_name(str(tiny_model_dir))
    quantized = AsyncTransformer.from_name(
        str(tiny_model_dir),
        engine_opts={"dtype": "float32"},
        bitsandbytes_opts={"load_in_8bit": True},
    )
    assert plain.revision == models.resolve_model(str(tiny_model_dir)).revision
    assert quantized.revision.startswith(plain.revision + "+")
    assert type(loaded[1]["quantization_config"]).__name__ == "BitsAndBytesConfig"
    assert loaded[1]["dtype"] == "float32"
    for lm in (plain, quantized):
        assert_matches_uncached(lm, [[1, 2]], [lm.next_token_logprobs_sync([1, 2])])
        asyncio.run(lm.aclose())


@pytest.mark.slow
async def test_smollm2_batches_reusing_kv_match_its_uncached_forward(
    smol_tokenizer: Any, vocab: dict[str, Any]
) -> None:
    from lmqueue.workers.models import load_causal_lm

    lm = AsyncTransformer(load_causal_lm("smollm2-135m"), smol_tokenizer, timeout=0.005, **vocab)
    try:
        stem = smol_tokenizer.encode("The capital of France is")
        prompts = [stem, stem[:2], stem + [12], stem[:3] + [5, 6, 7]]
        for step in range(2):
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            assert_matches_uncached(lm, prompts, rows)
            prompts = [p + [100 + step] for p in prompts]
    finally:
        await lm.aclose()
