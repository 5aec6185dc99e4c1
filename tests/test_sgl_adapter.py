"""The SGLang adapter without a GPU: capture through shared memory, batching, sharing, errors.

UNVERIFIED on a real engine (SGLang needs CUDA). `FakeSGLEngine` has the methods of sglang
0.5.23's ``Engine`` that the adapter calls (``async_generate``, ``loop``, ``flush_cache``):
it batches concurrent requests, prefills long prompts in chunks and calls the capture
processor on every chunk's logits with each request's ``custom_params``, as SGLang's sampler
does. When SGLang's Python modules import (the engine venv of ``make test-engines``, with
sglang 0.5.23 unpacked into ``.engine-classes/``), the processor also runs through SGLang's own
``CustomLogitProcessor.to_str``/``from_str`` and the option names are checked against its
``ServerArgs`` and ``Engine``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmqueue.shared.errors import BadRequest, Cancelled, EmptyPrompt, ModelError, PromptTooLong
from lmqueue.shared.lm.tokens import Token
from lmqueue.workers.backends import engine_imports
from lmqueue.workers.backends.engine_imports import SGLANG, MissingEngine, import_engine
from lmqueue.workers.backends.sgl import AsyncSGLTransformer
from lmqueue.workers.backends.sgl_capture import (
    SEQ_KEY,
    SHM_KEY,
    SLOT_KEY,
    RowSlots,
    capture_processor_class,
)
from lmqueue.workers.backends.sgl_engine import SGL_DEFAULTS, SGLEngine

VOCAB = 24


def fake_logits(tokens: list[int]) -> torch.Tensor:
    """Deterministic logits of a prefix (a partial chunk gets different ones)."""
    generator = torch.Generator().manual_seed(hash(tuple(tokens)) % (2**31))
    return torch.randn(VOCAB, generator=generator) * 3


def expected(tokens: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.log_softmax(fake_logits(list(tokens)), dim=-1)


class FakeSGLEngine:
    """``sglang.Engine``'s calls: requests arriving together form batches of `max_batch`,
    prompts are prefilled `chunk` tokens per batch, and the processor sees every chunk."""

    def __init__(self, chunk: int = 4, max_batch: int = 3) -> None:
        self.chunk, self.max_batch = chunk, max_batch
        self.loop = asyncio.new_event_loop()
        self.processor = capture_processor_class(object)()
        self.waiting: list[dict[str, Any]] = []
        self.requests: list[list[int]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.refuse: Exception | None = None
        self.abort: set[tuple[int, ...]] = set()
        self.skip_capture = False
        self.flushes = 0
        self._stepping: asyncio.Task[None] | None = None

    async def async_generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], custom_logit_processor: str
    ) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        assert sampling_params["max_new_tokens"] == 1 and custom_logit_processor == "capture"
        if self.refuse is not None:
            raise self.refuse
        self.requests.append(input_ids)
        done = asyncio.get_running_loop().create_future()
        self.waiting.append(
            {"ids": input_ids, "done": 0, "params": sampling_params["custom_params"], "f": done}
        )
        if self._stepping is None:
            self._stepping = asyncio.ensure_future(self._run())
        return await done

    async def _run(self) -> None:
        await asyncio.sleep(0)  # requests sent together arrive together
        while self.waiting:
            self.gate.wait(5)
            batch = self.waiting[: self.max_batch]
            for req in batch:
                req["done"] = min(len(req["ids"]), req["done"] + self.chunk)
            logits = torch.stack([fake_logits(r["ids"][: r["done"]]) for r in batch])
            params = [{**r["params"], "__req__": object()} for r in batch]
            if not self.skip_capture:
                assert self.processor(logits, params) is logits
            for req in [r for r in batch if r["done"] == len(r["ids"])]:
                self.waiting.remove(req)
                kind = "abort" if tuple(req["ids"]) in self.abort else "length"
                req["f"].set_result({"meta_info": {"finish_reason": {"type": kind}}})
            await asyncio.sleep(0)
        self._stepping = None

    def flush_cache(self) -> Any:
        self.flushes += 1
        return SimpleNamespace(success=not self.waiting)


def _vocab() -> dict[str, Any]:
    return {
        "byte_vocab": [Token(i, bytes([97 + i])) for i in range(VOCAB)],
        "str_vocab": [chr(97 + i) for i in range(VOCAB)],
    }


@pytest.fixture
async def backend() -> Any:
    """A factory of AsyncSGLTransformer over a FakeSGLEngine; closes what it built."""
    built: list[AsyncSGLTransformer] = []

    def make(slots: int = 8, **kwargs: Any) -> tuple[AsyncSGLTransformer, FakeSGLEngine]:
        engine = FakeSGLEngine(**kwargs.pop("engine", {}))
        rows = RowSlots(slots, VOCAB)

        def shutdown() -> None:
            engine.loop.close()
            rows.close()

        handle = SGLEngine(engine, rows, "capture", VOCAB, 30, "fake", shutdown)
        lm = AsyncSGLTransformer(handle, None, **kwargs, **_vocab())
        built.append(lm)
        return lm, engine

    yield make
    for lm in built:
        await lm.aclose()


prompts = [[1], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5] * 17, [2, 7, 1, 8]]


async def test_concurrent_queries_get_their_own_rows_from_one_thread(backend: Any) -> None:
    lm, engine = backend()
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts * 2))
    for prompt, row in zip(prompts * 2, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))
    assert len(engine.requests) == len(prompts) and engine.threads == {"lmq-sgl_0"}


async def test_more_prompts_than_capture_slots_are_run_slot_by_slot(backend: Any) -> None:
    lm, engine = backend(slots=2)
    many = [[i, i + 1, i + 2] for i in range(1, 12)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in many))
    for prompt, row in zip(many, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))


async def test_a_chunked_prompt_gets_its_final_chunks_row(backend: Any) -> None:
    lm, _ = backend(engine={"chunk": 3})
    long = [i % 20 + 1 for i in range(28)]
    torch.testing.assert_close(await lm.next_token_logprobs(long), expected(long))


async def test_the_sync_batch_computes_each_prompt_once_in_order(backend: Any) -> None:
    lm, engine = backend()
    batch = [prompts[2], prompts[0], prompts[2], prompts[3]]
    rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, batch)
    assert rows.shape == (4, VOCAB) and len(engine.requests) == 3
    for prompt, row in zip(batch, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))


async def test_the_cache_answers_repeats_and_clear_cache_flushes_sglang(backend: Any) -> None:
    lm, engine = backend(cache_size=4)
    first = await lm.next_token_logprobs([1, 2, 3])
    assert await lm.next_token_logprobs([1, 2, 3]) is first and len(engine.requests) == 1
    lm.clear_cache()
    assert engine.flushes == 1
    await lm.next_token_logprobs([1, 2, 3])
    assert len(engine.requests) == 2


async def test_reset_fails_waiting_queries_with_cancelled(backend: Any) -> None:
    lm, engine = backend()
    engine.gate.clear()
    task = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.05)
    lm.reset_async_queries()
    engine.gate.set()
    with pytest.raises(Cancelled):
        await task
    torch.testing.assert_close(await lm.next_token_logprobs([1, 2]), expected([1, 2]))


async def test_refusals_aborts_and_missing_rows_are_typed_per_prompt(backend: Any) -> None:
    lm, engine = backend()
    engine.abort.add((4, 4))
    outcomes = await asyncio.gather(
        lm.next_token_logprobs([4, 4]), lm.next_token_logprobs([3]), return_exceptions=True
    )
    assert isinstance(outcomes[0], ModelError) and isinstance(outcomes[1], torch.Tensor)
    engine.skip_capture = True  # a row left in the slot by an earlier request is not taken
    with pytest.raises(ModelError, match="no logits row"):
        await lm.next_token_logprobs([9, 9])
    engine.skip_capture, engine.refuse = False, ValueError("input too long")
    with pytest.raises(BadRequest, match="SGLang refused"):
        await lm.next_token_logprobs([8])
    engine.refuse = RuntimeError("CUDA error")
    with pytest.raises(ModelError):
        await lm.next_token_logprobs([7])


async def test_invalid_prompts_never_reach_sglang(backend: Any) -> None:
    lm, engine = backend()
    with pytest.raises(EmptyPrompt):
        await lm.next_token_logprobs([])
    with pytest.raises(PromptTooLong):
        await lm.next_token_logprobs([1] * 31)
    assert engine.requests == [] and lm.max_prompt_tokens == 30 and lm.vector_size == VOCAB


async def test_aclose_refuses_later_calls(backend: Any) -> None:
    lm, _ = backend()
    await lm.next_token_logprobs([1])
    await lm.aclose()
    with pytest.raises(Cancelled):
        await lm.next_token_logprobs([2])
    with pytest.raises(Cancelled):
        lm.next_token_logprobs_sync([2])


def test_missing_sglang_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_imports, "installed_version", lambda spec: None)
    with pytest.raises(MissingEngine, match=r"sglang>=0\.5\.23,<0\.5\.24.*lmqueue\[sgl\]"):
        import_engine(SGLANG, "sglang")


# -- against SGLang's real classes (unpacked offline) -----------------------------------------
def _real_sglang() -> Any:
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.srt.sampling.custom_logit_processor as clp
            import sglang.srt.server_args as server_args
            from sglang.srt.sampling.sampling_params import SamplingParams
    except (ImportError, KeyError):
        # its dependencies (triton among them) are in the engine venv only; a half-imported
        # package can then fail its submodule lookups with KeyError instead
        return None
    return SimpleNamespace(clp=clp, server_args=server_args, SamplingParams=SamplingParams)


REAL = _real_sglang()
needs_real_sglang = pytest.mark.skipif(
    REAL is None, reason="sglang 0.5.23's Python modules are not importable: make test-engines"
)
real_warnings = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@needs_real_sglang
@real_warnings
def test_the_processor_goes_through_sglangs_own_serialization_and_writes_rows() -> None:
    cls = capture_processor_class(REAL.clp.CustomLogitProcessor)
    assert issubclass(cls, REAL.clp.CustomLogitProcessor) and not cls.__abstractmethods__
    processor = REAL.clp.CustomLogitProcessor.from_str(cls.to_str())  # what the scheduler does
    rows = RowSlots(4, VOCAB)
    try:
        logits = torch.randn(3, VOCAB)
        before = logits.clone()
        params = [
            {SHM_KEY: rows.name, "lmq_count": 4, SLOT_KEY: 2, SEQ_KEY: 11, "__req__": object()},
            None,
            {SHM_KEY: rows.name, "lmq_count": 4, SLOT_KEY: 0, SEQ_KEY: 12},
        ]
        assert processor(logits, params) is logits and torch.equal(logits, before)
        assert torch.equal(torch.from_numpy(rows.read(2, 11)), before[0])
        assert torch.equal(torch.from_numpy(rows.read(0, 12)), before[2])
        assert rows.read(1, 0) is None and rows.read(2, 12) is None
    finally:
        rows.close()


@needs_real_sglang
@real_warnings
def test_engine_options_are_real_server_args_and_params_validate() -> None:
    fields = set(inspect.signature(REAL.server_args.ServerArgs).parameters)
    assert {*SGL_DEFAULTS, "base_gpu_id", "model_path"} <= fields
    params = REAL.SamplingParams(
        max_new_tokens=1,
        temperature=0.0,
        custom_params={SHM_KEY: "x", "lmq_count": 4, SLOT_KEY: 1, SEQ_KEY: 2},
    )
    params.verify(VOCAB)


@needs_real_sglang
@real_warnings
def test_the_engine_methods_the_adapter_calls_exist() -> None:
    spec = importlib.util.find_spec("sglang.srt.entrypoints.engine")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for needed in (
        "async def async_generate(",
        "def flush_cache(self)",
        "def get_server_info(self)",
        "def shutdown(self)",
        "custom_logit_processor: Optional[Union[List[str], str]] = None",
    ):
        assert needed in source, needed
    scheduler = importlib.util.find_spec("sglang.srt.managers.scheduler")
    assert scheduler is not None and scheduler.origin is not None
    assert '"max_req_input_len": self.max_req_input_len' in Path(scheduler.origin).read_text()
    assert "max_new_tokens" in inspect.signature(REAL.SamplingParams).parameters
