"""Full-vocabulary logits out of vLLM, through its public custom logits-processor interface.

vLLM's outputs carry top-k log-probabilities only (``logprobs=-1`` exists but turns a whole
vocabulary into Python objects per request), so `AsyncVirtualLM` registers a logits processor
that copies the rows of its own requests out of each step's logits and returns the tensor
untouched. vLLM has two model runners with two processor interfaces; this module holds the
V1 runner's (``vllm.v1.sample.logits_processor.LogitsProcessor``: vLLM on CPU) and what both
share (`RowSink`, the tag, `copy_rows`); `vllm_logits_v2` holds Model Runner V2's (vLLM's
default on CUDA), and `vllm_engine` installs the one the engine's config will run.

How vLLM calls a processor (V1 model runner, ``v1/worker/gpu_input_batch.py``): requests live
in a *persistent batch* whose row ``i`` is row ``i`` of every step's logits. Before each step
``update_state`` receives a `BatchUpdate` describing how the batch changed -- ``removed`` row
indices, ``added`` ``(index, params, prompt_ids, output_ids)`` tuples and ``moved``
``(a, b, MoveDirectionality)`` tuples (UNIDIRECTIONAL: a's request now sits at b and a is empty;
SWAP: a and b exchange), to be applied in that order -- and then ``apply(logits)`` receives the
step's logits, one row per request. A processor never sees request ids, so a request is marked
by ``SamplingParams.extra_args[TAG_KEY]``, and `BatchRows` follows its row as vLLM moves it.

Chunked prefill: a prompt split across steps gets a row in every step, but only its last chunk
yields the logits after the final prompt token. vLLM tells a processor nothing about chunks, so
`RowSink` keeps the *latest* row per request and the engine thread takes it when vLLM reports
the request finished. That row is the final-position one: a request with ``max_tokens=1`` is
sampled once, in the step of its last chunk, and is never scheduled again (the async
scheduler skips a request whose placeholders already reach ``max_tokens``).

This module imports no vLLM code: `capture_processor_class` derives from the base class it is
given, so the bookkeeping is tested without vLLM, and `engine_imports.build_vllm_engine`
passes vLLM's real base.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "TAG_KEY",
    "BatchRows",
    "RowSink",
    "CaptureLogitsProcessor",
    "capture_processor_class",
    "copy_rows",
    "tag_of",
]

#: The ``SamplingParams.extra_args`` key whose value names a request whose row is captured.
TAG_KEY = "lmqueue_capture"


def tag_of(params: Any) -> str | None:
    """The capture tag carried by a request's sampling parameters, if any."""
    extra = getattr(params, "extra_args", None)
    if not extra:
        return None
    tag = extra.get(TAG_KEY)
    return tag if isinstance(tag, str) else None


def _is_swap(direction: Any) -> bool:
    """Whether a move is vLLM's ``MoveDirectionality.SWAP`` (compared by name: no vLLM import)."""
    return getattr(direction, "name", direction) == "SWAP"


class BatchRows:
    """Which row of vLLM's persistent batch holds which tagged request.

    Untagged requests are not tracked; a row they take over is forgotten. The rules are those
    of vLLM's own sparse processors (``process_dict_updates`` in ``logits_processor/builtin.py``).
    """

    def __init__(self) -> None:
        self._tags: dict[int, str] = {}

    def update(self, batch_update: Any) -> None:
        """Apply one `BatchUpdate` (None: the batch did not change)."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._tags.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            tag = tag_of(params)
            if tag is None:
                self._tags.pop(index, None)
            else:
                self._tags[index] = tag
        for a, b, direction in batch_update.moved:
            a_tag = self._tags.pop(a, None)
            b_tag = self._tags.pop(b, None)
            if a_tag is not None:
                self._tags[b] = a_tag
            if b_tag is not None and _is_swap(direction):
                self._tags[a] = b_tag

    def rows(self) -> list[tuple[int, str]]:
        """``(row, tag)`` of every tagged request, by row."""
        return sorted(self._tags.items())

    def as_dict(self) -> dict[int, str]:
        """A copy of the row -> tag map."""
        return dict(self._tags)


class RowSink:
    """The latest captured logits row of each tagged request, until the backend takes it.

    Written by the processor inside vLLM's step and read by the backend's engine thread after
    it; in-process both run on that thread, and the lock keeps it safe if they ever do not.
    """

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        #: Processors vLLM built with this sink: 0 after engine start means no capture.
        self.processors = 0

    def put(self, rows: Mapping[str, torch.Tensor]) -> None:
        """Store rows, replacing earlier ones of the same tags (earlier prefill chunks)."""
        with self._lock:
            self._rows.update(rows)

    def take(self, tag: str) -> torch.Tensor | None:
        """Remove and return the latest row of `tag` (None if none was captured)."""
        with self._lock:
            return self._rows.pop(tag, None)

    def discard(self, tags: Iterable[str]) -> None:
        """Drop the rows of requests that will not be delivered (aborted, failed)."""
        with self._lock:
            for tag in tags:
                self._rows.pop(tag, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


class CaptureLogitsProcessor:
    """The processor's behaviour; `capture_processor_class` mixes it into vLLM's base class.

    ``sink`` is a class attribute: vLLM builds processors from a class, so each backend gets
    its own subclass bound to its own `RowSink`.
    """

    sink: RowSink

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.rows = BatchRows()
        type(self).sink.processors += 1

    def is_argmax_invariant(self) -> bool:
        """False: vLLM then applies it on every step to raw logits (argmax-invariant processors
        run only for random sampling, after temperature scaling)."""
        return False

    def update_state(self, batch_update: Any) -> None:
        """Follow the tagged requests' rows through vLLM's persistent-batch changes."""
        self.rows.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Copy the tagged rows into the sink; return `logits` unchanged (same object)."""
        rows = [(i, tag) for i, tag in self.rows.rows() if i < logits.shape[0]]
        copy_rows(logits, rows, type(self).sink)
        return logits


def copy_rows(logits: torch.Tensor, rows: list[tuple[int, str]], sink: RowSink) -> None:
    """Copy ``logits[row]`` of each ``(row, tag)`` into `sink` under its tag, without waiting
    for the device."""
    if not rows:
        return
    # Pinned and non-blocking, as vLLM's own async_tensor_h2d: a pageable copy would make the
    # CPU wait for the forward pass and stall vLLM's async scheduling.
    pinned = logits.device.type == "cuda"
    index = torch.tensor([i for i, _ in rows], pin_memory=pinned)
    index = index.to(logits.device, non_blocking=True)
    # index_select copies: the sampler scales this buffer in place after us, and the next step
    # overwrites it.
    block = logits.index_select(0, index)
    sink.put({tag: block[j] for j, (_, tag) in enumerate(rows)})


def capture_processor_class(base: type, sink: RowSink) -> type:
    """A `CaptureLogitsProcessor` subclass of `base` (vLLM's ``LogitsProcessor``) bound to `sink`.

    A class, not an instance, because vLLM instantiates processors itself
    (``build_logitsprocs`` in ``v1/sample/logits_processor/__init__.py``); in-process vLLM
    takes the class object, so it need not be importable by name.
    """
    bases = (CaptureLogitsProcessor,) if base is object else (CaptureLogitsProcessor, base)
    return type("LMQueueCaptureProcessor", bases, {"sink": sink, "__module__": __name__})
