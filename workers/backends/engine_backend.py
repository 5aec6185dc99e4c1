"""`EngineBackend`: what the vLLM and SGLang backends share around their engines.

Both take the model's limits and revision from an engine handle, keep an optional
`OutputCache` of results (stored from the engine's thread, read from callers'), refuse calls
once closed, validate prompts the same way, answer a prompt from the cache before asking the
engine, compute each distinct prompt of a synchronous batch once, and wrap engine failures in
`ModelError`. A subclass supplies only how one prompt is computed asynchronously
(`_compute`) and how a set of distinct prompts is computed synchronously (`_compute_sync`).
A result is stored under its adapter and its tokens: a backend that serves LoRA adapters
(vLLM's) never answers one adapter's prompt with another's row.
Both load a model from a HuggingFace directory: `engine_model_source` turns any lmqueue
model name, the GGUF aliases included, into one.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from lmqueue.shared.errors import Cancelled, ModelError
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.lm.output_cache import OutputCache
from lmqueue.shared.lm.validation import check_loaded_adapter

__all__ = [
    "Adapter",
    "EngineBackend",
    "Key",
    "Result",
    "engine_error",
    "engine_model_source",
    "settle",
]

Key = tuple[int, ...]
Result = torch.Tensor | BaseException
#: The LoRA adapter a prompt is asked under (None: the base model).
Adapter = str | None


class EngineBackend(AsyncLM):
    """Limits, result cache, closed state and the call flow of an engine-driven backend.

    Args:
        handle: the engine handle; its ``vector_size``, ``max_prompt_tokens`` and
            ``revision`` are the backend's.
        tokenizer: the HuggingFace tokenizer of the model.
        cache_size: most result vectors kept in an `OutputCache` (0: none).
        cache_opts: further `OutputCache` options (``move_to_cpu``).
    """

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        *,
        cache_size: int = 0,
        cache_opts: dict[str, Any] | None = None,
        **vocab: Any,
    ) -> None:
        super().__init__(tokenizer, **vocab)
        self._handle = handle
        self.cache = OutputCache(cache_size, **(cache_opts or {})) if cache_size > 0 else None
        self._cache_lock = threading.Lock()  # results are stored from the engine's thread
        self._closed = False

    @property
    def vector_size(self) -> int:
        return int(self._handle.vector_size)

    @property
    def max_prompt_tokens(self) -> int:
        return int(self._handle.max_prompt_tokens)

    @property
    def revision(self) -> str:
        return str(self._handle.revision)

    # -- the call flow ---------------------------------------------------------------------------
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The next-token log-probabilities after `token_ids`; the engine batches concurrent calls.

        Raises:
            BadRequest: (a subclass) for an invalid prompt.
            ModelError: if the engine failed or returned no row.
            Cancelled: if the queries were reset or the backend closed.
        """
        check_loaded_adapter(lora_name, self.adapter_names)
        key = self._checked(token_ids)
        cached = self._cache_get(key, lora_name)
        if cached is not None:
            return cached
        result = await self._compute(key, lora_name)
        self._cache_put(key, lora_name, result)
        return result

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The same, waiting in the calling thread (batched with any concurrent queries)."""
        return self.batch_next_token_logprobs_sync([token_ids], lora_name=lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Every prompt's row, in order; each distinct uncached prompt is computed once."""
        check_loaded_adapter(lora_name, self.adapter_names)
        keys = [self._checked(ids) for ids in token_ids_list]
        results: dict[Key, torch.Tensor] = {}
        missing: dict[Key, None] = {}
        for key in keys:
            cached = self._cache_get(key, lora_name)
            if cached is not None:
                results[key] = cached
            else:
                missing[key] = None
        if missing:
            computed = self._compute_sync(list(missing), lora_name)
            for key in missing:
                result = computed.get(key, ModelError("the engine returned no row for a prompt"))
                if isinstance(result, BaseException):
                    raise result
                results[key] = result
                self._cache_put(key, lora_name, result)
        return torch.stack([results[key] for key in keys])

    @abstractmethod
    async def _compute(self, key: Key, adapter: Adapter) -> torch.Tensor:
        """The engine's row for one validated, uncached prompt under a loaded `adapter`."""

    @abstractmethod
    def _compute_sync(self, keys: list[Key], adapter: Adapter) -> dict[Key, Result]:
        """The engine's rows (or errors) for distinct validated prompts under a loaded
        `adapter`, in the calling thread."""

    # -- helpers -----------------------------------------------------------------------------------
    def _checked(self, token_ids: Any) -> Key:
        """The validated prompt as a key; `Cancelled` once the backend is closed."""
        if self._closed:
            raise Cancelled("the backend is closed")
        return tuple(self.check_prompt(token_ids))

    def _cache_get(self, key: Key, adapter: Adapter) -> torch.Tensor | None:
        if self.cache is None:
            return None
        with self._cache_lock:
            return self.cache.get((adapter, key))

    def _cache_put(self, key: Key, adapter: Adapter, value: torch.Tensor) -> None:
        if self.cache is not None:
            with self._cache_lock:
                self.cache[(adapter, key)] = value

    def _clear_results(self) -> None:
        if self.cache is not None:
            with self._cache_lock:
                self.cache.clear()


def settle(future: Any, result: Result) -> None:
    """Resolve `future` with a row or an error, unless its caller already gave up on it."""
    if not future.done():
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def engine_error(engine: str, exc: BaseException) -> ModelError:
    """A `ModelError` saying `engine` failed, chained to `exc`."""
    error = ModelError(f"{engine} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def engine_model_source(name: str) -> tuple[str, str]:
    """``(directory or hub id, revision)`` an engine can load `name` from.

    A GGUF alias is converted once to a HuggingFace directory with its tokenizer
    (`workers.models.hf_directory`), which vLLM and SGLang load like any other.
    """
    from lmqueue.workers.models import hf_directory, resolve_model

    return hf_directory(name), resolve_model(name).revision
