"""`EngineThread`: the one thread that calls an in-process vLLM engine.

It runs closures other threads queue (adding requests, resetting caches, loading LoRA
adapters), steps the engine while requests are live, and gives each finished request's row to
every caller waiting for that prompt under that adapter (the same tokens under two adapters are
two requests). Rows finished in one step are normalized together: one ``log_softmax`` over the
stacked rows and one copy to the CPU per step, however many requests finished in it.

Every caller gets an answer or an error on every path: a closure queued after the thread's
final drain would never run, so queuing and the thread's "stopping" flag share a lock, and
once stopping, `submit` and `call` raise `Cancelled` in the caller's own thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from lmqueue.shared.errors import BadRequest, Cancelled, ModelError

from .engine_backend import Key, Result, engine_error
from .vllm_engine import VLLMEngine

__all__ = ["EngineThread", "Query", "Resolver"]

logger = logging.getLogger(__name__)

Resolver = Callable[[Result], None]
#: One query: its tokens, vLLM's ``LoRARequest`` (None: the base model) and who gets its row.
Query = tuple[Key, Any, Resolver]


class EngineThread:
    """The thread owning `handle`'s engine; callers talk to it through closures only."""

    def __init__(self, handle: VLLMEngine) -> None:
        self._handle = handle
        self._engine = handle.engine
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders queuing against the thread's final drain
        self._tags = (f"lmq-{n}" for n in itertools.count())
        self._by_key: dict[tuple[str | None, Key], str] = {}  # (vLLM adapter name, tokens)
        self._live: dict[str, tuple[tuple[str | None, Key], list[Resolver]]] = {}
        self._stopping = False
        self._reset_prefix_cache = False  # asked for while requests ran: done once idle
        self._thread = threading.Thread(target=self._run, name="lmq-vllm-engine", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def submit(self, queries: list[Query]) -> None:
        """Queue prompts; each resolver receives the row or the error.

        Raises:
            Cancelled: the thread is stopping or stopped.
        """

        def add_all() -> None:
            for key, lora, resolve in queries:
                self._add(key, lora, resolve)

        if queries:
            self._put(add_all)

    def reset(self, error: BaseException) -> None:
        """Abort every live request, failing its callers with `error`."""
        try:
            self._put(lambda: self._fail_all(error))
        except Cancelled:  # stopping: the final drain fails them anyway
            pass

    def call(self, fn: Callable[[Any], Any], wait: bool = True) -> Any:
        """Run ``fn(engine)`` between steps; wait for its value unless `wait` is False.

        Raises:
            Cancelled: the thread is stopping or stopped.
        """
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self._engine))
            except Exception as exc:
                future.set_exception(exc)

        self._put(run)
        return future.result() if wait else None

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache now if no request runs, else as soon as none does."""

        def ask() -> None:
            self._reset_prefix_cache = True
            self._maybe_reset_prefix_cache()

        self._put(ask)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Fail live requests with `Cancelled`, shut the engine down and end the thread."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout_s)

    def _put(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._stopping or not self._thread.is_alive():
                raise Cancelled("the backend is closed")
            self._work.put(work)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_work(block=not self._live):
                if self._live:
                    self._step()
                self._maybe_reset_prefix_cache()
        finally:
            with self._lock:
                self._stopping = True  # nothing is queued after this: _put refuses
            while not self._work.empty():  # closures queued before: adds are cancelled
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

    def _maybe_reset_prefix_cache(self) -> None:
        if self._reset_prefix_cache and not self._live:
            self._reset_prefix_cache = not self._engine.reset_prefix_cache()

    def _add(self, key: Key, lora: Any, resolve: Resolver) -> None:
        if self._stopping:
            resolve(Cancelled("the backend closed"))
            return
        query = (None if lora is None else lora.lora_name, key)
        tag = self._by_key.get(query)
        if tag is not None:  # the same prompt under the same adapter is in flight: share it
            self._live[tag][1].append(resolve)
            return
        tag = next(self._tags)
        try:
            prompt = {"type": "token", "prompt_token_ids": list(key)}  # vllm.inputs.TokensInput
            params = self._handle.sampling_params(tag)
            self._engine.add_request(tag, prompt, params, lora_request=lora)
        except ValueError as exc:  # vLLM's own input checks (VLLMValidationError among them)
            resolve(BadRequest(f"vLLM refused the prompt: {exc}"))
            return
        except Exception as exc:
            resolve(engine_error("vLLM", exc))
            return
        self._by_key[query] = tag
        self._live[tag] = (query, [resolve])

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.error("a vLLM step failed; failing %d requests", len(self._live), exc_info=exc)
            self._fail_all(engine_error("vLLM", exc))
            return
        finished = [output for output in outputs if output.finished]
        if finished:
            self._deliver(finished)
        if self._live and not self._engine.has_unfinished_requests():
            self._fail_all(ModelError("vLLM dropped these requests without a result"))

    def _deliver(self, outputs: list[Any]) -> None:
        """Resolve the callers of every request that finished in one step."""
        results: dict[str, Result] = {}
        rows: dict[str, torch.Tensor] = {}
        for output in outputs:
            row = self._handle.sink.take(output.request_id)
            if output.request_id not in self._live:  # already failed (reset) before it finished
                continue
            reason = output.outputs[0].finish_reason if output.outputs else None
            if row is None or reason in ("abort", "error"):
                results[output.request_id] = ModelError(
                    f"vLLM returned no logits row (finish reason {reason!r})"
                )
            else:
                rows[output.request_id] = row
        results.update(_normalized(rows))
        for tag, result in results.items():
            query, resolvers = self._live.pop(tag)
            self._by_key.pop(query, None)
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


def _normalized(rows: dict[str, torch.Tensor]) -> dict[str, Result]:
    """float32 log-probabilities of every row: one log_softmax and one CPU copy for all."""
    if not rows:
        return {}
    try:
        block = torch.log_softmax(torch.stack(list(rows.values())).to(torch.float32), dim=-1)
        block = block.cpu()
    except Exception as exc:
        error = engine_error("vLLM", exc)
        return dict.fromkeys(rows, error)
    return {tag: block[i] for i, tag in enumerate(rows)}
