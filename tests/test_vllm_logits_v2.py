"""The V2 capture processor's bookkeeping without vLLM (``make test-engines`` runs it against
Model Runner V2's real classes: ``tests/engines/test_vllm_v2_capture.py``).

A step's context is shaped like V2's ``LogitsContext``: ``idx_mapping_np`` (batch position ->
slot, host) and ``expanded_idx_mapping`` (logits row -> slot, device).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lmqueue.workers.backends.vllm_logits import TAG_KEY, RowSink
from lmqueue.workers.backends.vllm_logits_v2 import SlotTags, capture_processor_class_v2

VOCAB = 16


def params(tag: str | None) -> Any:
    return SimpleNamespace(extra_args=None if tag is None else {TAG_KEY: tag})


def ctx(slots: list[int], rows: list[int] | None = None) -> Any:
    """A step over requests in `slots` (batch order), `rows[i]` logits rows for the i-th."""
    idx = torch.tensor(slots, dtype=torch.int64)
    expanded = idx if rows is None else torch.repeat_interleave(idx, torch.tensor(rows))
    return SimpleNamespace(
        idx_mapping_np=np.array(slots, dtype=np.intp), expanded_idx_mapping=expanded
    )


def processor(sink: RowSink) -> Any:
    return capture_processor_class_v2(object, sink)(None, None)


def test_slots_remember_tagged_requests_and_forget_untagged_newcomers() -> None:
    slots = SlotTags()
    assert slots.add(3, params("a")) is True and slots.add(5, params("b")) is True
    assert slots.add(3, params(None)) is False  # a new occupant of slot 3
    assert slots.add(5, params("c")) is True
    assert slots.as_dict() == {5: "c"}


def test_rows_follow_the_batch_order_through_the_host_mapping() -> None:
    slots = SlotTags()
    slots.add(4, params("a"))
    slots.add(1, params(None))
    slots.add(0, params("c"))
    assert slots.rows(ctx([1, 0, 4]), 3) == [(1, "c"), (2, "a")]


def test_a_request_with_several_rows_gives_its_last_row() -> None:
    slots = SlotTags()
    slots.add(2, params("a"))
    slots.add(7, params("b"))
    assert slots.rows(ctx([7, 2], rows=[1, 3]), 4) == [(3, "a"), (0, "b")]


def test_no_tagged_slot_reads_nothing_of_the_step() -> None:
    assert SlotTags().rows(None, 3) == []


def test_the_processor_copies_tagged_rows_and_returns_the_logits_unchanged() -> None:
    sink = RowSink()
    capture = processor(sink)
    assert capture.add_request(0, params("a")) is True
    assert capture.add_request(1, params(None)) is False
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    assert capture.apply(logits, ctx([1, 0])) is logits
    logits.mul_(2.0)  # the sampler scales temperature in place after the processors
    row = sink.take("a")
    assert row is not None and torch.equal(row, before[1]) and len(sink) == 0


def test_a_later_prefill_chunk_replaces_the_earlier_row() -> None:
    sink = RowSink()
    capture = processor(sink)
    capture.add_request(0, params("a"))
    first, last = torch.randn(1, VOCAB), torch.randn(1, VOCAB)
    capture.apply(first, ctx([0]))
    capture.apply(last, ctx([0]))
    row = sink.take("a")
    assert row is not None and torch.equal(row, last[0])


def test_processor_classes_of_two_backends_keep_separate_sinks() -> None:
    first, second = RowSink(), RowSink()
    processor(first)
    other: Any = capture_processor_class_v2(object, second)
    assert (first.processors, second.processors) == (1, 0) and other.sink is second


@pytest.mark.parametrize("extra", [None, {}, {TAG_KEY: 5}, {"other": "x"}])
def test_a_request_without_a_tag_is_never_captured(extra: Any) -> None:
    sink = RowSink()
    capture = processor(sink)
    assert capture.add_request(0, SimpleNamespace(extra_args=extra)) is False
    capture.apply(torch.randn(1, VOCAB), ctx([0]))
    assert len(sink) == 0
