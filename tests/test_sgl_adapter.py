"""The SGLang adapter without a GPU: batching, prompt sharing, reset and error paths.

`FakeScheduler` has the methods and attributes of sglang 0.5.17's ``Scheduler`` that the
backend drives (``process_input_requests``, ``get_next_batch_to_run``, ``run_batch``,
``process_batch_result``, ``flush_cache``, ``running_batch``/``last_batch``, the stream and
config attributes), chunks long prompts across batches, and reuses one logits buffer between
batches as SGLang's logits processor does.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmqueue.shared.errors import Cancelled, EmptyPrompt, ModelError, PromptTooLong
from lmqueue.shared.lm.tokens import Token
from lmqueue.workers.backends import engine_imports
from lmqueue.workers.backends.engine_imports import SGLANG, MissingEngine, SGLEngine, import_engine
from lmqueue.workers.backends.sgl import AsyncSGLTransformer

VOCAB = 24


def fake_logits(tokens: list[int]) -> torch.Tensor:
    """Deterministic logits of a prefix (a partial chunk gets different ones)."""
    generator = torch.Generator().manual_seed(hash(tuple(tokens)) % (2**31))
    return torch.randn(VOCAB, generator=generator) * 3


def expected(tokens: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.log_softmax(fake_logits(list(tokens)), dim=-1)


class FINISH_LENGTH:  # noqa: N801 - SGLang's class names, which the backend reads
    def __init__(self, length: int) -> None:
        self.length = length


class FINISH_ABORT:  # noqa: N801
    def __init__(self, message: str) -> None:
        self.message = message


@dataclass
class FakeReq:
    """The parts of SGLang's ``Req`` the backend reads: rid, finished(), finished_reason."""

    rid: str
    ids: list[int]
    computed: int = 0
    finished_reason: Any = None

    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass
class FakeBatch:
    reqs: list[FakeReq]
    takes: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reqs


class FakeScheduler:
    """A ``Scheduler`` for prefill-only requests: batches of at most `max_batch` requests and
    `chunk` tokens per request per batch, each row of the shared logits buffer belonging to
    ``batch.reqs[i]``."""

    def __init__(self, chunk: int = 4, max_batch: int = 3) -> None:
        self.chunk, self.max_batch = chunk, max_batch
        self.model_config = SimpleNamespace(vocab_size=VOCAB, dtype="torch.float32")
        self.max_req_input_len = 30
        self.device_module = SimpleNamespace(StreamContext=lambda stream: nullcontext())
        self.schedule_stream = object()
        self.running_batch = FakeBatch([])
        self.last_batch: FakeBatch | None = None
        self.cur_batch_for_debug: FakeBatch | None = None
        self.waiting: list[FakeReq] = []
        self.buffer = torch.empty(max_batch + 1, VOCAB)
        self.received: list[list[str]] = []
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: Exception | None = None
        self.abort: set[str] = set()
        self.stale: FakeReq | None = None  # a finished request put into the next batch

    def process_input_requests(self, recv_reqs: list[Any]) -> None:
        self.received.append([r.rid for r in recv_reqs])
        self.waiting.extend(FakeReq(r.rid, list(r.input_ids)) for r in recv_reqs)

    def get_next_batch_to_run(self, running_batch: Any, last_batch: Any) -> Any:
        assert running_batch is self.running_batch and last_batch is self.last_batch
        reqs = self.waiting[: self.max_batch]
        if self.stale is not None and reqs:
            reqs, self.stale = [*reqs, self.stale], None
        if not reqs:
            return SimpleNamespace(running_batch=running_batch, batch_to_run=None)
        takes = [0 if r.finished() else min(self.chunk, len(r.ids) - r.computed) for r in reqs]
        return SimpleNamespace(running_batch=running_batch, batch_to_run=FakeBatch(reqs, takes))

    def run_batch(self, batch: FakeBatch) -> Any:
        self.threads.add(threading.current_thread().name)
        self.gate.wait(5)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self.batches.append([r.rid for r in batch.reqs])
        for i, (req, take) in enumerate(zip(batch.reqs, batch.takes, strict=True)):
            self.buffer[i] = fake_logits(req.ids[: req.computed + take])
        logits = self.buffer[: len(batch.reqs)]  # SGLang's logits buffer, reused next batch
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits))

    def process_batch_result(self, batch: FakeBatch, result: Any) -> None:
        for req, take in zip(batch.reqs, batch.takes, strict=True):
            if req.finished():
                continue
            req.computed += take
            if req.computed == len(req.ids):
                abort = req.rid in self.abort
                req.finished_reason = FINISH_ABORT("KV cache full") if abort else FINISH_LENGTH(0)
                self.waiting.remove(req)

    def flush_cache(self) -> bool:
        return not self.waiting and (self.last_batch is None or self.last_batch.is_empty())


def make_request(rid: str, key: tuple[int, ...]) -> Any:
    """What sglang's TokenizedGenerateReqInput carries that the fake reads."""
    return SimpleNamespace(rid=rid, input_ids=list(key))


def _vocab() -> dict[str, Any]:
    return {
        "byte_vocab": [Token(i, bytes([97 + i])) for i in range(VOCAB)],
        "str_vocab": [chr(97 + i) for i in range(VOCAB)],
    }


@pytest.fixture
async def backend() -> Any:
    """A factory of AsyncSGLTransformer over a FakeScheduler; closes what it built."""
    built: list[AsyncSGLTransformer] = []

    def make(**kwargs: Any) -> tuple[AsyncSGLTransformer, FakeScheduler]:
        sched = FakeScheduler(**kwargs.pop("scheduler", {}))
        handle = SGLEngine(sched, make_request, revision="fake")
        lm = AsyncSGLTransformer(handle, None, **kwargs, **_vocab())
        built.append(lm)
        return lm, sched

    yield make
    for lm in built:
        await lm.aclose()


prompts = [(1,), (1, 2), (3, 4, 5, 6, 7, 8, 9, 10, 11), (5,) * 13, (2, 7, 1, 8)]


async def test_concurrent_queries_are_drained_into_one_admission(backend: Any) -> None:
    lm, sched = backend()
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))
    assert len(sched.received) == 1 and len(sched.received[0]) == len(prompts)
    assert sched.threads == {"lmq-sgl_0"}  # the forward ran off the event loop thread


async def test_a_chunked_prompt_gets_the_row_of_its_last_chunk(backend: Any) -> None:
    lm, sched = backend(scheduler={"chunk": 3})
    long = tuple(range(1, 20))
    torch.testing.assert_close(await lm.next_token_logprobs(long), expected(long))
    assert len(sched.batches) == 7  # 19 tokens, 3 per batch


async def test_identical_queued_prompts_are_computed_once(backend: Any) -> None:
    lm, sched = backend()
    rows = await asyncio.gather(*(lm.next_token_logprobs([4, 2]) for _ in range(6)))
    assert sched.received == [[sched.received[0][0]]]
    assert all(row is rows[0] for row in rows)


async def test_a_prompt_arriving_while_in_flight_joins_that_computation(backend: Any) -> None:
    lm, sched = backend()
    sched.gate.clear()
    first = asyncio.create_task(lm.next_token_logprobs([3, 1]))
    while not sched.threads:
        await asyncio.sleep(0.005)
    second = asyncio.create_task(lm.next_token_logprobs([3, 1]))
    await asyncio.sleep(0.01)
    sched.gate.set()
    assert (await first) is (await second)
    assert sum(len(rids) for rids in sched.received) == 1


async def test_queries_arriving_during_a_batch_form_the_next_one(backend: Any) -> None:
    lm, sched = backend()
    sched.gate.clear()
    first = asyncio.create_task(lm.next_token_logprobs([1]))
    while not sched.threads:
        await asyncio.sleep(0.005)
    later = [asyncio.create_task(lm.next_token_logprobs([i, i])) for i in range(2, 5)]
    await asyncio.sleep(0.01)
    sched.gate.set()
    await asyncio.gather(first, *later)
    assert [len(rids) for rids in sched.received] == [1, 3]


async def test_the_output_cache_answers_repeats(backend: Any) -> None:
    lm, sched = backend(cache_size=8)
    first = await lm.next_token_logprobs([1, 2])
    assert await lm.next_token_logprobs([1, 2]) is first
    lm.clear_cache()
    await lm.next_token_logprobs([1, 2])
    assert len(sched.received) == 2


async def test_reset_fails_queued_and_in_flight_queries_with_cancelled(backend: Any) -> None:
    lm, sched = backend()
    sched.gate.clear()
    running = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    while not sched.threads:
        await asyncio.sleep(0.005)
    queued = asyncio.create_task(lm.next_token_logprobs([5, 6]))
    await asyncio.sleep(0.01)
    lm.reset_async_queries()
    for task in (running, queued):
        with pytest.raises(Cancelled):
            await task
    sched.gate.set()
    torch.testing.assert_close(await lm.next_token_logprobs([5, 6]), expected([5, 6]))


async def test_a_failed_batch_fails_its_queries_with_model_error(backend: Any) -> None:
    lm, sched = backend()
    sched.fail_next = RuntimeError("CUDA out of memory")
    results = await asyncio.gather(
        lm.next_token_logprobs([1]), lm.next_token_logprobs([2]), return_exceptions=True
    )
    assert all(isinstance(r, ModelError) for r in results)
    assert isinstance(results[0].__cause__, RuntimeError)
    torch.testing.assert_close(await lm.next_token_logprobs([1]), expected([1]))


async def test_an_aborted_request_is_a_model_error_and_spares_the_others(backend: Any) -> None:
    lm, sched = backend()
    sched.abort = {"lmq-0"}
    bad: Any
    good: Any
    bad, good = await asyncio.gather(
        lm.next_token_logprobs([7, 7]), lm.next_token_logprobs([8, 8]), return_exceptions=True
    )
    assert isinstance(bad, ModelError) and "KV cache full" in str(bad)
    torch.testing.assert_close(good, expected([8, 8]))


async def test_a_request_finished_before_its_batch_gets_no_stale_row(backend: Any) -> None:
    lm, sched = backend()
    await lm.next_token_logprobs([1, 2, 3])
    finished = FakeReq("lmq-1", [9], computed=1, finished_reason=FINISH_LENGTH(0))
    sched.stale = finished  # e.g. a decode request of a mixed batch; must not be delivered
    row = await lm.next_token_logprobs([4, 5])
    torch.testing.assert_close(row, expected([4, 5]))


async def test_the_sync_batch_computes_each_prompt_once_in_order(backend: Any) -> None:
    lm, sched = backend(cache_size=8)
    batch = [prompts[2], prompts[0], prompts[2], prompts[3]]
    rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, batch)
    assert rows.shape == (4, VOCAB) and sched.received == [sched.received[0]]
    assert len(sched.received[0]) == 3
    for prompt, row in zip(batch, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))
    single = await asyncio.to_thread(lm.next_token_logprobs_sync, prompts[0])
    assert torch.equal(single, rows[1]) and len(sched.received) == 1  # from the cache


async def test_the_sync_path_raises_the_error_of_a_failed_batch(backend: Any) -> None:
    lm, sched = backend()
    sched.fail_next = RuntimeError("boom")
    with pytest.raises(ModelError, match="boom") as raised:
        await asyncio.to_thread(lm.next_token_logprobs_sync, [1])
    assert isinstance(raised.value.__cause__, RuntimeError)


async def test_prompts_are_validated_against_the_scheduler_limits(backend: Any) -> None:
    lm, sched = backend()
    assert (lm.vector_size, lm.max_prompt_tokens) == (VOCAB, 29)
    with pytest.raises(PromptTooLong):
        await lm.next_token_logprobs([1] * 30)
    with pytest.raises(EmptyPrompt):
        await lm.next_token_logprobs([])
    assert sched.received == []


async def test_clear_kv_cache_flushes_the_scheduler_when_idle(backend: Any) -> None:
    lm, sched = backend()
    await lm.next_token_logprobs([1, 2])
    assert await asyncio.to_thread(lm.clear_kv_cache) is True
    assert sched.last_batch is None  # the drain ended the way SGLang's loop does


async def test_aclose_fails_queued_queries_and_refuses_new_ones(backend: Any) -> None:
    lm, sched = backend()
    sched.gate.clear()
    running = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    while not sched.threads:
        await asyncio.sleep(0.005)
    closing = asyncio.create_task(lm.aclose())
    await asyncio.sleep(0.01)
    sched.gate.set()
    await closing
    with pytest.raises(Cancelled):
        await running
    with pytest.raises(Cancelled):
        await lm.next_token_logprobs([1])


async def test_a_cancelled_caller_does_not_cancel_others_waiting_for_the_prompt(
    backend: Any,
) -> None:
    lm, sched = backend()
    sched.gate.clear()
    first = asyncio.create_task(lm.next_token_logprobs([6, 6]))
    second = asyncio.create_task(lm.next_token_logprobs([6, 6]))
    while not sched.threads:
        await asyncio.sleep(0.005)
    first.cancel()
    sched.gate.set()
    torch.testing.assert_close(await second, expected([6, 6]))
    assert first.cancelled()


def test_missing_sglang_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_imports, "installed_version", lambda spec: None)
    with pytest.raises(MissingEngine, match=r"pip install 'lmqueue\[sgl\]'"):
        import_engine(SGLANG, "sglang")
    with pytest.raises(ImportError):  # MissingEngine is an ImportError
        AsyncSGLTransformer.from_name("some/model")


async def test_a_prompt_sglang_cannot_take_fails_alone_with_model_error(backend: Any) -> None:
    lm, sched = backend()

    def picky(rid: str, key: tuple[int, ...]) -> Any:
        if key == (9, 9):
            raise TypeError("input_ids must be an int64 array")
        return make_request(rid, key)

    lm._handle = SGLEngine(sched, picky)
    bad: Any
    good: Any
    bad, good = await asyncio.gather(
        lm.next_token_logprobs([9, 9]), lm.next_token_logprobs([3]), return_exceptions=True
    )
    assert isinstance(bad, ModelError) and isinstance(bad.__cause__, TypeError)
    torch.testing.assert_close(good, expected([3]))
