"""Checking what callers hand a trie: weight vectors and node ids, one set of rules for all tries.

A weight vector must have exactly one entry per vocabulary position. Language models often pad
their output layer past the tokenizer's vocabulary (a multiple of 64 or 128 rows); such a vector
is refused rather than silently truncated, because a longer vector is just as often a vector
from another model, and the padded rows can carry probability mass that would vanish. Callers
that know their model pads slice ``logits[..., :len(vocab)]`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BadRequest, UnknownNode, VocabularyMismatch

__all__ = [
    "Reduction",
    "SUM",
    "MAX",
    "as_weight_matrix",
    "as_node_ids",
    "check_weight_shape",
    "is_tensor",
]


@dataclass(frozen=True)
class Reduction:
    """How masses combine: the numpy ufunc and its identity (the mass of no tokens)."""

    name: str
    ufunc: np.ufunc
    identity: float


SUM = Reduction("sum", np.add, 0.0)
MAX = Reduction("max", np.maximum, -np.inf)


def is_tensor(value: Any) -> bool:
    """Whether `value` is a torch tensor, without importing torch."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def check_weight_shape(shape: tuple[int, ...], size: int) -> bool:
    """Check a weight array's shape; return whether it is a single vector.

    Raises:
        VocabularyMismatch: if the last axis does not have `size` entries.
        BadRequest: if the array is neither one vector nor a batch of vectors.
    """
    if len(shape) not in (1, 2):
        raise BadRequest(f"weights must be a vector or a batch of vectors, got shape {shape}")
    if shape[-1] != size:
        raise VocabularyMismatch(
            f"weight vector has {shape[-1]} entries but the vocabulary has {size}; slice a"
            " padded model output to the vocabulary first",
            entries=shape[-1],
            vocab_size=size,
        )
    return len(shape) == 1


def as_weight_matrix(weights: Any, size: int) -> tuple[np.ndarray, bool]:
    """`weights` as a C-contiguous float64 ``(batch, size)`` matrix, and whether it was 1-d.

    Accepts numpy arrays, torch tensors (any device and floating dtype) and sequences of
    vectors (what genlm-style callers pass to the batch methods).
    """
    if is_tensor(weights):
        weights = weights.detach().cpu().double().numpy()
    elif isinstance(weights, (list, tuple)) and any(is_tensor(row) for row in weights):
        weights = [row.detach().cpu().double().numpy() for row in weights]
    matrix = np.asarray(weights, dtype=np.float64)
    if isinstance(weights, (list, tuple)) and len(weights) == 0:
        matrix = matrix.reshape(0, size)
    single = check_weight_shape(matrix.shape, size)
    return np.ascontiguousarray(matrix.reshape(-1, size)), single


def as_node_ids(nodes: Any, n_nodes: int) -> np.ndarray:
    """`nodes` as a 1-d int64 array of node ids (a single int becomes a length-1 array).

    Raises:
        UnknownNode: if an id is negative, not below `n_nodes`, or not an integer.
        BadRequest: if `nodes` is not flat.
    """
    ids = np.asarray(nodes)
    if ids.ndim > 1:
        raise BadRequest(f"node ids must be a flat sequence, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise UnknownNode(f"node ids must be integers, got {ids.dtype} values")
    ids = ids.reshape(-1).astype(np.int64, copy=False)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n_nodes:
        bad = lo if lo < 0 else hi
        raise UnknownNode(
            f"node {bad} is not in the trie (nodes are 0..{n_nodes - 1})",
            node=bad,
            n_nodes=n_nodes,
        )
    return ids
