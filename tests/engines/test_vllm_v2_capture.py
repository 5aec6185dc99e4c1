"""The V2 capture processor against Model Runner V2's real classes (vLLM 0.32 and 0.33).

`V2Runner` drives V2's real request slots (``RequestState``: slots from a free list) and its
real ``Sampler`` -- which builds the ``LogitsContext`` and calls the processors -- in the order
``GPUModelRunner`` does (``v1/worker/gpu/model_runner.py``: ``add_requests`` before a step,
``finish_requests`` removing finished and preempted requests, ``sample``); on the CPU, as vLLM's
own CPU worker runs them. Greedy requests without penalties or bias use none of the sampler's
Triton kernels, so everything here is vLLM's code as it runs on a GPU, up to the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmqueue.workers.backends.vllm_logits import TAG_KEY, RowSink, capture_processor_class
from lmqueue.workers.backends.vllm_logits_v2 import capture_processor_class_v2

VOCAB = 32
MAX_REQS = 6


@pytest.fixture(scope="module")
def v2() -> SimpleNamespace:
    """vLLM's V2 classes, with request state in plain CPU memory: ``vllm.v1.worker.cpu.shm``
    is what vLLM's CPU worker imports first (it swaps V2's pinned buffers and torch's CUDA
    stream calls for CPU ones, for the whole process, as any vLLM engine on this CPU does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.v1.worker.cpu.shm  # noqa: F401
        from vllm import SamplingParams
        from vllm.config import VllmConfig
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1Base
        from vllm.v1.worker.gpu.sample import logits_processor as lp
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        config = VllmConfig()
    return SimpleNamespace(
        SamplingParams=SamplingParams,
        config=config,
        lp=lp,
        Sampler=Sampler,
        RequestState=RequestState,
        V1Base=V1Base,
    )


class V2Runner:
    """Model Runner V2 reduced to what a logits processor sees."""

    def __init__(self, v2: Any, processors: list[type]) -> None:
        self.v2 = v2
        cpu = torch.device("cpu")
        self.req_states = v2.RequestState(
            max_num_reqs=MAX_REQS,
            max_model_len=64,
            max_num_batched_tokens=64,
            num_speculative_steps=1,
            vocab_size=VOCAB,
            device=cpu,
        )
        self.processors = v2.lp.build_custom_logits_processors(
            v2.config, self.req_states, False, processors
        )
        self.sampler = v2.Sampler(
            v2.config,
            MAX_REQS,
            VOCAB,
            cpu,
            self.req_states,
            custom_logits_processors=self.processors,
        )

    def add(self, req_id: str, tag: str | None) -> int:
        """A new or resumed request takes a slot (``add_requests``); returns the slot."""
        self.req_states.add_request(
            req_id=req_id,
            prompt_len=3,
            all_token_ids=[1, 2, 3],
            num_computed_tokens=0,
            max_tokens=1,
        )
        slot = self.req_states.req_id_to_index[req_id]
        extra = None if tag is None else {TAG_KEY: tag}
        params = self.v2.SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        self.sampler.add_request(slot, params)
        return slot

    def remove(self, req_id: str) -> None:
        """A finished or preempted request frees its slot (``_remove_request``)."""
        self.req_states.remove_request(req_id)

    def step(self, order: list[str], rows: list[int] | None = None) -> torch.Tensor:
        """One step over `order` (batch order), `rows[i]` logits rows for its i-th request
        (None: one each); returns the logits as they were before the sampler ran."""
        self.sampler.apply_staged_writes()
        idx_np = np.array([self.req_states.req_id_to_index[r] for r in order], dtype=np.intp)
        idx = torch.from_numpy(idx_np).to(torch.int64)
        counts = rows or [1] * len(order)
        expanded = idx if rows is None else torch.repeat_interleave(idx, torch.tensor(counts))
        local = torch.cat([torch.arange(n, dtype=torch.int32) for n in counts])
        logits = torch.randn(int(sum(counts)), VOCAB)
        before = logits.clone()
        self.sampler.apply_sampling_params(
            logits,
            expanded,
            idx,
            idx_np,
            torch.zeros(len(local), dtype=torch.int64),  # pos
            torch.zeros(len(local), dtype=torch.int32),  # input_ids
            local,
            np.full(len(order), 3, dtype=np.int32),  # seq_lens_upper_bound_np
        )
        return before


def _runner(v2: Any, sink: RowSink) -> V2Runner:
    return V2Runner(v2, [capture_processor_class_v2(v2.lp.LogitsProcessor, sink)])


def _take(sink: RowSink, tag: str) -> torch.Tensor:
    row = sink.take(tag)
    assert row is not None, f"no row captured for {tag}"
    return row


# -- loading -------------------------------------------------------------------------------------
def test_v2s_loader_builds_the_v2_processor_and_refuses_the_v1_one(v2: Any) -> None:
    sink = RowSink()
    runner = _runner(v2, sink)
    (processor,) = runner.processors
    assert isinstance(processor, v2.lp.LogitsProcessor) and sink.processors == 1
    v1_class = capture_processor_class(v2.V1Base, RowSink())
    with pytest.raises(ValueError, match="is not a subclass of vllm.v1.worker.gpu.sample"):
        v2.lp.build_custom_logits_processors(v2.config, runner.req_states, False, [v1_class])


def test_v2s_admission_check_accepts_lmqueues_requests(v2: Any) -> None:
    cls = capture_processor_class_v2(v2.lp.LogitsProcessor, RowSink())
    validate = v2.lp.build_custom_logits_processors_params_validator([cls])
    validate(v2.SamplingParams(max_tokens=1, temperature=0.0, extra_args={TAG_KEY: "t"}))
    validate(v2.SamplingParams(max_tokens=1))


# -- capture -------------------------------------------------------------------------------------
def test_rows_of_tagged_requests_are_captured_in_any_batch_order(v2: Any) -> None:
    sink = RowSink()
    runner = _runner(v2, sink)
    for req_id, tag in [("a", "ta"), ("b", None), ("c", "tc")]:
        runner.add(req_id, tag)
    logits = runner.step(["c", "a", "b"])
    assert torch.equal(_take(sink, "tc"), logits[0]) and torch.equal(_take(sink, "ta"), logits[1])
    assert len(sink) == 0


def test_a_slot_reused_by_an_untagged_request_is_not_captured(v2: Any) -> None:
    sink = RowSink()
    runner = _runner(v2, sink)
    slot = runner.add("a", "ta")
    runner.add("b", "tb")
    runner.step(["a", "b"])
    _take(sink, "ta")
    runner.remove("a")
    assert runner.add("c", None) == slot  # V2's free list hands the slot straight back
    logits = runner.step(["b", "c"])
    assert torch.equal(_take(sink, "tb"), logits[0]) and len(sink) == 0


def test_a_request_with_several_rows_gives_its_last_one(v2: Any) -> None:
    """Speculative drafts: a request owns one row per draft token plus one; the last is the
    position after its final token."""
    sink = RowSink()
    runner = _runner(v2, sink)
    runner.add("a", "ta")
    runner.add("b", "tb")
    logits = runner.step(["a", "b"], rows=[3, 1])
    assert torch.equal(_take(sink, "ta"), logits[2]) and torch.equal(_take(sink, "tb"), logits[3])


def test_a_batch_without_tagged_requests_never_reaches_the_processor(v2: Any) -> None:
    sink = RowSink()
    runner = _runner(v2, sink)
    runner.add("a", None)
    runner.step(["a"])
    assert runner.sampler.needs_logits_processing[runner.req_states.req_id_to_index["a"]] == 0
    assert len(sink) == 0


@dataclass
class Request:
    """A prompt of `chunks` prefill chunks; its row is the one of its last chunk."""

    req_id: str
    tag: str | None
    chunks: int
    left: int = 0


#: One step: new requests (tagged?, chunks), positions of running requests to preempt,
#: whether preempted requests resume, and a seed for the batch order.
plans = st.lists(
    st.tuples(
        st.lists(st.tuples(st.booleans(), st.integers(1, 3)), max_size=3),
        st.lists(st.integers(0, MAX_REQS - 1), max_size=2),
        st.booleans(),
        st.integers(0, 2**16),
    ),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plans)
def test_the_final_chunk_row_of_every_request_survives_preemption_and_reordering(
    v2: Any, plan: list
) -> None:
    sink = RowSink()
    runner = _runner(v2, sink)
    running: dict[str, Request] = {}
    waiting: list[Request] = []
    done: list[str] = []
    count = 0
    for new, preempt, resume, seed in plan:
        for req_id in done:  # finish_requests: at the start of the next step
            runner.remove(req_id)
            del running[req_id]
        ids, done = list(running), []
        for req_id in sorted({ids[p % len(ids)] for p in preempt} if ids else set()):
            runner.remove(req_id)  # preempted: V2 frees the slot; the prompt prefills again
            waiting.append(running.pop(req_id))
        queue, waiting = (waiting, []) if resume else ([], waiting)
        for tagged, chunks in new:
            count += 1
            queue.append(Request(f"r{count}", f"t{count}" if tagged else None, chunks))
        room = MAX_REQS - len(running)
        for request in queue[:room]:  # resumed requests come back as new ones, any slot
            runner.add(request.req_id, request.tag)
            request.left = request.chunks
            running[request.req_id] = request
        waiting += queue[room:]
        if not running:
            continue
        order = [str(r) for r in np.random.default_rng(seed).permutation(list(running))]
        logits = runner.step(order)
        for row, req_id in enumerate(order):
            request = running[req_id]
            request.left -= 1
            if request.left == 0:  # its last chunk: vLLM reports it finished
                done.append(req_id)
                if request.tag is not None:
                    assert torch.equal(_take(sink, request.tag), logits[row])
        for request in [*running.values(), *waiting]:  # earlier chunks' rows of live requests
            if request.tag is not None and request.req_id not in done:
                sink.take(request.tag)
        assert len(sink) == 0, "rows of finished or untagged requests were captured"
