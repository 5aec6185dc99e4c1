"""`to_float32_tensor`: the tensor a caller gets from a vector as it came off the wire."""

from __future__ import annotations

import numpy as np
import torch

from shared.wire import cast_in_chunks

__all__ = ["to_float32_tensor"]


def to_float32_tensor(vector: np.ndarray) -> torch.Tensor:
    """A writable float32 tensor of the wire vector, which it may take over if writable.

    A writable vector is this caller's own (`InflightTable` hands each waiter its own, the
    `RespPipe` receives each into a fresh buffer): float32 becomes the tensor as it is. A
    read-only one is a view of bytes read by redis-py, and is copied. float16 converts through
    torch (F16C, in serial chunks: ~10 us against numpy's 69 us per 49,152 values,
    bit-identical), from writable memory only: torch warns on read-only memory.
    """
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


_SINGLE, _HALF = np.dtype("<f4"), np.dtype("<f2")
_NATIVE = _HALF == np.dtype(np.float16)  # little-endian host: torch tensors are native-endian
