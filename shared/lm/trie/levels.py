"""Bulk mass computation: every node of a trie, for a batch of weight vectors, level by level.

Both engines walk the levels of a `TrieLayout` from the deepest up; a level's internal nodes
are reduced from the level below, which is complete by then.

`NumpyLevels` (CPU) uses only contiguous numpy operations plus one `take` per level: the level
below is gathered into "rank blocks" (every parent's first child, then the second child of the
parents that have one, ...). Parents are sorted by their number of children, so rank block
``k`` lines up with the first ``n_k`` parents and is added with one slice operation. A batch of
32 rows over a 49k vocabulary costs about 82 gathers and ~700 slice additions, no Python loop
over nodes, no sparse matrix, and sums stay exact float64 additions (no prefix-sum
differences, whose cancellation would destroy tiny masses). It is single-threaded on purpose:
on small shared machines, OpenMP regions per level stall whenever a core is busy elsewhere.

`torch_levels.TorchLevels` is the same walk for CUDA.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .inputs import SUM, Reduction
from .layout import TrieLayout

__all__ = ["NumpyLevels", "plan_levels"]


@dataclass(frozen=True)
class _LevelPlan:
    """One level's share of the work, in node numbers and columns of the level below."""

    start: int
    n_internal: int
    end: int
    below_end: int
    leaf_lo: int
    leaf_hi: int
    gather: np.ndarray
    rank_sizes: tuple[int, ...]


def _rank_blocks(parents: np.ndarray, n_internal: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Order children (by position below) into rank blocks; return the order and block sizes.

    `parents` gives, for each child in the level below, its parent's position in this level.
    """
    by_parent = np.argsort(parents, kind="stable")
    first = np.searchsorted(parents[by_parent], np.arange(n_internal))
    rank = np.empty(len(parents), dtype=np.int64)
    rank[by_parent] = np.arange(len(parents)) - first[parents[by_parent]]
    order = np.lexsort((parents, rank))
    sizes = np.bincount(rank)
    return order, tuple(int(n) for n in sizes)


def plan_levels(layout: TrieLayout) -> list[_LevelPlan]:
    """The per-level gathers and rank blocks, deepest level first."""
    starts = layout.level_starts
    plans = []
    leaf_hi = len(layout.leaves)
    for level in reversed(range(layout.n_levels)):
        start, end = int(starts[level]), int(starts[level + 1])
        n_internal = int(layout.level_internal[level])
        leaf_lo = leaf_hi - (end - start - n_internal)
        below_end = int(starts[level + 2]) if level + 1 < layout.n_levels else end
        gather = np.zeros(0, dtype=np.intp)
        sizes: tuple[int, ...] = ()
        if n_internal:
            parents = layout.parent[end:below_end] - start
            gather, sizes = _rank_blocks(parents, n_internal)
        plans.append(_LevelPlan(start, n_internal, end, below_end, leaf_lo, leaf_hi, gather, sizes))
        leaf_hi = leaf_lo
    return plans


class NumpyLevels:
    """Bulk masses on the CPU with contiguous numpy operations (see the module docstring).

    Each level is built in a reused C-contiguous scratch buffer, so `np.take` neither copies
    its source nor allocates its result, and then copied into the output: page faults on fresh
    temporaries cost more than that copy. Scratch is per thread and holds `chunk_rows` rows;
    larger batches go through in chunks.
    """

    def __init__(self, layout: TrieLayout, chunk_rows: int = 16) -> None:
        self.size = layout.size
        self.n_words = len(layout.leaves)
        self.leaf_positions = layout.leaf_positions
        self.plans = plan_levels(layout)
        self.chunk_rows = chunk_rows
        self._widest_level = max(plan.end - plan.start for plan in self.plans)
        self._most_children = max(len(plan.gather) for plan in self.plans)
        self._local = threading.local()

    def run(self, weights: np.ndarray, reduction: Reduction = SUM) -> np.ndarray:
        """Masses of every node for each row of `weights` (float64, ``(batch, vocab)``)."""
        out = np.empty((weights.shape[0], self.size))
        for first in range(0, weights.shape[0], self.chunk_rows):
            rows = slice(first, first + self.chunk_rows)
            self._run_chunk(weights[rows], out[rows], reduction.ufunc)
        return out

    def _run_chunk(self, weights: np.ndarray, out: np.ndarray, ufunc: np.ufunc) -> None:
        """Fill `out` level by level, deepest first, for at most `chunk_rows` rows."""
        scratch = self._scratch()
        rows = weights.shape[0]
        leaf_values = _view(scratch.leaves, rows, self.n_words)
        np.take(weights, self.leaf_positions, axis=1, out=leaf_values, mode="clip")
        below = leaf_values[:, :0]
        for i, plan in enumerate(self.plans):
            level = _view(scratch.levels[i % 2], rows, plan.end - plan.start)
            level[:, plan.n_internal :] = leaf_values[:, plan.leaf_lo : plan.leaf_hi]
            if plan.n_internal:
                children = _view(scratch.children, rows, len(plan.gather))
                np.take(below, plan.gather, axis=1, out=children, mode="clip")
                _add_rank_blocks(level, children, plan.rank_sizes, ufunc)
            out[:, plan.start : plan.end] = level
            below = level

    def _scratch(self) -> _Scratch:
        """This thread's buffers, allocated on its first call."""
        scratch: _Scratch | None = getattr(self._local, "scratch", None)
        if scratch is None:
            rows = self.chunk_rows
            scratch = _Scratch(
                leaves=np.empty(rows * self.n_words),
                levels=(np.empty(rows * self._widest_level), np.empty(rows * self._widest_level)),
                children=np.empty(rows * self._most_children),
            )
            self._local.scratch = scratch
        return scratch


@dataclass(frozen=True)
class _Scratch:
    """Flat buffers, viewed as C-contiguous ``(rows, columns)`` matrices as needed."""

    leaves: np.ndarray
    levels: tuple[np.ndarray, np.ndarray]
    children: np.ndarray


def _view(buffer: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """The first ``rows * columns`` entries of `buffer` as a C-contiguous matrix."""
    return buffer[: rows * columns].reshape(rows, columns)


def _add_rank_blocks(
    level: np.ndarray, children: np.ndarray, rank_sizes: tuple[int, ...], ufunc: np.ufunc
) -> None:
    """Reduce rank-ordered `children` into the level's leading (internal) columns."""
    first = rank_sizes[0]
    level[:, :first] = children[:, :first]
    offset = first
    for size in rank_sizes[1:]:
        parents = level[:, :size]
        ufunc(parents, children[:, offset : offset + size], out=parents)
        offset += size
