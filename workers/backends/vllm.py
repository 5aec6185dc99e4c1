"""`AsyncVirtualLM`: vLLM's v1 engine, in this process, behind `AsyncLM`.

vLLM batches continuously: every query becomes one engine request (``max_tokens=1``) the
moment it arrives, and each engine step runs whatever is waiting. Full-vocabulary rows come
from the capture processor (`vllm_logits`) that `vllm_engine.build_vllm_engine` installs;
a request's row is taken from the `RowSink` when vLLM reports the request finished.

Threads: one engine thread owns the engine -- it adds requests, steps while any are live, and
resolves callers' futures -- so forward passes never block the event loop, and async and sync
callers share one engine. Identical prompts in flight share one engine request. Callers hand
the thread closures through a queue and never touch the engine themselves.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from shared.errors import BadRequest, Cancelled, ModelError
from shared.lm.validation import reject_adapter

from .engine_backend import EngineBackend, Key, Result, engine_error, engine_model_source, settle
from .engine_imports import VLLM, require
from .options import check_options
from .vllm_engine import VLLMEngine, build_vllm_engine

__all__ = ["AsyncVirtualLM"]

logger = logging.getLogger(__name__)

Resolver = Callable[[Result], None]


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
        super().__init__(tokenizer, cache_size=cache_size, cache_opts=cache_opts, **vocab)
        self._handle = handle
        self._driver = _EngineThread(handle)

    #: lmqueue's own options of `from_name` (besides engine_opts); see workers.backends.options.
    OPTIONS = frozenset({"cache_size", "cache_opts"})

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> AsyncVirtualLM:
        """Load `model` (an alias, a model directory or a hub id) into in-process vLLM.

        Args:
            engine_opts: vLLM ``EngineArgs`` options over `engine_imports.VLLM_DEFAULTS`
                (prefix caching on); vLLM places the model itself.
            options: the constructor's keyword arguments.

        Raises:
            SettingsError: an option this backend does not accept.
            MissingEngine: vLLM is not installed (``pip install 'lmqueue[vllm]'``).
        """
        from workers.models import load_tokenizer

        check_options(cls.backend_name, options, cls.OPTIONS)
        require(VLLM)  # before minutes of loading
        source, revision = engine_model_source(model)
        tokenizer = load_tokenizer(model)
        handle = build_vllm_engine(source, engine_opts)
        handle = replace(handle, revision=f"{revision}+{handle.revision}")
        return cls(handle, tokenizer, **options)

    @property
    def vector_size(self) -> int:
        return self._handle.vector_size

    @property
    def max_prompt_tokens(self) -> int:
        return self._handle.max_prompt_tokens

    @property
    def revision(self) -> str:
        return self._handle.revision

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The next-token log-probabilities after `token_ids`; vLLM batches concurrent calls.

        Raises:
            BadRequest: (a subclass) for an invalid prompt.
            ModelError: if vLLM failed or returned no row.
            Cancelled: if the queries were reset or the backend closed.
        """
        reject_adapter(lora_name)
        key = self._checked(token_ids)
        cached = self._cache_get(key)
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._driver.submit([(key, _resolver(future, loop))])
        result = await future
        self._cache_put(key, result)
        return result

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The same, waiting in the calling thread (batched with any concurrent queries)."""
        return self.batch_next_token_logprobs_sync([token_ids], lora_name=lora_name)[0]

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Submit every prompt at once; the engine thread steps until all have finished."""
        reject_adapter(lora_name)
        keys = [self._checked(ids) for ids in token_ids_list]
        results: dict[Key, torch.Tensor] = {}
        futures: dict[Key, Future[torch.Tensor]] = {}
        for key in keys:
            cached = self._cache_get(key)
            if cached is not None:
                results[key] = cached
            elif key not in futures:
                futures[key] = Future()
        self._driver.submit([(key, _resolver(f)) for key, f in futures.items()])
        for key, future in futures.items():
            results[key] = future.result()
            self._cache_put(key, results[key])
        return torch.stack([results[key] for key in keys])

    def reset_async_queries(self) -> None:
        """Abort every request in the engine; their callers get `Cancelled`."""
        self._driver.reset(Cancelled("queries were reset"))

    def clear_cache(self) -> None:
        """Forget stored results, and have vLLM drop its prefix cache (if idle then)."""
        self._clear_results()
        if not self._closed:
            self._driver.call(lambda engine: engine.reset_prefix_cache(), wait=False)

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


class _EngineThread:
    """The one thread that calls the engine: it runs queued closures, steps while requests are
    live, and gives each finished request's row to every caller waiting for that prompt."""

    def __init__(self, handle: VLLMEngine) -> None:
        self._handle = handle
        self._engine = handle.engine
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._tags = (f"lmq-{n}" for n in itertools.count())
        self._by_key: dict[Key, str] = {}
        self._live: dict[str, tuple[Key, list[Resolver]]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lmq-vllm-engine", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def submit(self, queries: list[tuple[Key, Resolver]]) -> None:
        """Queue prompts; each resolver receives the row or the error."""
        self._check_running()

        def add_all() -> None:
            for key, resolve in queries:
                self._add(key, resolve)

        if queries:
            self._work.put(add_all)

    def reset(self, error: BaseException) -> None:
        """Abort every live request, failing its callers with `error`."""
        self._work.put(lambda: self._fail_all(error))

    def call(self, fn: Callable[[Any], Any], wait: bool = True) -> Any:
        """Run ``fn(engine)`` between steps; wait for its value unless `wait` is False."""
        self._check_running()
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self._engine))
            except Exception as exc:
                future.set_exception(exc)

        self._work.put(run)
        return future.result() if wait else None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Fail live requests with `Cancelled`, shut the engine down and end the thread."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout_s)

    def _check_running(self) -> None:
        if self._stopping or not self._thread.is_alive():
            raise Cancelled("the backend is closed")

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_work(block=not self._live):
                if self._live:
                    self._step()
        finally:
            self._stopping = True  # closures queued meanwhile still run: adds are cancelled
            while not self._work.empty():
                work = self._work.get_nowait()
                if work is not None:
                    work()
            self._fail_all(Cancelled("the backend closed"))
            try:
                self._handle.shutdown()
            except Exception:
                logger.warning("vLLM did not shut down cleanly", exc_info=True)

    def _run_work(self, block: bool) -> bool:
        """Run queued closures (waiting for one if `block`); False once told to stop."""
        try:
            work = self._work.get(block=block)
            while work is not None:
                work()
                work = self._work.get_nowait()
        except queue.Empty:
            return True
        return False

    def _add(self, key: Key, resolve: Resolver) -> None:
        if self._stopping:
            resolve(Cancelled("the backend closed"))
            return
        tag = self._by_key.get(key)
        if tag is not None:  # the same prompt is in flight: share its row
            self._live[tag][1].append(resolve)
            return
        tag = next(self._tags)
        try:
            prompt = {"type": "token", "prompt_token_ids": list(key)}  # vllm.inputs.TokensInput
            self._engine.add_request(tag, prompt, self._handle.sampling_params(tag))
        except ValueError as exc:  # vLLM's own input checks
            resolve(BadRequest(f"vLLM refused the prompt: {exc}"))
            return
        except Exception as exc:
            resolve(engine_error("vLLM", exc))
            return
        self._by_key[key] = tag
        self._live[tag] = (key, [resolve])

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.error("a vLLM step failed; failing %d requests", len(self._live), exc_info=exc)
            self._fail_all(engine_error("vLLM", exc))
            return
        for output in outputs:
            if output.finished:
                self._deliver(output)
        if self._live and not self._engine.has_unfinished_requests():
            self._fail_all(ModelError("vLLM dropped these requests without a result"))

    def _deliver(self, output: Any) -> None:
        entry = self._live.pop(output.request_id, None)
        if entry is None:  # already failed (reset) before vLLM finished it
            return
        key, resolvers = entry
        self._by_key.pop(key, None)
        row = self._handle.sink.take(output.request_id)
        reason = output.outputs[0].finish_reason if output.outputs else None
        result: Result
        if row is None or reason in ("abort", "error"):
            result = ModelError(f"vLLM returned no logits row (finish reason {reason!r})")
        else:
            try:
                result = torch.log_softmax(row.to(torch.float32), dim=-1).cpu()
            except Exception as exc:
                result = engine_error("vLLM", exc)
        for resolve in resolvers:
            resolve(result)

    def _fail_all(self, error: BaseException) -> None:
        live, self._live, self._by_key = self._live, {}, {}
        if not live:
            return
        self._handle.sink.discard(live)
        try:
            self._engine.abort_request(list(live))
        except Exception:
            logger.warning("vLLM could not abort %d requests", len(live), exc_info=True)
        for _, resolvers in live.values():
            for resolve in resolvers:
                resolve(error)
