"""`AsyncVirtualLM`: vLLM's engine, in this process, behind `AsyncLM`.

vLLM batches continuously: every query becomes one engine request (``max_tokens=1``) the
moment it arrives, and each engine step runs whatever is waiting. Full-vocabulary rows come
from the capture processor (`vllm_logits`) that `vllm_engine.build_vllm_engine` installs;
a request's row is taken from the `RowSink` when vLLM reports the request finished.

Threads: one engine thread (`vllm_driver.EngineThread`) owns the engine -- it adds requests,
steps while any are live, and resolves callers' futures -- so forward passes never block the
event loop, and async and sync callers share one engine. Identical prompts in flight share one
engine request. The cache-then-compute flow is `EngineBackend`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from lmqueue.shared.errors import AdaptersUnsupported, Cancelled, ModelError
from lmqueue.shared.lm.validation import check_loaded_adapter

from .engine_backend import Adapter, EngineBackend, Key, Result, engine_model_source, settle
from .engine_imports import VLLM, require
from .options import check_options
from .vllm_driver import EngineThread, Resolver
from .vllm_engine import VLLMEngine, build_vllm_engine, lora_options

__all__ = ["AsyncVirtualLM"]


class AsyncVirtualLM(EngineBackend):
    """A vLLM engine with full-vocabulary next-token log-probabilities.

    Args:
        handle: the engine and its capture wiring (`build_vllm_engine`; tests pass a fake).
        tokenizer: the HuggingFace tokenizer of the model.
        cache_size: most result vectors kept in an `OutputCache` (0: none).
        cache_opts: further `OutputCache` options (``move_to_cpu``).
    """

    backend_name = "vllm"

    def __init__(
        self,
        handle: VLLMEngine,
        tokenizer: Any,
        *,
        cache_size: int = 0,
        cache_opts: dict[str, Any] | None = None,
        **vocab: Any,
    ) -> None:
        super().__init__(handle, tokenizer, cache_size=cache_size, cache_opts=cache_opts, **vocab)
        self._driver = EngineThread(handle)
        self.supports_adapters = handle.lora_request is not None
        #: Loaded adapters: lmqueue name -> vLLM's LoRARequest (replaced whole, never mutated).
        self._loras: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)

    #: lmqueue's own options of `from_name` (besides engine_opts); see workers.backends.options.
    OPTIONS = frozenset({"cache_size", "cache_opts", "adapter_paths"})

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> AsyncVirtualLM:
        """Load `model` (an alias, a model directory or a hub id) into in-process vLLM.

        Args:
            engine_opts: vLLM ``EngineArgs`` options over `vllm_engine.VLLM_DEFAULTS`
                (prefix caching on; on CPU also `vllm_engine.CPU_DEFAULTS`); vLLM places the
                model itself.
            options: the constructor's keyword arguments, and ``adapter_paths``: the PEFT
                adapters the engine must be able to serve (the worker's ``--adapter``
                directories): LoRA is enabled and sized for them (`vllm_engine.lora_options`;
                ``engine_opts`` override). They are loaded by `load_adapter`, not here.

        Raises:
            SettingsError: an option this backend does not accept.
            MissingEngine: vLLM is not installed (``pip install 'lmqueue[vllm]'``).
        """
        from lmqueue.workers.models import load_tokenizer

        check_options(cls.backend_name, options, cls.OPTIONS)
        lora = lora_options(options.pop("adapter_paths", None) or [])
        require(VLLM)  # before minutes of loading
        source, revision = engine_model_source(model)
        tokenizer = load_tokenizer(model)
        handle = build_vllm_engine(source, {**lora, **(engine_opts or {})})
        handle = replace(handle, revision=f"{revision}+{handle.revision}")
        return cls(handle, tokenizer, **options)

    # -- LoRA adapters -----------------------------------------------------------------------------
    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(self._loras)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter in `path` into vLLM as `name` (replacing one of that name).

        Raises:
            AdaptersUnsupported: the engine was built without LoRA.
            ModelError: vLLM refused the adapter (unreadable, or a rank above the engine's).
        """
        make = self._handle.lora_request
        if make is None:
            raise AdaptersUnsupported(
                "this vLLM engine was started without LoRA: give the worker its adapters with "
                '--adapter at start, or engine_opts {"enable_lora": true, "max_lora_rank": R}'
            )
        number = next(self._lora_ids)
        lora = make(f"{name}#{number}", number, os.path.abspath(path))
        try:
            added = await asyncio.to_thread(self._driver.call, lambda engine: engine.add_lora(lora))
        except Cancelled:
            raise
        except Exception as exc:
            raise ModelError(f"vLLM could not load adapter {name} from {path}: {exc}") from exc
        if not added:
            raise ModelError(f"vLLM did not load adapter {name} from {path}")
        previous, self._loras[name] = self._loras.get(name), lora
        self._clear_results()
        if previous is not None:
            await self._remove_lora(previous)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; vLLM frees its weights (requests already running finish)."""
        lora = self._loras.pop(name, None)
        if lora is not None:
            self._clear_results()
            await self._remove_lora(lora)

    async def _remove_lora(self, lora: Any) -> None:
        try:
            await asyncio.to_thread(
                self._driver.call, lambda engine: engine.remove_lora(lora.lora_int_id)
            )
        except Cancelled:  # closed: the engine and its adapters are gone anyway
            pass

    # -- queries -----------------------------------------------------------------------------------
    async def _compute(self, key: Key, adapter: Adapter) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._driver.submit([(key, self._lora(adapter), _resolver(future, loop))])
        return await future

    def _compute_sync(self, keys: list[Key], adapter: Adapter) -> dict[Key, Result]:
        futures: dict[Key, Future[torch.Tensor]] = {key: Future() for key in keys}
        lora = self._lora(adapter)
        self._driver.submit([(key, lora, _resolver(future)) for key, future in futures.items()])
        results: dict[Key, Result] = {}
        for key, future in futures.items():
            try:
                results[key] = future.result()
            except Exception as exc:  # each prompt's own error
                results[key] = exc
        return results

    def _lora(self, adapter: Adapter) -> Any:
        """The LoRARequest of a loaded `adapter` (None: the base model)."""
        if adapter is None:
            return None
        lora = self._loras.get(adapter)
        if lora is None:  # unloaded since EngineBackend checked it
            check_loaded_adapter(adapter, self.adapter_names)
        return lora

    def reset_async_queries(self) -> None:
        """Abort every request in the engine; their callers get `Cancelled`."""
        self._driver.reset(Cancelled("queries were reset"))

    def clear_cache(self) -> None:
        """Forget stored results and vLLM's prefix cache (dropped as soon as no request runs)."""
        self._clear_results()
        try:
            self._driver.reset_prefix_cache()
        except Cancelled:  # closed: nothing is kept
            pass

    def clear_kv_cache(self) -> bool:
        """Drop vLLM's prefix cache now; False if requests were running and it was kept."""
        return bool(self._driver.call(lambda engine: engine.reset_prefix_cache()))

    async def aclose(self) -> None:
        """Cancel live queries, stop the engine thread and shut vLLM down."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """`aclose` for programs without an event loop."""
        if not self._closed:
            self._closed = True
            self._driver.stop()


def _resolver(future: Any, loop: asyncio.AbstractEventLoop | None = None) -> Resolver:
    """Settle `future` from the engine thread: an asyncio one through its `loop`, a concurrent
    one directly. A future already done (its caller cancelled) is left alone."""

    if loop is None:
        return lambda result: settle(future, result)

    def resolve(result: Result) -> None:
        try:
            loop.call_soon_threadsafe(settle, future, result)
        except RuntimeError:  # the loop is closed: nobody waits for this result
            pass

    return resolve
