"""`TrieMasses`: token-character trie masses of next-token distributions, on the worker.

A mass request names a prompt; the worker gets its log-probabilities (from the shared cache
or the backend, like any request) and answers with the probability mass under each trie node,
or only under the nodes asked for (the children of one byte prefix are a few dozen numbers
instead of a 150k-node vector). Node ids mean something only for one vocabulary, so a request
carries the digest of the vocabulary its client numbered nodes with, and a mismatch is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from shared.errors import VocabularyMismatch
from shared.trie import ParallelTokenCharacterTrie
from shared.vocab import vocab_digest
from shared.wire import Request

__all__ = ["TrieMasses"]


class TrieMasses:
    """Masses over one vocabulary's trie; the bulk work runs off the event loop.

    Args:
        byte_vocab: the backend's byte vocabulary (trie leaves by token id).
    """

    def __init__(self, byte_vocab: Sequence[bytes]) -> None:
        self.vocab_size = len(byte_vocab)
        self.digest = vocab_digest([bytes(t) for t in byte_vocab])
        self.trie = ParallelTokenCharacterTrie(list(byte_vocab), device="cpu")

    async def masses(self, logprobs: np.ndarray, request: Request) -> np.ndarray:
        """Probability mass (``sum``) or largest token probability (``max``) under each node.

        Raises:
            VocabularyMismatch: if the request numbered nodes over another vocabulary.
            UnknownNode: if it names nodes this trie lacks.
        """
        if request.vocab_digest is not None and request.vocab_digest != self.digest:
            raise VocabularyMismatch(
                "the request's trie nodes were numbered over a different vocabulary",
                expected=self.digest,
                got=request.vocab_digest,
            )
        # A padded output layer has entries past the tokenizer's vocabulary: no token, no node.
        probabilities = np.exp(np.asarray(logprobs[: self.vocab_size], dtype=np.float64))
        compute = self.trie.weight_sum if request.mass_op == "sum" else self.trie.weight_max
        return await asyncio.to_thread(compute, probabilities, request.nodes)
