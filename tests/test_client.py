"""QueueLM against a real redis-server and a worker serving from its own thread."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from lmqueue.producer import QueueLM
from lmqueue.shared.errors import (
    BadRequest,
    Busy,
    Cancelled,
    DeadlineExceeded,
    EmptyPrompt,
    PromptTooLong,
    TokenOutOfVocabulary,
    Unavailable,
    UnknownModel,
)
from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker


@pytest.fixture
def backend(smol_tokenizer):
    return MockAsyncLM(smol_tokenizer)


@pytest.fixture
def worker(backend, redis_url):
    served = ThreadedWorker(backend, redis_url).start()
    yield served
    served.stop()


@pytest.fixture
async def lm(worker, redis_url):
    client = await QueueLM.connect("mock", redis_url=redis_url, timeout_s=20)
    yield client
    await client.close()


async def test_results_equal_the_backends_own(lm, backend):
    prompts = [[1, 2, n] for n in range(50)]
    out = await lm.batch_next_token_logprobs(prompts)
    assert out.shape == (50, 49152) and out.dtype == torch.float32
    expected = torch.stack([backend.logprobs_of(p) for p in prompts])
    assert torch.equal(out, expected)


async def test_the_client_exposes_the_models_vocabulary(lm, smol_tokenizer, backend):
    assert lm.byte_vocab == backend.byte_vocab
    assert [bytes(t) for t in lm.byte_vocab[:100]] == [bytes(t) for t in backend.byte_vocab[:100]]
    assert lm.str_vocab == backend.str_vocab
    assert lm.tokenizer.encode("a cat") == smol_tokenizer.encode("a cat")


async def test_numpy_results_equal_the_tensors_and_share_the_local_cache(lm, backend):
    arrays = await lm.batch_next_token_logprobs_numpy([[1, 2, 3], [4, 5]])
    assert arrays.shape == (2, 49152) and arrays.dtype == np.float32
    assert np.array_equal(arrays[0], backend.logprobs_of([1, 2, 3]).numpy())
    tensor = await lm.next_token_logprobs([4, 5])  # cached as an array, handed out as a tensor
    assert lm.stats["sent"] == 2
    assert tensor.dtype == torch.float32 and np.array_equal(tensor.numpy(), arrays[1])
    again = await lm.next_token_logprobs_numpy([4, 5])
    assert np.array_equal(again, arrays[1]) and lm.stats["sent"] == 2


async def test_float16_arrives_as_float32_arrays_too(worker, redis_url, backend):
    async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype="float16") as lm:
        out = await lm.next_token_logprobs_numpy([9, 8])
    assert out.dtype == np.float32 and out.flags.writeable
    assert np.abs(out - backend.logprobs_of([9, 8]).numpy()).max() < 0.01


def test_a_client_process_on_numpy_never_imports_torch_or_transformers(worker, redis_url):
    """A program that asks for arrays pays for neither (~250 MiB of RSS between them)."""
    import subprocess
    import sys

    code = (
        "import asyncio, sys\n"
        "from producer import QueueLM\n"
        "async def main():\n"
        "    async with await QueueLM.connect('mock', redis_url=sys.argv[1]) as lm:\n"
        "        ids = lm.tokenizer.encode('a cat', add_special_tokens=False)\n"
        "        rows = await lm.batch_next_token_logprobs_numpy([ids, ids + [5]])\n"
        "        print(rows.shape[0], lm.tokenizer.decode(ids))\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, redis_url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["2 a cat", "[]"]


async def test_float16_on_the_wire_is_handed_out_as_float32(worker, redis_url, backend):
    async with await QueueLM.connect("mock", redis_url=redis_url, wire_dtype="float16") as lm:
        out = await lm.next_token_logprobs([9, 9])
    assert out.dtype == torch.float32
    assert (out - backend.logprobs_of([9, 9])).abs().max() < 0.01


async def test_half_results_are_the_float16_vectors_as_they_travelled(worker, redis_url, backend):
    """With ``half_results`` nothing is widened: tensors and arrays are float16, the backend's
    float32 rows rounded to nearest even once (by the worker), each caller's own memory."""
    prompts = [[9, 7, n] for n in range(6)]
    expected = torch.stack([backend.logprobs_of(p).to(torch.float16) for p in prompts])
    async with await QueueLM.connect(
        "mock", redis_url=redis_url, wire_dtype="float16", half_results=True
    ) as lm:
        out = await lm.batch_next_token_logprobs(prompts)
        twins = await asyncio.gather(*(lm.next_token_logprobs([4, 4, 4]) for _ in range(3)))
        arrays = await lm.batch_next_token_logprobs_numpy([[8, 1], prompts[0]])
        empty = await lm.batch_next_token_logprobs_numpy([])
    assert out.dtype == torch.float16 and torch.equal(out, expected)
    assert all(t.dtype == torch.float16 for t in twins)
    assert all(torch.equal(t, backend.logprobs_of([4, 4, 4]).half()) for t in twins)
    assert len({t.data_ptr() for t in twins}) == 3  # joined callers get copies
    assert arrays.dtype == np.float16 and arrays.flags.writeable
    assert np.array_equal(arrays[0], backend.logprobs_of([8, 1]).numpy().astype(np.float16))
    assert np.array_equal(arrays[1], expected[0].numpy())  # from the local cache
    assert empty.shape == (0, 49152) and empty.dtype == np.float16


async def test_identical_concurrent_calls_share_one_request(lm):
    results = await asyncio.gather(*(lm.next_token_logprobs([4, 2]) for _ in range(20)))
    assert lm.stats["sent"] == 1
    assert all(torch.equal(r, results[0]) for r in results)


async def test_a_shared_cache_hit_never_reaches_a_worker(worker, redis_url, lm, backend):
    await lm.next_token_logprobs([7, 7, 7])
    computed = len(backend.batch_sizes)
    async with await QueueLM.connect("mock", redis_url=redis_url) as other:
        out = await other.next_token_logprobs([7, 7, 7])
        assert other.stats == {**other.stats, "sent": 0, "cache_hits": 1}
    await asyncio.sleep(0.2)
    assert len(backend.batch_sizes) == computed
    assert torch.equal(out, backend.logprobs_of([7, 7, 7]))


async def test_the_local_cache_answers_repeats_without_redis(lm):
    await lm.next_token_logprobs([3, 1])
    await lm.next_token_logprobs([3, 1])
    assert lm.stats["sent"] == 1 and len(lm.local_cache) == 1
    lm.clear_cache()
    assert len(lm.local_cache) == 0


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([], EmptyPrompt),
        ([49152], TokenOutOfVocabulary),
        ([1.5], TokenOutOfVocabulary),
        ([[1, 2]], TokenOutOfVocabulary),
        ([1] * 9000, PromptTooLong),
    ],
)
async def test_bad_prompts_fail_at_once_with_typed_errors(lm, tokens, error):
    lm.info = type(lm.info)(**{**lm.info.__dict__, "max_prompt_tokens": 8192})
    with pytest.raises(error):
        await lm.next_token_logprobs(tokens)
    assert lm.stats["sent"] == 0


async def test_an_adapter_no_worker_serves_is_refused_as_a_bad_request(lm):
    with pytest.raises(BadRequest, match="LoRA adapter 'style' is not served"):
        await lm.next_token_logprobs([1], lora_name="style")


async def test_connecting_to_an_unknown_model_fails_with_unknown_model(worker, redis_url):
    with pytest.raises(UnknownModel, match="nope") as caught:
        await QueueLM.connect("nope", redis_url=redis_url, connect_timeout_s=0.3)
    assert caught.value.data["known"] == ["mock"]


async def test_connect_rides_out_redis_loading_its_data_mid_connect(
    worker, redis_url, backend, monkeypatch
):
    """Found by ``lmq bench soak``: an experiment connecting as the queue Redis restarted from
    its AOF failed with `Unavailable` (``BusyLoadingError`` reading the adapters), well within
    its connect timeout; connect now tries again until that timeout."""
    from redis.exceptions import BusyLoadingError

    from lmqueue.producer.adapter_choice import AdapterChoice

    refresh, calls = AdapterChoice.refresh, []

    async def loading_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise BusyLoadingError("Redis is loading the dataset in memory")
        return await refresh(self)

    monkeypatch.setattr(AdapterChoice, "refresh", loading_once)
    async with await QueueLM.connect("mock", redis_url=redis_url, connect_timeout_s=10) as lm:
        row = await lm.next_token_logprobs([1, 2, 3])
    assert len(calls) == 2 and torch.equal(row, backend.logprobs_of([1, 2, 3]))
    calls.clear()
    with pytest.raises(Unavailable):  # an outage longer than the timeout still ends it
        monkeypatch.setattr(AdapterChoice, "refresh", _always_loading)
        await QueueLM.connect("mock", redis_url=redis_url, connect_timeout_s=0.5)


async def _always_loading(self):
    from redis.exceptions import BusyLoadingError

    raise BusyLoadingError("Redis is loading the dataset in memory")


async def test_a_request_without_a_worker_fails_at_its_deadline(backend, redis_url):
    served = ThreadedWorker(backend, redis_url).start()
    served.stop()  # published, then gone
    async with await QueueLM.connect("mock", redis_url=redis_url, timeout_s=0.5) as lm:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(DeadlineExceeded):
            await lm.next_token_logprobs([1, 2, 3])
        assert 0.45 < loop.time() - started < 2.0
        assert len(lm.channel.inflight) == 0


async def test_cancelling_one_waiter_leaves_the_others_waiting(backend, redis_url, smol_tokenizer):
    slow = MockAsyncLM(smol_tokenizer, batch_delay_s=0.4)
    served = ThreadedWorker(slow, redis_url).start()
    try:
        async with await QueueLM.connect("mock", redis_url=redis_url) as lm:
            first = asyncio.ensure_future(lm.next_token_logprobs([5, 5]))
            second = asyncio.ensure_future(lm.next_token_logprobs([5, 5]))
            await asyncio.sleep(0.1)
            first.cancel()
            out = await second
            assert first.cancelled() and out.shape == (49152,)
            lone = asyncio.ensure_future(lm.next_token_logprobs([6, 6]))
            await asyncio.sleep(0.05)
            lone.cancel()
            await asyncio.sleep(0.6)  # its reply arrives and is ignored
            assert len(lm.channel.inflight) == 0
    finally:
        served.stop()


async def test_closing_the_client_fails_pending_requests_with_cancelled(
    backend, redis_url, smol_tokenizer
):
    slow = MockAsyncLM(smol_tokenizer, batch_delay_s=1.0)
    served = ThreadedWorker(slow, redis_url).start()
    try:
        lm = await QueueLM.connect("mock", redis_url=redis_url)
        pending = asyncio.ensure_future(lm.next_token_logprobs([8, 1]))
        await asyncio.sleep(0.1)
        await lm.close()
        with pytest.raises(Cancelled):
            await pending
        with pytest.raises(Cancelled):
            await lm.next_token_logprobs([8, 2])
    finally:
        served.stop()


async def test_new_requests_fail_fast_with_busy_past_the_backlog_bound(backend, redis_url):
    served = ThreadedWorker(backend, redis_url).start()
    served.stop()  # nobody drains the stream
    async with await QueueLM.connect("mock", redis_url=redis_url, max_backlog=5) as lm:
        accepted = [asyncio.ensure_future(lm.next_token_logprobs([1, n])) for n in range(5)]
        await asyncio.sleep(0.1)
        with pytest.raises(Busy) as caught:
            await lm.next_token_logprobs([2, 2])
        assert caught.value.data == {"backlog": 5, "bound": 5}
        for future in accepted:
            future.cancel()


async def test_sync_calls_work_from_a_thread_and_from_inside_the_loop(lm, backend):
    from_thread = await asyncio.to_thread(lm.next_token_logprobs_sync, [1, 9])
    in_loop = lm.batch_next_token_logprobs_sync([[1, 9], [2, 9]])  # blocks this loop: portal
    assert torch.equal(from_thread, backend.logprobs_of([1, 9]))
    assert torch.equal(in_loop[1], backend.logprobs_of([2, 9]))


def test_a_synchronous_program_can_use_connect_sync(worker, redis_url, backend):
    lm = QueueLM.connect_sync("mock", redis_url=redis_url)
    try:
        out = lm.next_token_logprobs_sync([4, 4, 4])
        assert torch.equal(out, backend.logprobs_of([4, 4, 4]))
        assert threading.current_thread() is threading.main_thread()
    finally:
        lm.close_sync()


async def test_hundreds_of_concurrent_futures_resolve_exactly_once(lm, backend):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 49152, size=int(rng.integers(1, 30))).tolist() for _ in range(600)]
    out = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts[::37], out[::37], strict=True):
        assert torch.equal(row, backend.logprobs_of(prompt))
    assert lm.channel.inflight.resolved == lm.stats["sent"] and lm.stats["duplicate_replies"] == 0
