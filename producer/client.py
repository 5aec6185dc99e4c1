"""`QueueLM`: the `AsyncLM` interface, answered by workers through Redis.

A call validates the prompt locally (the same checks and error types as the worker), looks in
a local LRU, joins an identical in-flight request if there is one, and otherwise becomes a
request with a deadline. At most ``max_inflight`` distinct requests are outstanding: further
callers wait for a slot (within their own deadline), which bounds this client's memory and the
replies queued for it in Redis however slowly it reads them. The `Submitter` sends requests in
micro-batches (shared-cache hits never reach a worker); the `ReplyReader` settles them from
this client's reply stream (vectors are received in place by a `RespPipe`, claim-checks
fetched from the shared cache) and resubmits everything in flight when Redis restarted. Both are
tasks owned by the client's lifespan: `connect` starts them, `close` stops them and fails
whatever is still pending with `Cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from shared.connections import async_redis, bounded
from shared.errors import Cancelled, DeadlineExceeded, UnknownModel
from shared.output_cache import OutputCache
from shared.registry import ModelInfo, ModelRegistry, tokenizer_from_files
from shared.settings import ClientSettings
from shared.shared_cache import SharedCache
from shared.tokens import Token
from shared.validation import check_prompt, reject_adapter
from shared.vocab import str_vocab_of
from shared.wire import Request

from .admission import Admission
from .claims import ClaimResolver
from .inflight import InflightTable, Pending
from .reply_reader import ReplyReader, server_run_id
from .resp_pipe import RespPipe
from .slots import Slots
from .submitter import REDIS_DOWN, Submitter
from .sync_portal import SyncPortal
from .tensors import to_float32_tensor

__all__ = ["QueueLM"]

logger = logging.getLogger(__name__)


class QueueLM:
    """A drop-in `AsyncLM` whose log-probabilities are computed by lmqueue workers.

    Create it with ``await QueueLM.connect(model, redis_url=...)`` (or ``async with``), and
    ``await lm.close()`` when done. Results are float32 CPU tensors of length
    ``info.vector_size``, whatever dtype they travelled in.
    """

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Any,
        byte_vocab: list[bytes],
        settings: ClientSettings,
        redis: Any,
        cache_redis: Any,
        run_id: str | None = None,
    ) -> None:
        self.info = info
        self.model = info.name
        self.tokenizer = tokenizer
        self.byte_vocab = [Token(i, raw) for i, raw in enumerate(byte_vocab)]
        self.str_vocab = str_vocab_of(byte_vocab, tokenizer)
        self.settings = settings
        self.client_id = uuid.uuid4().hex[:16]
        self._redis = redis
        self._cache_redis = cache_redis
        keys = settings.redis.keyspace()
        self._slots = Slots(settings.max_inflight)
        self.inflight = InflightTable(self.client_id, on_settled=self._slots.release)
        stall_timeout_s = settings.redis.stall_timeout_s
        shared = (
            SharedCache(cache_redis, keys, info.name, info.revision, stall_timeout_s)
            if settings.use_shared_cache
            else None
        )
        redis_settings = settings.redis
        self._pipes = [
            RespPipe(url, redis_settings.connect_timeout_s) if RespPipe.supports(url) else None
            for url in (redis_settings.url, redis_settings.effective_cache_url)
        ]
        self.claims = ClaimResolver(cache_redis, stall_timeout_s, pipe=self._pipes[1])
        bound = settings.max_backlog or info.max_backlog
        admission = Admission(redis, keys.requests(info.name), bound)
        self.submitter = Submitter(self.inflight, shared, admission, stall_timeout_s)
        self.reader = ReplyReader(
            redis, keys.replies(self.client_id), self.inflight, on_restart=self._on_restart,
            read_count=settings.read_count, run_id=run_id, stall_timeout_s=stall_timeout_s,
            claims=self.claims, on_claim_missed=self._ask_inline, pipe=self._pipes[0],
        )  # fmt: skip
        self.local_cache = OutputCache(settings.local_cache_size)
        self._tasks: list[asyncio.Task[None]] = []
        self._refresh: asyncio.Task[None] | None = None
        self._portal: SyncPortal | None = None
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- lifespan ------------------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        model: str,
        redis_url: str | None = None,
        *,
        settings: ClientSettings | None = None,
        **overrides: Any,
    ) -> QueueLM:
        """Connect to `model`'s workers through the Redis at `redis_url`.

        Waits up to ``settings.connect_timeout_s`` for a worker to publish the model.

        Raises:
            UnknownModel: if no worker publishes `model` in that time.
        """
        settings = settings or ClientSettings.from_env()
        if redis_url is not None:
            overrides.setdefault("redis", replace(settings.redis, url=redis_url))
        if overrides:
            settings = replace(settings, **overrides)
        redis = async_redis(settings.redis.url, settings.redis.connect_timeout_s)
        cache_redis = redis
        if settings.redis.cache_url and settings.redis.cache_url != settings.redis.url:
            cache_redis = async_redis(settings.redis.cache_url, settings.redis.connect_timeout_s)
        try:
            registry = ModelRegistry(redis, settings.redis.keyspace())
            info = await _wait_for_model(registry, model, settings.connect_timeout_s)
            run_id = await server_run_id(redis)
            files = await registry.tokenizer_files(model)
            vocab = await registry.byte_vocab(model)
            tokenizer = await asyncio.to_thread(tokenizer_from_files, files)
        except BaseException:
            await _close_all(redis, cache_redis)
            raise
        client = cls(info, tokenizer, vocab, settings, redis, cache_redis, run_id)
        client._start()
        return client

    def _start(self) -> None:
        self._home_loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self.submitter.run(), name=f"lmq-submit-{self.client_id}"),
            asyncio.create_task(self.reader.run(), name=f"lmq-replies-{self.client_id}"),
        ]

    async def close(self) -> None:
        """Stop the client; pending requests fail with `Cancelled`."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._tasks, *([self._refresh] if self._refresh else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.inflight.fail_all(Cancelled, "the client was closed")
        if self._portal is not None:
            await asyncio.to_thread(self._portal.close)
        for pipe in self._pipes:
            if pipe is not None:
                pipe.close()
        # Replies still on their way recreate the stream, with the workers' TTL on it.
        with contextlib.suppress(Exception):
            await bounded(self._redis.delete(self.reader.stream), 1.0, "deleting replies")
        await _close_all(self._redis, self._cache_redis)

    async def __aenter__(self) -> QueueLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the AsyncLM interface -------------------------------------------------------------------
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after `token_ids` (float32, CPU)."""
        reject_adapter(lora_name)
        ids = check_prompt(token_ids, self.info.vocab_size, self.info.max_prompt_tokens)
        token_bytes = ids.astype("<i4").tobytes()
        if token_bytes in self.local_cache:  # a miss through get() raises and catches KeyError
            return self.local_cache[token_bytes]
        vector = await self.request(token_bytes, "logprobs", self.settings.wire_dtype)
        tensor = to_float32_tensor(vector)
        self.local_cache[token_bytes] = tensor
        return tensor

    async def batch_next_token_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities for each prompt, stacked as ``(len(list), vector_size)``."""
        rows = await asyncio.gather(
            *(self.next_token_logprobs(ids, lora_name) for ids in token_ids_list)
        )
        return torch.stack(rows)

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `next_token_logprobs`; callable from any thread, inside a running loop too."""
        return self._call_sync("next_token_logprobs", list(token_ids), lora_name)

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking `batch_next_token_logprobs`."""
        prompts = [list(ids) for ids in token_ids_list]
        return self._call_sync("batch_next_token_logprobs", prompts, lora_name)

    def clear_cache(self) -> None:
        """Forget locally cached results (the shared cache is left alone)."""
        self.local_cache.clear()

    # -- requests ----------------------------------------------------------------------------------
    async def request(self, token_bytes: bytes, kind: str, dtype: str, **extra: Any) -> np.ndarray:
        """Submit (or join) one request and wait for its raw result vector (read-only).

        The layer under `next_token_logprobs` and `QueueTrie`. Args: the prompt as
        little-endian int32 bytes, the kind (``logprobs`` or ``mass``), the wire dtype, and
        for masses the `Request` fields ``mass_op``, ``node_bytes``, ``vocab_digest``.
        """
        if self._closed:
            raise Cancelled("the client is closed")
        dedup_key = (token_bytes, kind, dtype, *sorted(extra.items()))
        pending = self.inflight.find(dedup_key)
        if pending is None:
            pending = await self._new_request(dedup_key, token_bytes, kind, dtype, extra)
        waiter = self.inflight.wait(pending)
        try:
            return await waiter
        except asyncio.CancelledError:
            self.inflight.leave(pending, waiter)
            raise

    async def _new_request(
        self, dedup_key: Hashable, token_bytes: bytes, kind: str, dtype: str, extra: dict[str, Any]
    ) -> Pending:
        """Take an in-flight slot (waiting within the deadline if all are taken) and submit.

        The slot is given back when the request settles, however it settles (`InflightTable`).
        """
        timeout_s = self.settings.timeout_s
        started = time.time()
        try:
            if not self._slots.take_now():  # not asyncio.timeout: see shared.connections.bounded
                await asyncio.wait_for(self._slots.take(), timeout_s or None)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no in-flight slot within {timeout_s:g} s (max_inflight="
                f"{self.settings.max_inflight})", timeout_s=timeout_s,
            ) from None  # fmt: skip
        joined = self.inflight.find(dedup_key)  # made by another caller while this one waited
        if joined is not None or self._closed:
            self._slots.release()
            if joined is None:
                raise Cancelled("the client is closed")
            return joined
        remaining_s = max(timeout_s - (time.time() - started), 0.001) if timeout_s else 0
        deadline_ms = int((started + timeout_s) * 1000) if timeout_s else 0
        request = Request(
            self.inflight.next_request_id(), self.client_id, token_bytes, kind, dtype,
            deadline_ms, claims=kind == "logprobs" and self.claims.enabled, **extra,
        )  # fmt: skip
        pending = self.inflight.add(request, dedup_key, remaining_s)
        self.submitter.submit(pending)
        return pending

    def _ask_inline(self, request_ids: list[str]) -> None:
        """Their claimed results were gone: send them again, asking for inline replies."""
        again = []
        for request_id in request_ids:
            pending = self.inflight.get(request_id)
            if pending is not None:
                pending.request = replace(pending.request, claims=False)
                pending.inline_retry = True
                again.append(pending)
        self.submitter.resubmit(again)

    def _on_restart(self) -> None:
        """Redis restarted: resubmit everything in flight and re-read the model's info."""
        self.submitter.resubmit(self.inflight)
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._refresh_info(), name="lmq-refresh-info")

    async def _refresh_info(self) -> None:
        """Read the model's info again once a worker re-published it; adopt a new bound."""
        registry = ModelRegistry(self._redis, self.settings.redis.keyspace())
        try:
            info = await _wait_for_model(registry, self.model, self.settings.connect_timeout_s)
        except Exception as exc:  # best effort: the old info stays in use
            logger.warning("could not re-read model info after a restart: %s", exc)
            return
        if (info.revision, info.vector_size) != (self.info.revision, self.info.vector_size):
            logger.warning(
                "model %s changed across the restart (revision %s -> %s); results may differ",
                self.model, self.info.revision, info.revision,
            )  # fmt: skip
        if not self.settings.max_backlog:
            self.submitter.admission.max_backlog = info.max_backlog
        self.info = info

    def _call_sync(self, method: str, *args: Any) -> Any:
        """Run an async method to completion from synchronous code.

        From another thread while this client's loop runs, the call goes to that loop; from
        the loop's own thread (or with no loop running) it goes to a private `SyncPortal`.
        """
        if self._closed:
            raise Cancelled("the client is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        home = self._home_loop
        if home is not None and home.is_running() and running is not home:
            return asyncio.run_coroutine_threadsafe(getattr(self, method)(*args), home).result()
        if self._portal is None:
            self._portal = SyncPortal(self.model, self.settings)
        return self._portal.call(method, *args)

    @classmethod
    def connect_sync(cls, model: str, redis_url: str | None = None, **kwargs: Any) -> QueueLM:
        """For synchronous programs: a client living on a private loop thread.

        Use its ``*_sync`` methods, and `close_sync` when done.
        """
        settings = kwargs.pop("settings", None) or ClientSettings.from_env()
        if redis_url is not None:
            kwargs.setdefault("redis", replace(settings.redis, url=redis_url))
        if kwargs:
            settings = replace(settings, **kwargs)
        portal = SyncPortal(model, settings)
        portal.client._owner_portal = portal
        return portal.client

    def close_sync(self) -> None:
        """Close a client made by `connect_sync` (or any client, from another thread)."""
        owner = getattr(self, "_owner_portal", None)
        if owner is not None:
            owner.close()
            return
        home = self._home_loop
        if home is None or not home.is_running():
            raise RuntimeError("close_sync needs the client's loop running in another thread")
        asyncio.run_coroutine_threadsafe(self.close(), home).result()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests sent, shared-cache hits, replies read, claim-checks, reconnects."""
        return {
            "sent": self.submitter.sent,
            "cache_hits": self.submitter.cache_hits,
            "replies_read": self.reader.replies_read,
            "duplicate_replies": self.inflight.duplicate_replies,
            "claims_resolved": self.claims.resolved,
            "claims_missed": self.claims.missed,
            "reconnects": self.reader.reconnects,
            "server_restarts": self.reader.restarts_seen,
            "inflight": len(self.inflight),
        }


async def _wait_for_model(registry: ModelRegistry, model: str, timeout_s: float) -> ModelInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await registry.info(model)
        except UnknownModel:
            if time.monotonic() >= deadline:
                raise
        except REDIS_DOWN:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.1)


async def _close_all(*clients: Any) -> None:
    for client in {id(c): c for c in clients}.values():
        await client.aclose()
