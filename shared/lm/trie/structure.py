"""`TokenCharacterTrie`: a vocabulary's byte strings as a trie, and token masses at its nodes.

Programs that constrain or generate text byte by byte need, for a next-token distribution, the
total (or largest) weight of all tokens under each byte prefix. The trie answers that for every
node at once (`weight_sum`, `weight_max` and their batch forms) or for the few nodes a request
names (``nodes=``), e.g. the children of one prefix (`children_of`).

This class computes a row at a time with one scatter (``ufunc.at``) per level: short, obviously
right, and the reference the bulk `ParallelTokenCharacterTrie` is checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np

from ...errors import UnknownNode
from ..tokens import Token
from .inputs import MAX, SUM, Reduction, as_node_ids, as_weight_matrix
from .layout import TrieLayout, build_layout

__all__ = ["TokenCharacterTrie", "LeafEdge"]

#: The key of a leaf edge in `TokenCharacterTrie.children`: ``(None, vocabulary position)``,
#: as in genlm-backend 0.3.1, so leaves of entries with equal bytes stay apart.
LeafEdge = tuple[None, int]


class TokenCharacterTrie:
    """A trie over a vocabulary's byte strings, numbered topologically (see `layout`).

    Args:
        decode: the vocabulary: `Token`s from `decode_vocab` or plain `bytes`; weight vectors
            are indexed by position in this list.

    Raises:
        ValueError: if `decode` is empty or two `Token`s share a token id.
        TypeError: if an entry is not bytes.
    """

    def __init__(self, decode: Sequence[bytes]) -> None:
        self.decode = list(decode)
        self.tokens = _as_tokens(self.decode)
        self.layout: TrieLayout = build_layout([bytes(t) for t in self.tokens])
        self.root = 0
        self.word2leaf: dict[Token, int] = dict(
            zip(self.tokens, self.layout.leaves.tolist(), strict=True)
        )
        self.leaf2word: dict[int, Token] = {leaf: tok for tok, leaf in self.word2leaf.items()}
        self._level_parents = [
            (int(lo), self.layout.parent[lo:hi])
            for lo, hi in zip(
                self.layout.level_starts[1:-1], self.layout.level_starts[2:], strict=True
            )
        ][::-1]

    @property
    def num_nodes(self) -> int:
        """The number of nodes, internal and leaves."""
        return self.layout.size

    @cached_property
    def node2prefix(self) -> list[bytes]:
        """The byte prefix each node spells (a leaf spells its token's bytes)."""
        prefixes: list[bytes] = [b""] * self.num_nodes
        for node, prefix in zip(self.layout.internal.tolist(), self.layout.prefixes, strict=True):
            prefixes[node] = prefix
        for leaf, token in zip(self.layout.leaves.tolist(), self.tokens, strict=True):
            prefixes[leaf] = bytes(token)
        return prefixes

    @cached_property
    def children(self) -> list[dict[int | LeafEdge, int]]:
        """Each node's outgoing edges: next byte -> child, and ``(None, position)`` -> leaf.

        Built on first use: a worker that only computes masses never needs 150k dicts.
        """
        edges: list[dict[int | LeafEdge, int]] = [{} for _ in range(self.num_nodes)]
        parent = self.layout.parent
        for node, prefix in zip(self.layout.internal.tolist(), self.layout.prefixes, strict=True):
            if prefix:
                edges[parent[node]][prefix[-1]] = node
        for position, leaf in enumerate(self.layout.leaves.tolist()):
            edges[parent[leaf]][(None, position)] = leaf
        return edges

    def node_of(self, prefix: bytes) -> int:
        """The internal node spelling `prefix`.

        Raises:
            UnknownNode: if no vocabulary entry starts with `prefix`.
        """
        try:
            return self.layout.node_of[bytes(prefix)]
        except KeyError:
            raise UnknownNode(f"no token starts with {bytes(prefix)!r}", prefix=prefix) from None

    def children_of(self, prefix: bytes) -> dict[int | LeafEdge, int]:
        """The edges out of the node spelling `prefix` (see `children`)."""
        return self.children[self.node_of(prefix)]

    def weight_sum(self, ws: Any, nodes: Any = None) -> np.ndarray:
        """Total weight of the tokens under each node (or under each of `nodes`).

        Args:
            ws: weights by vocabulary position: one vector (numpy or torch) or a batch.
            nodes: node ids to compute; all nodes when None.

        Returns:
            float64, shaped like `ws` with the vocabulary axis replaced by the nodes.

        Raises:
            VocabularyMismatch: if the vectors do not have exactly ``len(decode)`` entries.
            UnknownNode: if `nodes` names a node the trie lacks.
        """
        return self._reduce(ws, SUM, nodes, batch=False)

    def weight_max(self, ws: Any, nodes: Any = None) -> np.ndarray:
        """Largest weight among the tokens under each node; right for log-space weights too."""
        return self._reduce(ws, MAX, nodes, batch=False)

    def batch_weight_sum(self, ws: Any, nodes: Any = None) -> np.ndarray:
        """`weight_sum` of a batch (a 2-d array or a sequence of vectors); always 2-d."""
        return self._reduce(ws, SUM, nodes, batch=True)

    def batch_weight_max(self, ws: Any, nodes: Any = None) -> np.ndarray:
        """`weight_max` of a batch (a 2-d array or a sequence of vectors); always 2-d."""
        return self._reduce(ws, MAX, nodes, batch=True)

    def _reduce(self, ws: Any, reduction: Reduction, nodes: Any, batch: bool) -> np.ndarray:
        """Check the inputs once, then compute every node or only the requested ones."""
        matrix, single = self._weights(ws)
        if nodes is None:
            result = self._masses(matrix, reduction)
        else:
            result = self._masses_at(
                self._numpy(matrix), as_node_ids(nodes, self.num_nodes), reduction
            )
        return result[0] if single and not batch else result

    def _weights(self, ws: Any) -> tuple[Any, bool]:
        """The weights as the matrix `_masses` takes (subclasses may keep them on a device)."""
        return as_weight_matrix(ws, len(self.decode))

    def _numpy(self, matrix: Any) -> np.ndarray:
        """A matrix from `_weights` as a float64 numpy array."""
        return matrix

    def _masses(self, matrix: np.ndarray, reduction: Reduction) -> np.ndarray:
        """Every node's mass, one row at a time: leaves, then one ``ufunc.at`` per level."""
        out = np.empty((matrix.shape[0], self.num_nodes))
        for row, weights in zip(out, matrix, strict=True):
            row[self.layout.internal] = reduction.identity
            row[self.layout.leaves] = weights
            for start, parents in self._level_parents:
                reduction.ufunc.at(row, parents, row[start : start + len(parents)])
        return out

    def _masses_at(self, matrix: np.ndarray, nodes: np.ndarray, reduction: Reduction) -> np.ndarray:
        """Masses of `nodes` only: each node's tokens are one run of the byte-sorted vocabulary.

        Costs the total number of tokens under the requested nodes, so a request for the
        children of one prefix touches each token at most once; past the size of the trie,
        computing every node and picking is cheaper.
        """
        lo, hi = self.layout.lex_lo[nodes], self.layout.lex_hi[nodes]
        lengths = hi - lo
        total = int(lengths.sum())
        if total > self.num_nodes:
            return self._masses(matrix, reduction)[:, nodes]
        starts = np.cumsum(lengths) - lengths
        runs = np.arange(total) - np.repeat(starts - lo, lengths)
        values = matrix.take(self.layout.lex_order[runs], axis=1)
        if not len(nodes):
            return values
        return reduction.ufunc.reduceat(values, starts, axis=1)


def _as_tokens(decode: list[bytes]) -> list[Token]:
    """Each entry as a `Token` (plain bytes get their position as id); ids must be unique."""
    tokens = []
    for position, entry in enumerate(decode):
        if isinstance(entry, Token):
            tokens.append(entry)
        elif isinstance(entry, bytes):
            tokens.append(Token(position, entry))
        else:
            raise TypeError(f"vocabulary entry {position} is {type(entry).__name__}, not bytes")
    if len({t.token_id for t in tokens}) != len(tokens):
        raise ValueError("two vocabulary entries share a token id")
    return tokens
