"""`EngineBackend`: what the vLLM and SGLang backends share around their engines.

Both keep an optional `OutputCache` of results (stored from the engine's thread, read from
callers'), refuse calls once closed, validate prompts the same way, and wrap engine failures
in `ModelError`. Both load a model from a HuggingFace directory: `engine_model_source` turns
any lmqueue model name, the GGUF aliases included, into one.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lmqueue.shared.errors import Cancelled, ModelError
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.lm.output_cache import OutputCache

__all__ = ["EngineBackend", "Key", "Result", "engine_error", "engine_model_source", "settle"]

Key = tuple[int, ...]
Result = torch.Tensor | BaseException


class EngineBackend(AsyncLM):
    """Result cache, closed state and prompt checks of an engine-driven backend.

    Args:
        tokenizer: the HuggingFace tokenizer of the model.
        cache_size: most result vectors kept in an `OutputCache` (0: none).
        cache_opts: further `OutputCache` options (``move_to_cpu``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        cache_size: int = 0,
        cache_opts: dict[str, Any] | None = None,
        **vocab: Any,
    ) -> None:
        super().__init__(tokenizer, **vocab)
        self.cache = OutputCache(cache_size, **(cache_opts or {})) if cache_size > 0 else None
        self._cache_lock = threading.Lock()  # results are stored from the engine's thread
        self._closed = False

    def _checked(self, token_ids: Any) -> Key:
        """The validated prompt as a key; `Cancelled` once the backend is closed."""
        if self._closed:
            raise Cancelled("the backend is closed")
        return tuple(self.check_prompt(token_ids))

    def _cache_get(self, key: Key) -> torch.Tensor | None:
        if self.cache is None:
            return None
        with self._cache_lock:
            return self.cache.get(key)

    def _cache_put(self, key: Key, value: torch.Tensor) -> None:
        if self.cache is not None:
            with self._cache_lock:
                self.cache[key] = value

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
