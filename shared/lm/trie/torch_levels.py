"""`TorchLevels`: the level-by-level walk of `levels` with torch, for CUDA.

One ``index_add_`` (sum) or ``scatter_reduce_`` (max) per level, which a GPU runs as one kernel
each; ~80 launches for a 49k vocabulary. Sums use float64 atomics, so their rounding may differ
from the CPU engine's in the last bits.
"""

from __future__ import annotations

from typing import Any

from .inputs import SUM, Reduction
from .layout import TrieLayout

__all__ = ["TorchLevels"]


class TorchLevels:
    """Bulk masses with torch on any device: one scatter per level (a kernel each on a GPU)."""

    def __init__(self, layout: TrieLayout, device: Any = "cuda") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.size = layout.size
        self.leaves = torch.as_tensor(layout.leaves, device=self.device)
        starts = layout.level_starts
        self.levels = []
        for level in reversed(range(layout.n_levels - 1)):
            n_internal = int(layout.level_internal[level])
            if not n_internal:
                continue
            start, end, below_end = (int(starts[i]) for i in (level, level + 1, level + 2))
            parents = torch.as_tensor(layout.parent[end:below_end] - start, device=self.device)
            self.levels.append((start, n_internal, end, below_end, parents))

    def run(self, weights: Any, reduction: Reduction = SUM) -> Any:
        """Masses of every node for each row of `weights` (a float64 tensor on the device)."""
        torch = self.torch
        batch = weights.shape[0]
        out = torch.empty((batch, self.size), dtype=torch.float64, device=self.device)
        out.index_copy_(1, self.leaves, weights)
        for start, n_internal, end, below_end, parents in self.levels:
            target = out[:, start : start + n_internal]
            children = out[:, end:below_end]
            target.fill_(reduction.identity)
            if reduction.name == SUM.name:
                target.index_add_(1, parents, children)
            else:
                index = parents.expand(batch, -1)
                target.scatter_reduce_(1, index, children, "amax", include_self=True)
        return out
