"""`QueueTrie`: byte-level masses of next-token distributions, computed by the workers.

A byte-level sampler asks, at each step, how much probability the model puts under each next
byte. The client keeps the trie's *structure* (node numbering, prefixes, children) to name
nodes and read answers; the workers hold the distributions and compute the masses, so only
the numbers asked for travel: the children of one prefix are a few dozen floats instead of a
49,152-float vector.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmqueue.shared.lm.trie import TokenCharacterTrie
from lmqueue.shared.lm.trie.inputs import as_node_ids
from lmqueue.shared.lm.validation import prompt_bytes
from lmqueue.shared.lm.vocab import vocab_digest
from lmqueue.shared.wire import ids_to_bytes

from .client import QueueLM

__all__ = ["QueueTrie"]


class QueueTrie:
    """Trie masses of a `QueueLM`'s next-token distributions.

    Create with ``await QueueTrie.create(lm)``. Masses are of probabilities: ``sum`` is the
    total probability of the tokens under a node, ``max`` the largest single one.
    """

    def __init__(self, lm: QueueLM, trie: TokenCharacterTrie) -> None:
        self.lm = lm
        self.trie = trie
        self.digest = vocab_digest([bytes(t) for t in lm.byte_vocab])

    @classmethod
    async def create(cls, lm: QueueLM) -> QueueTrie:
        """Build the trie structure of `lm`'s vocabulary (about half a second, off the loop)."""
        trie = await asyncio.to_thread(TokenCharacterTrie, lm.byte_vocab)
        return cls(lm, trie)

    async def mass_sum(
        self, token_ids: Sequence[int], nodes: Any = None, dtype: str | None = None
    ) -> np.ndarray:
        """Probability mass under each node (or each of `nodes`) after `token_ids`.

        Args:
            dtype: wire dtype of the answer; default float64 for node subsets, float32 for the
                whole vector (150k nodes for SmolLM2: 0.6 MB instead of 1.2 MB).

        Raises:
            UnknownNode: if `nodes` names a node the trie lacks (checked before sending).
        """
        return await self._masses(token_ids, "sum", nodes, dtype)

    async def mass_max(
        self, token_ids: Sequence[int], nodes: Any = None, dtype: str | None = None
    ) -> np.ndarray:
        """Largest single-token probability under each node (or each of `nodes`)."""
        return await self._masses(token_ids, "max", nodes, dtype)

    async def children_masses(
        self, token_ids: Sequence[int], prefix: bytes = b"", op: str = "sum"
    ) -> dict[int | tuple[None, int], float]:
        """Masses of the children of the node spelling `prefix`, keyed like `trie.children`.

        Keys are next bytes (ints) for inner children and ``(None, position)`` for the tokens
        that end exactly at `prefix`.
        """
        edges = self.trie.children_of(prefix)
        keys, nodes = list(edges), list(edges.values())
        masses = await self._masses(token_ids, op, nodes, None)
        return dict(zip(keys, masses.tolist(), strict=True))

    async def _masses(
        self, token_ids: Sequence[int], op: str, nodes: Any, dtype: str | None
    ) -> np.ndarray:
        info = self.lm.info
        tokens = prompt_bytes(token_ids, info.vocab_size, info.max_prompt_tokens)
        node_bytes = None
        if nodes is not None:
            node_bytes = ids_to_bytes(as_node_ids(nodes, self.trie.num_nodes))
        dtype = dtype or ("float32" if nodes is None else "float64")
        vector = await self.lm.request(
            tokens,
            "mass",
            dtype,
            mass_op=op,
            node_bytes=node_bytes,
            vocab_digest=self.digest,
        )
        return vector.astype(np.float64)
