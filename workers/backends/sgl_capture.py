"""Full-vocabulary rows out of SGLang through its public custom logit processor.

SGLang's ``Engine`` returns top-k log-probabilities as Python lists; its custom logit
processors (``sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor``, enabled by
``enable_custom_logit_processor``) see each request's raw logits row in the sampler, before
temperature, and receive the request's ``custom_params``. The processor runs in SGLang's
scheduler process, so rows come back through shared memory: `RowSlots` is a block of
``count`` float32 rows of the vocabulary's width plus a sequence number per row; a request is
given a slot and a fresh sequence number in its ``custom_params``, the processor writes the row
and then the number, and the backend reads the row only if the number matches (a row left by
an earlier request in that slot is never taken for this one).

A prompt split into prefill chunks has its row written at each chunk that reaches the
sampler; the last write, at the final chunk, is the one read when the request finishes.

This module imports no SGLang code: `capture_processor_class` derives from the base class it
is given (SGLang's ``CustomLogitProcessor`` in `sgl_engine`), so the bookkeeping is tested
without SGLang.
"""

from __future__ import annotations

import threading
from multiprocessing import shared_memory
from typing import Any

import numpy as np

__all__ = [
    "SHM_KEY",
    "COUNT_KEY",
    "SLOT_KEY",
    "SEQ_KEY",
    "RowSlots",
    "CaptureRows",
    "capture_processor_class",
]

#: ``custom_params`` keys of a request whose row is captured: the block, its row count, the
#: request's slot and sequence number.
SHM_KEY, COUNT_KEY, SLOT_KEY, SEQ_KEY = "lmq_shm", "lmq_count", "lmq_slot", "lmq_seq"


class RowSlots:
    """Shared memory of `count` rows of `width` float32 log-its, each with a sequence number.

    Args:
        count, width: the block's shape.
        name: an existing block to attach to (the processor's side); None creates one.
    """

    def __init__(self, count: int, width: int, name: str | None = None) -> None:
        size = count * 8 + count * width * 4
        self._owner = name is None
        self._shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        self.count, self.width = count, width
        buffer = self._shm.buf
        assert buffer is not None
        self.seqs = np.ndarray((count,), dtype=np.int64, buffer=buffer)
        self.rows = np.ndarray((count, width), dtype=np.float32, buffer=buffer[count * 8 :])
        if self._owner:
            self.seqs[:] = -1

    @property
    def name(self) -> str:
        """The shared-memory block's name (what a processor attaches to)."""
        return self._shm.name

    def write(self, slot: int, seq: int, row: np.ndarray) -> None:
        """Store `row` in `slot`, then mark it as `seq`'s."""
        self.rows[slot] = row
        self.seqs[slot] = seq

    def read(self, slot: int, seq: int) -> np.ndarray | None:
        """A copy of `slot`'s row if `seq` wrote it, else None."""
        if int(self.seqs[slot]) != seq:
            return None
        return self.rows[slot].copy()

    def close(self) -> None:
        """Detach; the creating side also removes the block."""
        del self.seqs, self.rows
        self._shm.close()
        if self._owner:
            self._shm.unlink()


_attached: dict[str, RowSlots] = {}
_attach_lock = threading.Lock()


def _slots(name: str, count: int, width: int) -> RowSlots:
    """The block `name`, attached once per process (the scheduler's side)."""
    with _attach_lock:
        slots = _attached.get(name)
        if slots is None:
            slots = _attached[name] = RowSlots(count, width, name=name)
        return slots


class CaptureRows:
    """The processor's behaviour; `capture_processor_class` mixes it into SGLang's base.

    Called as ``processor(logits, custom_param_list)`` with the rows of the requests that
    named this processor; returns `logits` unchanged (SGLang writes the result back).
    """

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any]] | None = None) -> Any:
        import torch

        params = custom_param_list or []
        tagged = [(j, p) for j, p in enumerate(params) if p and SHM_KEY in p]
        if not tagged:
            return logits
        rows = logits.detach().to(torch.float32).cpu().numpy()  # one copy for the whole batch
        for j, p in tagged:
            slots = _slots(p[SHM_KEY], int(p[COUNT_KEY]), rows.shape[1])
            slots.write(int(p[SLOT_KEY]), int(p[SEQ_KEY]), rows[j])
        return logits


def capture_processor_class(base: type) -> type:
    """A `CaptureRows` subclass of `base` (SGLang's ``CustomLogitProcessor``).

    SGLang ships a processor to its scheduler as ``base.to_str()`` (the class, serialized
    with dill) and calls ``from_str(...)(logits, custom_param_list)`` there.
    """
    bases = (CaptureRows,) if base is object else (CaptureRows, base)
    return type("LMQueueSGLCapture", bases, {"__module__": __name__})
