"""`MockAsyncLM`: deterministic log-probabilities for tests and transport benchmarks."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shared.errors import ModelError

from .base import AsyncLM, reject_adapter

__all__ = ["MockAsyncLM"]


class MockAsyncLM(AsyncLM):
    """Log-probabilities drawn from a generator seeded by the exact token tuple.

    Equal prompts give bit-identical vectors in every process, so results through the queue
    can be compared with results computed in-process. Two knobs make it a stand-in for a
    real model in tests and benchmarks:

    Args:
        tokenizer: a HuggingFace tokenizer; its vocabulary sizes the vectors.
        batch_delay_s: sleep this long once per batch, like a GPU busy on a forward pass
            (no CPU is used while waiting).
        poison_token: a token id whose presence in a prompt makes the computation fail with
            `ModelError` (for fault-injection tests); None disables it.
    """

    backend_name = "mock"

    def __init__(
        self,
        tokenizer: Any,
        batch_delay_s: float = 0.0,
        poison_token: int | None = None,
        **vocab: Any,
    ) -> None:
        super().__init__(tokenizer, **vocab)
        self.batch_delay_s = batch_delay_s
        self.poison_token = poison_token
        self.batches_computed = 0

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> MockAsyncLM:
        """A mock over the vocabulary of `model_name`'s tokenizer."""
        from workers.models import load_tokenizer

        return cls(load_tokenizer(model_name), **kwargs)

    @property
    def revision(self) -> str:
        return "mock-v1"

    def _logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = self.check_prompt(token_ids)
        if self.poison_token is not None and self.poison_token in ids:
            raise ModelError(f"poison token {self.poison_token} in prompt", poison=True)
        digest = hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = torch.from_numpy(rng.standard_normal(self.vector_size, dtype=np.float32) * 3)
        return torch.log_softmax(logits, dim=-1)

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        reject_adapter(lora_name)
        return (await self._compute([token_ids]))[0]

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        reject_adapter(lora_name)
        return self._logprobs(token_ids)

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        reject_adapter(lora_name)
        return torch.stack(await self._compute(token_ids_list))

    async def _compute(self, token_ids_list: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        if self.batch_delay_s:
            await asyncio.sleep(self.batch_delay_s)
        self.batches_computed += 1
        return [self._logprobs(ids) for ids in token_ids_list]
