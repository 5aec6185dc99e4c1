"""`QueueLM`: an `AsyncLM` whose log-probabilities are computed by workers through Redis.

A call validates the prompt locally (the same checks and error types as the worker), looks in
a local LRU, and otherwise travels through the client's `RequestChannel` (in-flight permits, dedup,
micro-batched submission, one reply reader). `connect` reads the model's info, tokenizer and
vocabulary from the registry the workers publish, so a client needs no model files; it is
the boundary where redis-py's exceptions become `Unavailable` (or `Forbidden`, `Busy`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from lmqueue.shared.errors import Unavailable, UnknownModel
from lmqueue.shared.gc_threshold import raise_young_threshold
from lmqueue.shared.heap_reuse import keep_freed_vectors_mapped
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.lm.output_cache import OutputCache
from lmqueue.shared.lm.tokens import Token
from lmqueue.shared.lm.validation import prompt_bytes
from lmqueue.shared.lm.vocab import str_vocab_of
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.redis_errors import REDIS_AUTH, REDIS_DOWN, redis_boundary
from lmqueue.shared.redis_roles import RedisRoles, connect_queue, connect_redis_roles
from lmqueue.shared.registry import ModelInfo, ModelRegistry, tokenizer_from_files
from lmqueue.shared.settings import ClientSettings
from lmqueue.shared.tenants import read_cache_namespace

from .adapter_choice import AdapterChoice
from .reply_reader import server_run_id
from .request_channel import RequestChannel
from .sync_portal import SyncFacade
from .tensors import as_array, as_tensor, to_result_array, to_result_tensor

if TYPE_CHECKING:  # imported with the first tensor made: a numpy-only program never loads it
    import torch

__all__ = ["QueueLM"]

logger = logging.getLogger(__name__)

#: What `connect` waits out: no worker has published the model yet, or Redis is not up yet.
_NOT_YET: tuple[type[BaseException], ...] = (UnknownModel, *REDIS_DOWN)


class QueueLM(SyncFacade, AsyncLM):
    """A drop-in `AsyncLM` whose log-probabilities are computed by lmqueue workers.

    Create it with ``await QueueLM.connect(model, redis_url=...)`` (or ``async with``), and
    ``await lm.close()`` when done. Results are float32 CPU tensors of length
    ``info.vector_size``, whatever dtype they travelled in, or float32 numpy arrays from the
    ``*_numpy`` methods (torch is then never imported); float16 ones where the client asked
    for them (``wire_dtype="float16", half_results=True``).
    """

    backend_name = "queue"

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: Any,
        byte_vocab: list[bytes],
        settings: ClientSettings,
        redis: Any,
        cache_redis: Any,
        run_id: str | None = None,
        cache_namespace: str = "",
    ) -> None:
        super().__init__(
            tokenizer,
            [Token(i, raw) for i, raw in enumerate(byte_vocab)],
            str_vocab_of(byte_vocab, tokenizer),
        )
        self.info = info
        self.model = info.name
        self.settings = settings
        self.channel = RequestChannel(
            info, settings, redis, cache_redis, run_id, on_restart=self._on_restart,
            cache_namespace=cache_namespace,
        )  # fmt: skip
        self.client_id = self.channel.client_id
        self.local_cache = OutputCache(settings.local_cache_size)
        self.adapters = AdapterChoice(redis, settings.redis.keyspace(), info.name)
        self._refresh: asyncio.Task[None] | None = None

    # -- what the model is (from the workers' registry entry) --------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def vector_size(self) -> int:
        return self.info.vector_size

    @property
    def max_prompt_tokens(self) -> int:
        return self.info.max_prompt_tokens

    @property
    def revision(self) -> str:
        return self.info.revision

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter this client is bound to (None: the base model)."""
        return self.adapters.bound

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self.channel.closed

    # -- lifespan ------------------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        model: str,
        redis_url: str | None = None,
        *,
        settings: ClientSettings | None = None,
        adapter: str | None = None,
        cache_url: str | None = None,
        **overrides: Any,
    ) -> QueueLM:
        """Connect to `model`'s workers through the Redis at `redis_url`.

        `redis_url` is all a tenant needs (what ``lmq tenant add`` printed): the cache
        instance, if separate, is found in the registry and reached with the same user.
        `cache_url` overrides where the cache is. `overrides` are `ClientSettings` fields.
        Waits up to ``settings.connect_timeout_s`` for a worker to publish the model. With
        `adapter`, every call computes under that LoRA adapter unless it names another.

        Raises:
            UnknownModel: if no worker publishes `model` in that time.
            UnknownAdapter: if `adapter` is not served (the error lists those that are).
            Forbidden: if `adapter` is private to another tenant.
            Unavailable: if Redis cannot be reached in that time.
            Forbidden: if Redis refuses this user the registry.
            AuthenticationFailed: at once, if Redis refuses the URL's user or password.
            SettingsError: for an override that is no `ClientSettings` field.
        """
        settings = ClientSettings.resolve(settings, redis_url, cache_url=cache_url, **overrides)
        if settings.heap_reuse:
            keep_freed_vectors_mapped()
        raise_young_threshold(settings.gc_young_threshold)
        deadline = time.monotonic() + settings.connect_timeout_s
        while True:  # Redis away mid-connect (restarting, loading its AOF): try again
            try:
                return await cls._connect_once(model, settings, adapter, deadline)
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.2)

    @classmethod
    async def _connect_once(
        cls, model: str, settings: ClientSettings, adapter: str | None, deadline: float
    ) -> QueueLM:
        """One try of `connect`, waiting for the model until `deadline`."""
        redis = await connect_queue(settings.redis)
        roles = RedisRoles(redis, redis, settings.redis.url, separate=False)
        try:
            with redis_boundary(f"connecting to {model!r}", settings.redis.url):
                registry = ModelRegistry(redis, settings.redis.keyspace())
                wait_s = max(deadline - time.monotonic(), 0.0)
                info = await _wait_for_model(registry, model, wait_s)
                run_id = await server_run_id(redis)
                files = await registry.tokenizer_files(model)
                vocab = await registry.byte_vocab(model)
                namespace = await read_cache_namespace(redis, settings.redis.keyspace(), model)
                roles = await connect_redis_roles(
                    settings.redis, info.cache_address, cache_required=False, queue=redis
                )
            tokenizer = await asyncio.to_thread(tokenizer_from_files, files)
        except BaseException:
            await roles.aclose()
            raise
        settings, cache_redis = _with_cache(settings, roles)
        client = cls(info, tokenizer, vocab, settings, redis, cache_redis, run_id, namespace)
        if roles.cache is None:  # claim-checks it could not redeem would double the work
            client.channel.claims.disable()
        client._home_loop = asyncio.get_running_loop()
        try:
            await client._bind(adapter)
        except BaseException:
            await _close_all(redis, cache_redis)
            raise
        client.channel.start()
        return client

    async def _bind(self, adapter: str | None) -> None:
        """Read the model's adapter records; bind the client to `adapter` (checked)."""
        with redis_boundary(f"reading the adapters of {self.model!r}"):
            self.channel.set_adapters(await self.adapters.refresh())
        self.adapters.bound = await self.adapters.resolve(adapter)

    async def close(self) -> None:
        """Stop the client; pending requests fail with `Cancelled`."""
        if self.closed:
            return
        refresh = self._refresh
        if refresh is not None:
            refresh.cancel()
            await asyncio.gather(refresh, return_exceptions=True)
        await self.channel.close()
        await self._close_portal()
        await _close_all(self.channel.redis, self.channel.cache_redis)

    async def __aenter__(self) -> QueueLM:
        return self

    async def aclose(self) -> None:
        """`close`, under the name `AsyncLM` uses."""
        await self.close()

    # -- the AsyncLM interface -------------------------------------------------------------------
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after `token_ids` (float32, CPU; float16 with
        ``half_results``).

        `lora_name` names a LoRA adapter served for the model (default: the client's own).
        """
        found, key = await self._lookup(token_ids, lora_name)
        if found is not None:
            return as_tensor(found)
        vector = await self._ask(key)
        tensor = to_result_tensor(vector, self.settings.half_results)
        self.local_cache[key] = tensor
        return tensor

    async def next_token_logprobs_numpy(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> np.ndarray:
        """`next_token_logprobs` as a float32 numpy array: a program on numpy needs no torch."""
        found, key = await self._lookup(token_ids, lora_name)
        if found is not None:
            return as_array(found)
        vector = await self._ask(key)
        array = to_result_array(vector, self.settings.half_results)
        self.local_cache[key] = array
        return array

    async def batch_next_token_logprobs_numpy(
        self, token_ids_list: Sequence[Sequence[int]], lora_name: str | None = None
    ) -> np.ndarray:
        """`batch_next_token_logprobs` as a ``(len(list), vector_size)`` float32 array."""
        rows = await asyncio.gather(
            *(self.next_token_logprobs_numpy(ids, lora_name) for ids in token_ids_list)
        )
        if rows:
            return np.stack(rows)
        dtype = np.float16 if self.settings.half_results else np.float32
        return np.empty((0, self.vector_size), dtype)

    async def _lookup(
        self, token_ids: Sequence[int], lora_name: str | None
    ) -> tuple[Any, PromptKey]:
        """Validate the prompt and adapter; the locally cached result (tensor, array or None)
        and the prompt's key (built here, once per call)."""
        tokens = prompt_bytes(token_ids, self.info.vocab_size, self.info.max_prompt_tokens)
        key = PromptKey(await self.adapters.resolve(lora_name), tokens)
        if key in self.local_cache:  # a miss through get() raises and catches KeyError
            return self.local_cache[key], key
        return None, key

    async def _ask(self, prompt: PromptKey) -> np.ndarray:
        """The raw vector of a log-probabilities request for `prompt`."""
        if prompt.adapter is not None:
            self.channel.set_adapters(self.adapters.records)  # the key needs its revision
        return await self.channel.request(prompt, "logprobs", self.settings.wire_dtype)

    def clear_cache(self) -> None:
        """Forget locally cached results (the shared cache is left alone)."""
        self.local_cache.clear()

    async def request(self, token_bytes: bytes, kind: str, dtype: str, **extra: Any) -> np.ndarray:
        """Submit (or join) one request and wait for its result vector (16-bit ones widened
        to float32).

        The layer under `QueueTrie`; see `RequestChannel.request`. An ``adapter`` in `extra`
        names the LoRA adapter (None or absent: the base model).
        """
        prompt = PromptKey(extra.pop("adapter", None), token_bytes)
        return await self.channel.request(prompt, kind, dtype, **extra)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests sent, shared-cache hits, replies read, claim-checks, reconnects."""
        return self.channel.stats

    # -- after a Redis restart -------------------------------------------------------------------
    def _on_restart(self) -> None:
        """The channel resubmitted everything in flight: re-read the model's info too."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._refresh_info(), name="lmq-refresh-info")

    async def _refresh_info(self) -> None:
        """Read the model's info again once a worker re-published it; adopt a new bound."""
        registry = ModelRegistry(self.channel.redis, self.settings.redis.keyspace())
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
        self.channel.adopt(info)
        self.info = info


def _with_cache(settings: ClientSettings, roles: RedisRoles) -> tuple[ClientSettings, Any]:
    """The settings and cache client the channel runs with: the cache role as connected, or
    (where it could not be used) none, the queue standing in and shared lookups off."""
    if roles.cache is None:
        redis_settings = replace(settings.redis, cache_url=None)
        return replace(settings, redis=redis_settings, use_shared_cache=False), roles.queue
    redis_settings = replace(settings.redis, cache_url=roles.cache_url if roles.separate else None)
    return replace(settings, redis=redis_settings), roles.cache


async def _wait_for_model(registry: ModelRegistry, model: str, timeout_s: float) -> ModelInfo:
    """The model's info, waiting up to `timeout_s` for a worker to publish it or Redis to answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await registry.info(model)
        except REDIS_AUTH:
            raise  # a wrong password stays wrong: no waiting
        except _NOT_YET as exc:
            if time.monotonic() >= deadline:
                raise exc
        await asyncio.sleep(0.1)


async def _close_all(*clients: Any) -> None:
    for client in {id(c): c for c in clients}.values():
        await client.aclose()
