"""How a vocabulary's token-character trie is numbered, as flat arrays.

Internal nodes are the distinct byte prefixes of the vocabulary (the root is ``b""``); every
vocabulary entry adds one leaf under the internal node that spells it, so entries with equal
bytes keep separate leaves and an empty entry's leaf hangs off the root.

Nodes are numbered level by level: level ``d`` holds the internal nodes at depth ``d`` and the
leaves of the entries of ``d - 1`` bytes. Within a level, internal nodes come first, sorted by
their number of children (most first; ties by their parent's number, then their last byte),
then the level's leaves in vocabulary order. The numbering is therefore topological (a parent
precedes its children), and bulk reductions get two properties for free:

- the children of one level are one contiguous block of node numbers, so gathering them
  reads a small, cache-hot window;
- the internal nodes with more than ``k`` children are a prefix of their level, so adding
  every parent's ``k``-th child is a single slice operation.

Leaves listed in vocabulary order per level make the one gather from the weight vector a few
forward sweeps.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TrieLayout", "build_layout"]


@dataclass(frozen=True, eq=False)
class TrieLayout:
    """The trie of a list of byte strings as arrays indexed by node number.

    Attributes:
        prefixes: the prefix spelled by each internal node, in node order (internal nodes of a
            level precede its leaves, so these are not the nodes ``0..len-1``).
        internal: the node number of each entry of `prefixes`.
        node_of: internal node number by prefix.
        parent: each node's parent (-1 for the root).
        level_starts: node number where each level starts, plus the total as last entry.
        level_internal: how many internal nodes each level has.
        leaves: the leaf node of each vocabulary position.
        leaf_positions: vocabulary positions in leaf-node order.
        lex_order: vocabulary positions sorted by their bytes (ties by position).
        lex_lo, lex_hi: for each node, the slice of `lex_order` holding the tokens beneath it.
    """

    prefixes: list[bytes]
    internal: np.ndarray
    node_of: dict[bytes, int]
    parent: np.ndarray
    level_starts: np.ndarray
    level_internal: np.ndarray
    leaves: np.ndarray
    leaf_positions: np.ndarray
    lex_order: np.ndarray
    lex_lo: np.ndarray
    lex_hi: np.ndarray

    @property
    def size(self) -> int:
        """The number of nodes, internal and leaves."""
        return int(self.level_starts[-1])

    @property
    def n_levels(self) -> int:
        """The number of levels (the longest entry's length plus two)."""
        return len(self.level_internal)


def build_layout(words: Sequence[bytes]) -> TrieLayout:
    """Number the trie of `words` as described in the module docstring.

    Raises:
        ValueError: if `words` is empty (a trie needs at least one leaf).
    """
    if not words:
        raise ValueError("a token-character trie needs at least one vocabulary entry")
    by_depth = _prefixes_by_depth(words)
    n_children = _child_counts(by_depth, words)
    levels = _order_levels(by_depth, n_children)
    by_length: list[list[int]] = [[] for _ in range(len(levels) - 1)]
    for position, word in enumerate(words):
        by_length[len(word)].append(position)
    level_leaves: list[list[int]] = [[], *by_length]
    return _number(levels, level_leaves, words)


def _prefixes_by_depth(words: Sequence[bytes]) -> list[list[bytes]]:
    """Every distinct prefix of `words`, grouped by length (walking down stops at a seen one)."""
    seen = {b""}
    by_depth: list[list[bytes]] = [[b""]]
    for word in words:
        for depth in range(len(word), 0, -1):
            prefix = word[:depth]
            if prefix in seen:
                break
            seen.add(prefix)
            while len(by_depth) <= depth:
                by_depth.append([])
            by_depth[depth].append(prefix)
    return by_depth


def _child_counts(by_depth: list[list[bytes]], words: Sequence[bytes]) -> dict[bytes, int]:
    """Children per internal prefix: one per next byte, one leaf per entry spelling it."""
    counts = dict.fromkeys((p for level in by_depth for p in level), 0)
    for level in by_depth[1:]:
        for prefix in level:
            counts[prefix[:-1]] += 1
    for word in words:
        counts[word] += 1
    return counts


def _order_levels(by_depth: list[list[bytes]], n_children: dict[bytes, int]) -> list[list[bytes]]:
    """Sort each level's internal nodes: most children first, then parent, then last byte."""
    levels = [[b""]]
    position = {b"": 0}
    for prefixes in by_depth[1:]:
        level = sorted(prefixes, key=lambda p: (-n_children[p], position[p[:-1]], p[-1]))
        position.update((p, i) for i, p in enumerate(level))
        levels.append(level)
    levels.append([])  # the deepest leaves live one level below the deepest prefix
    return levels


def _number(
    levels: list[list[bytes]], level_leaves: list[list[int]], words: Sequence[bytes]
) -> TrieLayout:
    """Assign node numbers level by level and derive the parent and range arrays."""
    n_words = len(words)
    node_of: dict[bytes, int] = {}
    internal: list[int] = []
    prefixes: list[bytes] = []
    leaves = np.empty(n_words, dtype=np.int64)
    starts = [0]
    for level, positions in zip(levels, level_leaves, strict=True):
        start = starts[-1]
        for i, prefix in enumerate(level):
            node_of[prefix] = start + i
            internal.append(start + i)
            prefixes.append(prefix)
        first_leaf = start + len(level)
        leaves[positions] = np.arange(first_leaf, first_leaf + len(positions))
        starts.append(first_leaf + len(positions))
    size = starts[-1]
    parent = np.full(size, -1, dtype=np.int64)
    internal_ids = np.array(internal, dtype=np.int64)
    parent[internal_ids[1:]] = [node_of[p[:-1]] for p in prefixes[1:]]
    parent[leaves] = [node_of[w] for w in words]
    lex_order, lex_lo, lex_hi = _lex_ranges(words, prefixes, internal_ids, leaves, size)
    return TrieLayout(
        prefixes=prefixes,
        internal=internal_ids,
        node_of=node_of,
        parent=parent,
        level_starts=np.array(starts, dtype=np.int64),
        level_internal=np.array([len(level) for level in levels], dtype=np.int64),
        leaves=leaves,
        leaf_positions=np.argsort(leaves, kind="stable"),
        lex_order=lex_order,
        lex_lo=lex_lo,
        lex_hi=lex_hi,
    )


def _lex_ranges(
    words: Sequence[bytes],
    prefixes: list[bytes],
    internal: np.ndarray,
    leaves: np.ndarray,
    size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In byte order, the tokens under any node are one contiguous run; find each run."""
    order = sorted(range(len(words)), key=words.__getitem__)
    sorted_words = [words[i] for i in order]
    lo = np.empty(size, dtype=np.int64)
    hi = np.empty(size, dtype=np.int64)
    lo[internal] = [bisect_left(sorted_words, p) for p in prefixes]
    hi[internal] = [_end_of_prefix(sorted_words, p) for p in prefixes]
    lex_order = np.array(order, dtype=np.int64)
    rank = np.empty(len(words), dtype=np.int64)
    rank[lex_order] = np.arange(len(words))
    lo[leaves] = rank
    hi[leaves] = rank + 1
    return lex_order, lo, hi


def _end_of_prefix(sorted_words: list[bytes], prefix: bytes) -> int:
    """Index just past the last word starting with `prefix` in `sorted_words`."""
    stem = prefix.rstrip(b"\xff")
    if not stem:
        return len(sorted_words)
    successor = stem[:-1] + bytes([stem[-1] + 1])
    return bisect_left(sorted_words, successor)
