"""`ParallelTokenCharacterTrie`: the same masses, a whole batch per pass, on CPU or CUDA."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .inputs import Reduction, check_weight_shape, is_tensor
from .levels import NumpyLevels
from .structure import TokenCharacterTrie
from .torch_levels import TorchLevels

__all__ = ["ParallelTokenCharacterTrie"]


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """A `TokenCharacterTrie` that reduces a whole batch level by level (see `levels`).

    Args:
        decode: the vocabulary, as for `TokenCharacterTrie`.
        device: ``"cpu"`` (numpy, single-threaded), a CUDA device (torch, weights stay on the
            GPU until the result is copied back), or None for CUDA when available.
    """

    def __init__(self, decode: Sequence[bytes], device: Any = None) -> None:
        super().__init__(decode)
        self.device = _pick_device(device)
        self.engine: NumpyLevels | TorchLevels
        if self.device == "cpu":
            self.engine = NumpyLevels(self.layout)
        else:
            self.engine = TorchLevels(self.layout, self.device)

    def _weights(self, ws: Any) -> tuple[Any, bool]:
        """Numpy weights for the CPU engine; a float64 tensor on the device for torch."""
        if isinstance(self.engine, NumpyLevels):
            return super()._weights(ws)
        torch = self.engine.torch
        if isinstance(ws, (list, tuple)):
            ws = (
                torch.stack([torch.as_tensor(row) for row in ws])
                if ws
                else torch.zeros(0, len(self.decode))
            )
        tensor = torch.as_tensor(ws).to(self.engine.device, torch.float64)
        single = check_weight_shape(tuple(tensor.shape), len(self.decode))
        return tensor.reshape(-1, len(self.decode)), single

    def _numpy(self, matrix: Any) -> np.ndarray:
        """A device tensor copied back as float64 numpy."""
        return matrix.cpu().numpy() if is_tensor(matrix) else matrix

    def _masses(self, matrix: Any, reduction: Reduction) -> np.ndarray:
        """Every node's mass for the whole batch in one bulk pass."""
        if isinstance(self.engine, NumpyLevels):
            return self.engine.run(matrix, reduction)
        if not is_tensor(matrix):
            matrix = self.engine.torch.from_numpy(matrix).to(self.engine.device)
        return self.engine.run(matrix, reduction).cpu().numpy()


def _pick_device(device: Any) -> str:
    """``"cpu"`` or the CUDA device's name; None means CUDA if torch sees one."""
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    name = str(device)
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    return name
