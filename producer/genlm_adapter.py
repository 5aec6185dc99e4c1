"""`GenlmQueueLM`: a `QueueLM` seen as genlm-backend's `AsyncLM` (optional extra ``genlm``).

Programs built on genlm-backend (genlm-control's `PromptedLLM`, say) check that vocabulary
entries are ``genlm.backend.tokenization.Token`` and call the `AsyncLM` methods; this adapter
gives them both, forwarding every call to the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .client import QueueLM

__all__ = ["GenlmQueueLM", "as_genlm"]

try:
    from genlm.backend.llm import AsyncLM as _GenlmAsyncLM
    from genlm.backend.tokenization import Token as _GenlmToken
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lmqueue.producer.genlm_adapter needs genlm-backend: pip install 'lmqueue[genlm]'"
    ) from exc


class GenlmQueueLM(_GenlmAsyncLM):
    """genlm-backend's `AsyncLM` interface, answered through a connected `QueueLM`.

    genlm's own constructor is not called: it would decode the whole vocabulary again, and
    the queue client already holds it.
    """

    def __init__(self, lm: QueueLM) -> None:
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.byte_vocab = [_GenlmToken(t.token_id, bytes(t)) for t in lm.byte_vocab]
        self.str_vocab = lm.str_vocab
        self._batch_queue: list[Any] = []
        self._batch_armed = False

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `next_token_logprobs`."""
        return await self.lm.next_token_logprobs(token_ids, lora_name)

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `next_token_logprobs_sync`."""
        return self.lm.next_token_logprobs_sync(token_ids, lora_name)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `batch_next_token_logprobs`."""
        return await self.lm.batch_next_token_logprobs(token_ids_list, lora_name)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `batch_next_token_logprobs_sync`."""
        return self.lm.batch_next_token_logprobs_sync(token_ids_list, lora_name)

    def clear_cache(self) -> None:
        """Forget the client's locally cached results."""
        self.lm.clear_cache()


def as_genlm(lm: QueueLM) -> GenlmQueueLM:
    """Wrap `lm` for programs written against genlm-backend."""
    return GenlmQueueLM(lm)
