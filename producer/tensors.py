"""What a caller gets from a vector as it came off the wire: a float32 tensor, or an array
(float16 ones as they travelled, where the client keeps half results: ``half_results``).

torch is imported on the first tensor made, not with this module: a program that asks only
for numpy arrays (`QueueLM.next_token_logprobs_numpy`) never loads it (~200 MiB of RSS).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lmqueue.shared.serial_torch import imported_torch
from lmqueue.shared.wire import Reply, cast_in_chunks

if TYPE_CHECKING:
    import torch

__all__ = [
    "to_float32_tensor", "to_float32_array", "to_result_tensor", "to_result_array", "as_tensor",
    "as_array", "widened", "HalfWidener", "WideHalf",
]  # fmt: skip


def to_float32_tensor(vector: np.ndarray) -> torch.Tensor:
    """A writable float32 tensor of the wire vector, which it may take over if writable.

    A writable vector is this caller's own (`InflightTable` hands each waiter its own, the
    `RespPipe` receives each into a fresh buffer): float32 becomes the tensor as it is. A
    read-only one is a view of bytes read by redis-py, and is copied. float16 converts through
    torch (F16C, in serial chunks: several times faster than numpy, bit-identical), from
    writable memory only: torch warns on read-only memory.
    """
    import torch

    if vector.dtype == _SINGLE and _NATIVE:
        if not vector.flags.writeable:
            vector = vector.copy()
        return torch.from_numpy(vector)
    if vector.dtype == _HALF and _NATIVE:
        if vector.flags.writeable:
            half = torch.from_numpy(vector)
        else:
            half = torch.empty(vector.shape[0], dtype=torch.float16)
            half.numpy()[:] = vector
        out = torch.empty(vector.shape[0], dtype=torch.float32)
        cast_in_chunks(out, half)
        return out
    return torch.from_numpy(vector.astype(np.float32))


def to_float32_array(vector: np.ndarray) -> np.ndarray:
    """A writable float32 array of the wire vector, taken over if writable (see above)."""
    if vector.dtype == _SINGLE and _NATIVE:
        return vector if vector.flags.writeable else vector.copy()
    return vector.astype(np.float32)


def to_result_tensor(vector: np.ndarray, keep_float16: bool = False) -> torch.Tensor:
    """`to_float32_tensor`, or with `keep_float16` a float16 vector's own float16 tensor."""
    if keep_float16 and vector.dtype == _HALF and _NATIVE:
        import torch

        return torch.from_numpy(vector if vector.flags.writeable else vector.copy())
    return to_float32_tensor(vector)


def to_result_array(vector: np.ndarray, keep_float16: bool = False) -> np.ndarray:
    """`to_float32_array`, or with `keep_float16` a float16 vector as a writable array."""
    if keep_float16 and vector.dtype == _HALF:
        return vector if vector.flags.writeable else vector.copy()
    return to_float32_array(vector)


def widened(reply: Reply, keep_float16: bool = False) -> Reply:
    """`reply` with a float16 or bfloat16 vector widened to a float32 one of its own (others
    as they are; float16 ones too with `keep_float16`: a client keeping half results).

    The client's reply thread calls it, so callers on the event loop get float32 vectors they
    can take over as they are. float16: torch converts (serially, on a thread of lmqueue's
    own: `shared.serial_torch`) where a program imported it; a numpy-only program gets numpy's
    slower conversion, as it would have anyway. bfloat16 is the upper half of a float32:
    one numpy shift, exact.
    """
    payload = reply.payload
    if payload is None or not _NATIVE or reply.dtype not in ("float16", "bfloat16"):
        return reply
    if keep_float16 and reply.dtype == "float16":
        return reply
    if reply.dtype == "bfloat16":
        bits = np.frombuffer(payload, dtype=np.uint16)
        wide = np.left_shift(bits, 16, dtype=np.uint32)
        return Reply(reply.request_id, wide.data.cast("B"), "float32", cached=reply.cached)
    out = _float32_of_half(np.frombuffer(payload, dtype=_HALF))
    return Reply(reply.request_id, out.data.cast("B"), "float32", cached=reply.cached)


def _float32_of_half(half: np.ndarray) -> np.ndarray:
    """A float32 array of its own with float16 `half`'s values: torch's conversion where a
    program imported torch (torch warns on read-only memory: such a `half` is copied first),
    numpy's slower one in a numpy-only program."""
    torch = imported_torch()
    if torch is None:
        return half.astype(np.float32)
    out = np.empty(half.shape[0], dtype=np.float32)
    source = torch.from_numpy(half if half.flags.writeable else half.copy())
    cast_in_chunks(torch.from_numpy(out), source)
    return out


@dataclass(frozen=True, slots=True)
class WideHalf:
    """A float16 vector widened to float32 as it was received (`HalfWidener`): its bytes."""

    payload: memoryview


class HalfWidener:
    """Widens float16 vectors of `vector_size` values as a `RespSocket` receives them
    (a `shared.resp_socket.BulkIntake`).

    Each vector lands in one scratch buffer that is reused, so it is still in the CPU's cache
    when it is converted, at once, into a float32 array of its own (`WideHalf`). Widening a
    whole read's vectors after it, as `widened` does, reads each from memory written
    megabytes before, and each received into memory of its own first: in a loop of 32-vector
    MGETs of 49,152-entry vectors against a local Redis, 45 against 36 CPU us a vector
    (docs/benchmarks-history.md, "Issue 33, 2026-12-07 (seventh session)"). Bit-identical to
    `widened`: the same conversion (`_float32_of_half`).

    One thread at a time, like the `RespSocket` it serves.
    """

    def __init__(self, vector_size: int) -> None:
        self._half = np.empty(vector_size, dtype=_HALF)
        self.length = self._half.nbytes
        self.scratch = self._half.data.cast("B")

    def __call__(self) -> WideHalf:
        return WideHalf(_float32_of_half(self._half).data.cast("B"))


def as_tensor(value: Any) -> torch.Tensor:
    """`value` (a result as cached: a tensor, or a writable float32 array) as a tensor."""
    if isinstance(value, np.ndarray):
        import torch

        return torch.from_numpy(value)  # shares the memory, as a cached tensor would
    return value


def as_array(value: Any) -> np.ndarray:
    """`value` (a tensor or an array, as cached) as a numpy array sharing its memory."""
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        array: np.ndarray = value.numpy()
        return array
    return np.asarray(value)


_SINGLE, _HALF = np.dtype("<f4"), np.dtype("<f2")
_NATIVE = _HALF == np.dtype(np.float16)  # little-endian host: torch tensors are native-endian
