"""`AsyncLM`: the interface every backend implements, and so does the client, `QueueLM`.

A backend maps a tokenized prompt to the normalized log-probabilities of the next token, as a
1-d float32 tensor of length `vector_size`. Concurrent `next_token_logprobs` calls are the unit
of batching: backends that batch (HF, vLLM, SGLang) gather them into one forward pass.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmqueue.shared.errors import AdaptersUnsupported
from lmqueue.shared.lm.tokens import Token
from lmqueue.shared.lm.validation import check_prompt
from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.shared.wire import deferred_payload

if TYPE_CHECKING:  # torch is imported where a tensor is made: a client may never need it
    import torch

__all__ = ["AsyncLM", "BackendCounters"]


@dataclass(frozen=True, slots=True)
class BackendCounters:
    """A backend's own cache counters, read by a worker's metrics at each scrape; ``None`` for
    what the backend does not keep (``lmq_*`` series are exported only for the others)."""

    computed_tokens: int | None = None  # prompt positions run through the model
    reused_tokens: int | None = None  # positions whose KV came from the prefix cache
    result_hits: int | None = None  # calls answered from the backend's result cache
    result_misses: int | None = None
    kv_tokens: int | None = None  # KV positions held now
    max_kv_tokens: int | None = None  # and at most
    kv_bytes: int | None = None


class AsyncLM(ABC):
    """An asynchronous language model over a HuggingFace tokenizer's vocabulary.

    Attributes:
        tokenizer: the HuggingFace tokenizer.
        byte_vocab: ``byte_vocab[i]`` is the `Token` (bytes) of token id ``i``.
        str_vocab: ``str_vocab[i]`` is its text.
    """

    #: Short backend name as used by ``lmq worker --backend``.
    backend_name = "abstract"
    #: Batches the backend computes at once (a worker keeps that many, plus one, in hand).
    parallel_forwards = 1

    def __init__(
        self,
        tokenizer: Any,
        byte_vocab: list[Token] | None = None,
        str_vocab: list[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        if byte_vocab is None or str_vocab is None:
            byte_vocab, str_vocab = decode_vocab(tokenizer)
        self.byte_vocab = byte_vocab
        self.str_vocab = str_vocab

    # -- what a worker publishes ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids a prompt may use."""
        return len(self.byte_vocab)

    @property
    def vector_size(self) -> int:
        """Length of a log-probability vector (the model's output size)."""
        return len(self.byte_vocab)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the model accepts; 0 if unbounded."""
        return 0

    @property
    def revision(self) -> str:
        """An identifier of the weights: results of equal revisions are interchangeable."""
        return "unknown"

    # -- LoRA adapters (backends that serve them override these) --------------------------------
    #: Whether `load_adapter` works and ``lora_name=`` may name a loaded adapter.
    supports_adapters = False

    @property
    def adapter_names(self) -> frozenset[str]:
        """The LoRA adapters loaded now."""
        return frozenset()

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in directory `path` as `name` (replacing one of that name).

        Raises:
            AdaptersUnsupported: this backend serves no adapters.
        """
        raise AdaptersUnsupported(f"the {self.backend_name} backend serves no LoRA adapters")

    async def unload_adapter(self, name: str) -> None:  # noqa: B027 - a no-op by default
        """Forget adapter `name` and everything computed with it (no-op if not loaded)."""

    def check_prompt(self, token_ids: Any) -> list[int]:
        """Validate a prompt against this model; return it as a list of ints."""
        return check_prompt(token_ids, self.vocab_size, self.max_prompt_tokens).tolist()

    # -- the interface -------------------------------------------------------------------------
    @abstractmethod
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The next-token log-probabilities after `token_ids`; concurrent calls are batched."""

    @abstractmethod
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The same, computed synchronously (no batching)."""

    async def logprobs_batch(
        self, prompts: Sequence[tuple[str | None, Sequence[int]]]
    ) -> list[torch.Tensor | BaseException]:
        """Each prompt's log-probabilities under its adapter (None: the base model), or the
        exception its computation raised, in order.

        The worker's entry point: a batch it read, de-duplicated and validated, in one call.
        This default makes one `next_token_logprobs` call per prompt, concurrently, which suits
        backends that batch concurrent calls themselves (vLLM, SGLang); the hf and mock
        backends take the batch as it is, in one forward.
        """
        calls = [
            self.next_token_logprobs(ids, lora_name=adapter)
            if adapter is not None
            else self.next_token_logprobs(ids)
            for adapter, ids in prompts
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    def wire_payload(self, logprobs: torch.Tensor, dtype: str) -> Any:
        """`logprobs` (a row `logprobs_batch` returned) in wire dtype `dtype`, as the worker
        replies with it and writes it to the shared cache.

        By default float32 goes out as a view of the row and a 16-bit dtype is converted later,
        on the worker's writer thread (`shared.wire.deferred_payload`): a conversion the CPU
        pays for every reply. A backend that holds the row's bytes in that dtype already
        (narrowed where it was computed, or precomputed) returns them instead; they must be
        exactly the default's bytes, so a reply is the same whichever made it.
        """
        return deferred_payload(logprobs, dtype)

    def reused_tokens(self, prompts: Iterable[tuple[str | None, Sequence[int]]]) -> int:
        """How many of `prompts`' positions a forward now would not compute: a stored result
        (all of its prompt) or a stored past (KV) that the prompt extends. 0 by default (a
        backend whose engine keeps its own prefix cache does not say).

        The worker charges a tenant's fair share what its calls computed (`FairShare`): a
        sampler's prompts extend its last step's, so charging their whole length made its
        next step share a forward with several times fewer of its rows than its work
        deserved (BENCHMARKS.md, fairness, real model). Asked before the forward, so an
        estimate; `prompts` may be lazy (a backend that does not say need not build them).
        """
        return 0

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities for each prompt, stacked into a ``(len(list), vector_size)`` tensor."""
        import torch

        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name=lora_name) for ids in token_ids_list)
        )
        return torch.stack(rows)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Synchronous `batch_next_token_logprobs`."""
        import torch

        return torch.stack(
            [self.next_token_logprobs_sync(ids, lora_name=lora_name) for ids in token_ids_list]
        )

    def counters(self) -> BackendCounters:
        """The backend's cache counters (`BackendCounters`); none by default."""
        return BackendCounters()

    def clear_cache(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Forget every cached result and every cached KV or prefix the backend keeps.

        The same on every backend: afterwards each prompt's next row is computed from the
        weights. HF drops its results and KV at once; vLLM and SGLang drop lmqueue's results
        at once and their engine's prefix/radix cache as soon as no request runs (the engines
        refuse while requests run). A client (`QueueLM`) forgets what it cached itself.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release engines, threads and devices; the backend is unusable afterwards."""

    async def __aenter__(self) -> AsyncLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- helpers for subclasses ------------------------------------------------------------------
    @staticmethod
    def _as_logprobs(logits: torch.Tensor) -> torch.Tensor:
        """Normalize one row of logits to float32 log-probabilities on the CPU."""
        import torch

        return torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()
