"""`TrieMasses`: token-character trie masses of next-token distributions, on the worker.

A mass request names a prompt; the worker gets its log-probabilities (from the shared cache
or the backend, like any request) and answers with the probability mass under each trie node,
or only under the nodes asked for (the children of one byte prefix are a few dozen numbers
instead of a 150k-node vector). Node ids mean something only for one vocabulary, so a request
carries the digest of the vocabulary its client numbered nodes with, and a mismatch is refused.

Whole-vector requests of a batch (and of batches in flight together) are computed in one bulk
call through an `AsyncTokenCharacterTrie`, which lives between ``async with`` enter and exit
(the worker holds it for as long as it serves); node subsets are cheap and go one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

import numpy as np

from lmqueue.shared.errors import VocabularyMismatch
from lmqueue.shared.lm.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie
from lmqueue.shared.lm.vocab import vocab_digest
from lmqueue.shared.wire import Request

__all__ = ["TrieMasses"]


class TrieMasses:
    """Masses over one vocabulary's trie; the bulk work runs off the event loop.

    Args:
        byte_vocab: the backend's byte vocabulary (trie leaves by token id).
        max_batch_rows: the most whole vectors computed in one bulk call.
    """

    def __init__(self, byte_vocab: Sequence[bytes], max_batch_rows: int = 64) -> None:
        self.vocab_size = len(byte_vocab)
        self.digest = vocab_digest([bytes(t) for t in byte_vocab])
        self.trie = ParallelTokenCharacterTrie(list(byte_vocab), device="cpu")
        self.batcher = AsyncTokenCharacterTrie(self.trie, max_batch_rows=max_batch_rows)

    async def __aenter__(self) -> TrieMasses:
        await self.batcher.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.batcher.shutdown()

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
        if request.nodes is None:
            batched = self.batcher.mass_sum if request.mass_op == "sum" else self.batcher.mass_max
            return await batched(probabilities)
        compute = self.trie.weight_sum if request.mass_op == "sum" else self.trie.weight_max
        return await asyncio.to_thread(compute, probabilities, request.nodes)
