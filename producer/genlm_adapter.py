"""`GenlmQueueLM`: a `QueueLM` seen as genlm-backend's `AsyncLM` (optional extra ``genlm``).

Programs built on genlm-backend (genlm-control's `PromptedLLM`, say) check that vocabulary
entries are ``genlm.backend.tokenization.Token`` and call the `AsyncLM` methods; this adapter
gives them both, forwarding every call to the queue.

LoRA adapters. genlm-backend's own backends load adapters in-process: ``add_new_lora(path,
name)`` then ``lora_name=name`` per call (0.3.1), or, in earlier releases, a stateful
``set_lora(path, name)`` / ``clear_lora()`` switching every later call. Here the workers hold
the adapters and serve them by name (``lmq adapter add`` or ``lmq worker --adapter``), so
``add_new_lora`` only remembers the name (the first call using it fails with `UnknownAdapter`,
listing the served ones, if the service has none of that name), ``set_lora`` makes a name the
default of this adapter's later calls and ``clear_lora`` returns them to the base model:
programs written against either style run unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmqueue.shared.adapters import validate_adapter_name

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
        #: Adapters the program named with `add_new_lora` (name -> its path, for reference).
        self.loras: dict[str, str] = {}
        #: The adapter `set_lora` made the default (None: the client's own, or the base).
        self.active_lora: str | None = None

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Remember `lora_name`, an adapter the service serves (its workers hold the weights)."""
        validate_adapter_name(lora_name)
        self.loras[lora_name] = str(lora_path)

    def remove_lora(self, lora_name: str) -> None:
        """Forget `lora_name` here (the service keeps serving it to others)."""
        self.loras.pop(lora_name, None)
        if self.active_lora == lora_name:
            self.active_lora = None

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Make `lora_name` the adapter of later calls that name none (earlier genlm style)."""
        if lora_path is not None:
            self.add_new_lora(lora_path, lora_name)
        self.active_lora = validate_adapter_name(lora_name)

    def clear_lora(self) -> None:
        """Later calls that name no adapter go to the base model (or the client's own)."""
        self.active_lora = None

    def _lora(self, lora_name: str | None) -> str | None:
        return lora_name if lora_name is not None else self.active_lora

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `next_token_logprobs`."""
        return await self.lm.next_token_logprobs(token_ids, self._lora(lora_name))

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `next_token_logprobs_sync`."""
        return self.lm.next_token_logprobs_sync(token_ids, self._lora(lora_name))

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `batch_next_token_logprobs`."""
        return await self.lm.batch_next_token_logprobs(token_ids_list, self._lora(lora_name))

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """The queue client's `batch_next_token_logprobs_sync`."""
        return self.lm.batch_next_token_logprobs_sync(token_ids_list, self._lora(lora_name))

    def clear_cache(self) -> None:
        """Forget the client's locally cached results."""
        self.lm.clear_cache()


def as_genlm(lm: QueueLM) -> GenlmQueueLM:
    """Wrap `lm` for programs written against genlm-backend."""
    return GenlmQueueLM(lm)
