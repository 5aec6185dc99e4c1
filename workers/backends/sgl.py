"""`AsyncSGLTransformer`: an SGLang scheduler, driven in this process, behind `AsyncLM`.

SGLang's public APIs return top-k log-probabilities as Python lists; full rows come from its
``Scheduler`` (sglang 0.5.17, ``srt/managers/scheduler.py``) driven the way its own
``event_loop_normal`` drives it: ``process_input_requests``, then ``get_next_batch_to_run`` /
``run_batch`` / ``process_batch_result`` until no batch is left. Requests ask for
``max_new_tokens=0`` (prefill only: SGLang samples nothing), and a request's row of
``logits_output.next_token_logits`` is taken in the batch where it becomes finished -- a prompt
split into chunks finishes only with its last chunk, whose row follows the final prompt token.

Concurrency: calls queue up; one drain takes everything queued into one batch, identical
prompts (queued or in flight) share one request (`_pending` waiters, `_inflight` keys), and
the scheduler runs on one dedicated thread -- for synchronous calls too -- so the event loop
keeps serving and the scheduler is never driven by two threads at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from shared.errors import Cancelled, ModelError

from .engine_backend import EngineBackend, Key, Result, engine_error, engine_model_source, settle
from .engine_imports import SGLANG, SGLEngine, build_sgl_engine, require
from .options import check_options, gpu_index

__all__ = ["AsyncSGLTransformer"]

logger = logging.getLogger(__name__)


class AsyncSGLTransformer(EngineBackend):
    """An in-process SGLang scheduler with batching, prompt sharing and a result cache.

    Args:
        handle: the scheduler and what driving it takes (`build_sgl_engine`; tests pass a
            fake scheduler with the real one's methods).
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
        self.model = handle.scheduler
        # One thread drives the scheduler, selecting its GPU (a new thread's default is 0).
        self._executor = ThreadPoolExecutor(1, "lmq-sgl", _bind_device, (handle.gpu_id,))
        self._counter = itertools.count()  # next() on a count is atomic: any thread may take one
        self._queue: deque[Key] = deque()  # prompts waiting for the next batch
        self._pending: dict[Key, list[asyncio.Future[torch.Tensor]]] = {}  # queued or in flight
        self._inflight: dict[str, Key] = {}  # rid -> prompt, for requests in the scheduler
        self._runner: asyncio.Task[None] | None = None

    #: lmqueue's own options of `from_name` (besides engine_opts); see workers.backends.options.
    OPTIONS = frozenset({"cache_size", "cache_opts", "device"})

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> AsyncSGLTransformer:
        """Start an SGLang scheduler on `model` (an alias, directory or hub id).

        Args:
            engine_opts: SGLang ``ServerArgs`` options over `engine_imports.SGL_DEFAULTS`.
            options: the constructor's keyword arguments, and ``device`` (``cuda:N``, default
                ``cuda:0``): the GPU the scheduler runs on.

        Raises:
            SettingsError: an option this backend does not accept.
            MissingEngine: SGLang is not installed (``pip install 'lmqueue[sgl]'``).
        """
        from workers.models import load_tokenizer

        check_options(cls.backend_name, options, cls.OPTIONS)
        gpu_id = gpu_index(options.pop("device", None) or "cuda:0")
        require(SGLANG)  # before minutes of loading
        source, revision = engine_model_source(model)
        tokenizer = load_tokenizer(model)
        handle = build_sgl_engine(source, engine_opts, gpu_id)
        handle = replace(handle, revision=f"{revision}+{handle.revision}")
        return cls(handle, tokenizer, **options)

    @property
    def vector_size(self) -> int:
        return int(self.model.model_config.vocab_size)

    @property
    def max_prompt_tokens(self) -> int:
        # SGLang aborts prompts of max_req_input_len tokens or more.
        return int(self.model.max_req_input_len) - 1

    @property
    def revision(self) -> str:
        return self._handle.revision

    # -- asynchronous queries ------------------------------------------------------------------
    async def _compute(self, key: Key) -> torch.Tensor:
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
        """Fail every queued and in-flight query with `Cancelled`.

        For programs whose inference algorithm died mid-way. A batch already running on the
        GPU finishes; its rows are dropped.
        """
        error = Cancelled("queries were reset")
        pending, self._pending, self._inflight, self._queue = self._pending, {}, {}, deque()
        for futures in pending.values():
            for future in futures:
                settle(future, error)

    async def _drain(self) -> None:
        """Run batches until the queue is empty (a later query starts a new drain)."""
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                requests = self._take_queue()
                if not requests:
                    continue
                try:
                    rows = await loop.run_in_executor(self._executor, self._evaluate, requests)
                except asyncio.CancelledError:
                    self._resolve({r.rid: Cancelled("the backend closed") for r in requests})
                    raise
                except Exception as exc:
                    logger.error("an SGLang batch failed", exc_info=exc)
                    rows = {r.rid: engine_error("SGLang", exc) for r in requests}
                missing = ModelError("SGLang finished without a row for this prompt")
                self._resolve({r.rid: rows.get(r.rid, missing) for r in requests})
        finally:
            self._runner = None

    def _take_queue(self) -> list[Any]:
        """A request for every queued prompt that someone still waits for; now in flight."""
        requests = []
        while self._queue:
            key = self._queue.popleft()
            waiters = self._pending.get(key)
            if waiters is None:  # reset since it was queued
                continue
            if all(future.done() for future in waiters):  # every caller was cancelled
                del self._pending[key]
                continue
            rid = self._new_rid()
            try:
                requests.append(self._handle.make_request(rid, key))
            except Exception as exc:
                for future in self._pending.pop(key):
                    settle(future, engine_error("SGLang", exc))
                continue
            self._inflight[rid] = key
        return requests

    def _resolve(self, rows: dict[str, Result]) -> None:
        """Give each finished request's result to every caller waiting for its prompt."""
        for rid, result in rows.items():
            key = self._inflight.pop(rid, None)
            if key is None:  # reset while in flight
                continue
            for future in self._pending.pop(key, []):
                settle(future, result)

    def _compute_sync(self, keys: list[Key]) -> dict[Key, Result]:
        """Compute distinct prompts in one scheduler drain."""
        rids = {key: self._new_rid() for key in keys}
        requests = [self._handle.make_request(rid, key) for key, rid in rids.items()]
        try:
            rows = self._executor.submit(self._evaluate, requests).result()
        except Exception as exc:
            raise engine_error("SGLang", exc) from exc
        missing = ModelError("SGLang finished without a row for a prompt")
        return {key: rows.get(rid, missing) for key, rid in rids.items()}

    # -- the scheduler thread ------------------------------------------------------------------
    def _evaluate(self, requests: list[Any]) -> dict[str, Result]:
        """Admit `requests` and run batches until none is left; the rows of those finishing."""
        sched = self.model
        rows: dict[str, Result] = {}
        with torch.inference_mode(), sched.device_module.StreamContext(sched.schedule_stream):
            sched.process_input_requests(requests)
            while True:
                plan = sched.get_next_batch_to_run(
                    running_batch=sched.running_batch, last_batch=sched.last_batch
                )
                sched.running_batch = plan.running_batch
                batch = plan.batch_to_run
                sched.cur_batch_for_debug = batch
                if batch is not None:
                    rows.update(_run_one(sched, batch))
                sched.last_batch = batch
                if batch is None:
                    return rows

    def clear_cache(self) -> None:
        """Forget stored results."""
        self._clear_results()

    def clear_kv_cache(self) -> bool:
        """Flush SGLang's KV and radix caches; False if requests were running."""
        return bool(self._executor.submit(self.model.flush_cache).result())

    async def aclose(self) -> None:
        """Fail queued queries, let a running batch finish, and release SGLang."""
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

    def _new_rid(self) -> str:
        return f"lmq-{next(self._counter)}"


def _run_one(sched: Any, batch: Any) -> dict[str, Result]:
    """Run one batch; the rows of the requests it finished (SGLang reuses the logits buffer
    in the next batch, so rows are copied out here)."""
    finished_before = {id(req) for req in batch.reqs if req.finished()}
    result = sched.run_batch(batch)
    sched.process_batch_result(batch, result)
    logits = result.logits_output.next_token_logits if result.logits_output else None
    done = [
        (i, req)
        for i, req in enumerate(batch.reqs)
        if req.finished() and id(req) not in finished_before
    ]
    if not done:
        return {}
    if logits is None:
        return {req.rid: ModelError("SGLang returned no logits") for _, req in done}
    index = torch.tensor([i for i, _ in done], device=logits.device)
    rows = torch.log_softmax(logits.index_select(0, index).to(torch.float32), dim=-1).cpu()
    out: dict[str, Result] = {}
    for j, (_, req) in enumerate(done):
        reason = req.finished_reason
        if type(reason).__name__ == "FINISH_ABORT":
            out[req.rid] = ModelError(f"SGLang aborted the request: {reason.message}")
        else:
            out[req.rid] = rows[j]
    return out


def _bind_device(gpu_id: int | None) -> None:
    if gpu_id is not None and torch.cuda.is_available():
        torch.cuda.set_device(gpu_id)
