"""`AsyncSGLTransformer`: SGLang 0.5.23's ``Engine`` behind `AsyncLM`. UNVERIFIED on a real
engine (SGLang needs CUDA; see docs/ENGINES.md).

Rows come from a custom logit processor writing to shared memory (`sgl_capture`, built in
`sgl_engine`): every prompt is one ``async_generate`` with ``max_new_tokens=1``.

Concurrency: calls queue up; one drain takes everything queued into one `SGLEngine.compute`
(concurrent requests SGLang batches itself), identical prompts (queued or in flight) share one
request (`_pending` waiters), and the engine is called from one dedicated thread -- for
synchronous calls too -- so the event loop keeps serving and SGLang's own event loop is never
driven by two threads at once. The cache-then-compute flow is `EngineBackend`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from lmqueue.shared.errors import Cancelled, ModelError

from .engine_backend import (
    Adapter,
    EngineBackend,
    Key,
    Result,
    engine_error,
    engine_model_source,
    settle,
)
from .engine_imports import SGLANG, require
from .options import check_options, gpu_index
from .sgl_engine import SGLEngine, build_sgl_engine

__all__ = ["AsyncSGLTransformer"]

logger = logging.getLogger(__name__)


class AsyncSGLTransformer(EngineBackend):
    """An SGLang engine with batching, prompt sharing and a result cache.

    Args:
        handle: the engine and its capture rows (`build_sgl_engine`; tests pass a fake
            engine with the real one's methods).
        tokenizer: the HuggingFace tokenizer of the model.
        cache_size: most result vectors kept in an `OutputCache` (0: none).
        cache_opts: further `OutputCache` options (``move_to_cpu``).
    """

    backend_name = "sgl"

    def __init__(
        self,
        handle: SGLEngine,
        tokenizer: Any,
        *,
        cache_size: int = 0,
        cache_opts: dict[str, Any] | None = None,
        **vocab: Any,
    ) -> None:
        super().__init__(handle, tokenizer, cache_size=cache_size, cache_opts=cache_opts, **vocab)
        self._executor = ThreadPoolExecutor(1, "lmq-sgl")  # the one thread calling SGLang
        self._queue: deque[Key] = deque()  # prompts waiting for the next drain
        self._pending: dict[Key, list[asyncio.Future[torch.Tensor]]] = {}  # queued or in flight
        self._runner: asyncio.Task[None] | None = None

    #: lmqueue's own options of `from_name` (besides engine_opts); see workers.backends.options.
    OPTIONS = frozenset({"cache_size", "cache_opts", "device", "capture_slots"})

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> AsyncSGLTransformer:
        """Start SGLang on `model` (an alias, directory or hub id).

        Args:
            engine_opts: ``sglang.Engine`` (ServerArgs) options over `sgl_engine.SGL_DEFAULTS`.
            options: the constructor's keyword arguments; ``device`` (``cuda:N``, default
                ``cuda:0``), the GPU; ``capture_slots`` (default 64), prompts in flight at once.

        Raises:
            SettingsError: an option this backend does not accept.
            MissingEngine: SGLang is not installed (``pip install 'lmqueue[sgl]'``).
        """
        from lmqueue.workers.models import load_tokenizer

        check_options(cls.backend_name, options, cls.OPTIONS)
        gpu_id = gpu_index(options.pop("device", None) or "cuda:0")
        slots = int(options.pop("capture_slots", 64))
        require(SGLANG)  # before minutes of loading
        source, revision = engine_model_source(model)
        tokenizer = load_tokenizer(model)
        handle = build_sgl_engine(source, engine_opts, gpu_id, slots)
        handle = replace(handle, revision=f"{revision}+{handle.revision}")
        return cls(handle, tokenizer, **options)

    # -- asynchronous queries ------------------------------------------------------------------
    async def _compute(self, key: Key, adapter: Adapter) -> torch.Tensor:
        # `adapter` is always None: this backend loads none, and EngineBackend refuses others
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        waiters = self._pending.get(key)
        if waiters is not None:  # queued or in flight already: wait for that computation
            waiters.append(future)
        else:
            self._pending[key] = [future]
            self._queue.append(key)
            if self._runner is None:
                self._runner = asyncio.create_task(self._drain())
        return await future

    def reset_async_queries(self) -> None:
        """Fail every queued and in-flight query with `Cancelled` (a running drain finishes;
        its rows are dropped)."""
        error = Cancelled("queries were reset")
        pending, self._pending, self._queue = self._pending, {}, deque()
        for futures in pending.values():
            for future in futures:
                settle(future, error)

    async def _drain(self) -> None:
        """Compute queued prompts until none is left (a later query starts a new drain)."""
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                keys = self._take_queue()
                if not keys:
                    continue
                try:
                    rows = await loop.run_in_executor(self._executor, self._handle.compute, keys)
                except asyncio.CancelledError:
                    self._resolve(dict.fromkeys(keys, Cancelled("the backend closed")))
                    raise
                except Exception as exc:
                    logger.error("an SGLang drain failed", exc_info=exc)
                    rows = dict.fromkeys(keys, engine_error("SGLang", exc))
                missing = ModelError("SGLang finished without a row for this prompt")
                self._resolve({key: rows.get(key, missing) for key in keys})
        finally:
            self._runner = None

    def _take_queue(self) -> list[Key]:
        """Every queued prompt someone still waits for."""
        keys = []
        while self._queue:
            key = self._queue.popleft()
            waiters = self._pending.get(key)
            if waiters is None:  # reset since it was queued
                continue
            if all(future.done() for future in waiters):  # every caller was cancelled
                del self._pending[key]
                continue
            keys.append(key)
        return keys

    def _resolve(self, rows: dict[Key, Result]) -> None:
        """Give each prompt's result to every caller waiting for it."""
        for key, result in rows.items():
            for future in self._pending.pop(key, []):
                settle(future, result)

    # -- synchronous queries -------------------------------------------------------------------
    def _compute_sync(self, keys: list[Key], adapter: Adapter) -> dict[Key, Result]:
        rows: dict[Key, Result] = self._on_engine_thread(self._handle.compute, keys)
        return rows

    def clear_cache(self) -> None:
        """Forget stored results and SGLang's KV and radix caches (if no request runs then)."""
        self._clear_results()
        if not self._closed:
            self.clear_kv_cache()

    def clear_kv_cache(self) -> bool:
        """Flush SGLang's KV and radix caches; False if requests were running."""
        return bool(self._on_engine_thread(self._handle.flush))

    def _on_engine_thread(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the thread that calls SGLang, waited for here.

        Raises:
            Cancelled: the backend is closed.
            ModelError: SGLang failed.
        """
        try:
            future = self._executor.submit(fn, *args)
        except RuntimeError as exc:  # the executor is shut down
            raise Cancelled("the backend is closed") from exc
        try:
            return future.result()
        except Exception as exc:
            raise engine_error("SGLang", exc) from exc

    async def aclose(self) -> None:
        """Fail queued queries, let a running drain finish, and shut SGLang down."""
        if self._closed:
            return
        self._closed = True
        self.reset_async_queries()
        if self._runner is not None:
            await asyncio.wait([self._runner])
        await asyncio.to_thread(self._executor.shutdown, True)
        try:
            self._handle.shutdown()
        except Exception:
            logger.warning("SGLang did not shut down cleanly", exc_info=True)
