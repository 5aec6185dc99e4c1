"""`AsyncTransformer`: a HuggingFace causal LM behind `AsyncLM`, batched, reusing KV along prefixes.

Concurrent `next_token_logprobs` calls wait up to ``max_wait_s`` seconds for stragglers (or until
``batch_size`` are queued), then run as one padded forward of at most ``batch_size`` rows and
``max_batch_tokens`` padded new tokens (with ``shape_split``, as two, the narrow rows last,
where the forwards seen so far say that is faster: `ShapeSplit`); identical prompts in flight
share one row. Every result and the KV of every computed position go into a `PrefixCache`, so any
prompt extending a stored prefix runs only its new tokens, not only prompts passed to
`cache_kv`. Returned vectors are shared with that cache: treat them as read-only.

Threads: forwards run on dedicated threads, one at a time unless ``parallel_forwards`` says
more, so the event loop keeps serving meanwhile; queries arriving during a forward go into the
next one. Several forwards at once, each on its own thread with ``forward_threads`` torch
threads, are for CPUs: a small model's forward keeps two cores only ~70% busy as one OpenMP
team (many small ops, each a barrier), while two single-threaded forwards keep both busy
(twice the rows in about 1.5x the time: BENCHMARKS.md, adapters). The trie and the
futures are touched only on the loop thread, and a forward gets plain tensors, so an eviction
meanwhile cannot pull a past from under it. An adapter is loaded or unloaded only while no
forward runs (`ModelChangeLock`). The padded layout, the mask and out-of-memory splitting live
in `padded_batch`; the trie, its KV segments and their eviction in `prefix_cache`.

LoRA adapters (`load_adapter`) are served by `BatchedLora`: each targeted Linear layer adds
every loaded adapter's LoRA term in one masked, concatenated product (no second copy of the
weights), and every forward names each row's adapter, so rows of the base model and of several
adapters share one forward; a forward of base rows only runs the plain layers. Adapters that
product cannot reproduce (DoRA, ``modules_to_save``, ...) are refused at load time. A query
is keyed on its adapter and its tokens everywhere: the queue, the in-flight table and the
prefix cache, whose tries are per adapter (an adapter changes the KV as well as the result).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lmqueue.shared.errors import Cancelled
from lmqueue.shared.lm.interface import AsyncLM, BackendCounters
from lmqueue.shared.lm.validation import check_loaded_adapter
from lmqueue.shared.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_WAIT_MS,
)

from .decode_graphs import DecodeGraphs
from .kv_pool import KvPool, kv_layout
from .lora_batch import BatchedLora
from .model_change_lock import ModelChangeLock
from .options import check_options
from .padded_batch import (
    ForwardStats,
    KvLayoutMismatch,
    Output,
    Row,
    forward_options,
    model_error,
    plain_forward,
    run_rows,
)
from .prefix_cache import Past, PrefixCache
from .shape_split import ShapeSplit, token_slots

__all__ = ["AsyncTransformer", "ForwardStats"]

logger = logging.getLogger(__name__)


@dataclass
class _Query:
    """A prompt waiting for a forward, and the future its callers share."""

    key: _Key
    future: asyncio.Future[torch.Tensor]
    arrived_at: float
    callers: int = 1

    @property
    def adapter(self) -> str | None:
        return self.key[0]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[1]


#: A query's identity: its adapter (None: the base model) and its tokens.
_Key = tuple[str | None, tuple[int, ...]]


#: ``from_pretrained`` options that place the weights without changing them.
_PLACEMENT_OPTIONS = {"device_map", "max_memory", "offload_folder", "low_cpu_mem_usage"}


def _revision(base: str, hf_opts: dict[str, Any] | None, bnb_opts: dict[str, Any] | None) -> str:
    """`base`, qualified by the loading options that change results (dtype, quantization)."""
    weights = {k: v for k, v in (hf_opts or {}).items() if k not in _PLACEMENT_OPTIONS}
    if not weights and not bnb_opts:
        return base
    options = json.dumps([weights, bnb_opts or {}], sort_keys=True, default=str)
    return f"{base}+{hashlib.blake2b(options.encode(), digest_size=6).hexdigest()}"


def _kv_pool(model: Any, max_kv_tokens: int, memory_fraction: float) -> KvPool | None:
    """The pool of `max_kv_tokens` slots for `model`'s KV (on a GPU, or `memory_fraction` of
    the device memory free now); None if KV is not kept or the model's layout is unknown."""
    layout = kv_layout(model)
    if layout is None or (max_kv_tokens <= 0 and memory_fraction <= 0):
        return None
    weights = model.get_input_embeddings().weight
    pool_dtype = weights.dtype if weights.is_floating_point() else model.dtype
    capacity = max_kv_tokens
    if memory_fraction > 0 and weights.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(weights.device)
        slot = 2 * layout[0] * layout[1] * layout[2] * torch.finfo(pool_dtype).bits // 8
        capacity = int(free * memory_fraction) // slot
    return KvPool(capacity, layout, pool_dtype, weights.device) if capacity > 0 else None


class AsyncTransformer(AsyncLM):
    """A HuggingFace causal LM with auto-batching, a result cache and automatic KV reuse.

    Args:
        model: a HuggingFace causal LM on one device (put in eval mode here).
        tokenizer: its tokenizer.
        batch_size: most queries in one forward; a full queue starts a forward at once.
        max_wait_s: seconds the oldest queued query waits for others before its forward starts
            (``timeout``, genlm-backend's name for it, is accepted as an alias).
        max_batch_tokens: most padded new tokens (rows x longest new run) in one forward; a
            single longer query still runs, alone.
        max_kv_tokens: most token positions of KV kept for reuse, 0 disables reuse (SmolLM2-135M
            in float32 takes 46 KB a position): the size of the `KvPool`, allocated at start.
        kv_memory_fraction: on a GPU, size the pool to this fraction of the device memory
            free at start instead (0: use `max_kv_tokens`).
        cache_size: most log-probability vectors kept (``4 * vector_size`` bytes each).
        revision: names the weights, for shared caches (`from_name` fills it in).
        forward_threads: torch intra-op threads of the forward thread (0: as many as the
            constructing thread has). A worker gives every thread but this one a single
            thread (`backend_loader`): with OpenMP, each thread that runs a parallel op keeps a
            team of its own, and past one team per core libgomp stops spinning between ops;
            a forward on its own thread ran markedly slower with 2 threads than on the thread
            that loaded the model (BENCHMARKS.md, adapters).
        parallel_forwards: forwards that may run at once, each on a thread of its own with
            `forward_threads` torch threads (see the module docstring); 1 on a GPU.
        graph_positions: on a GPU, decode forwards of base-model rows replay CUDA graphs
            captured per batch shape (`DecodeGraphs`) when rows x padded past is at most
            this; 0 runs every forward eagerly. Off with ``parallel_forwards`` above 1.
        shape_split: run a batch mixing narrow and wide rows (one-token decode rows beside
            fresh prompts) as two forwards, narrow rows last, where a fit of this backend's
            forward times says two are faster (`ShapeSplit`; False: every batch whole).
    """

    backend_name = "hf"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_wait_s: float = DEFAULT_MAX_WAIT_MS / 1000,
        timeout: float | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_kv_tokens: int = 16_384,
        kv_memory_fraction: float = 0.0,
        cache_size: int = 1024,
        revision: str = "unknown",
        forward_threads: int = 0,
        parallel_forwards: int = 1,
        graph_positions: int = 32_768,
        shape_split: bool = True,
        **vocab: Any,
    ) -> None:
        if timeout is not None:  # genlm-backend's name
            max_wait_s = timeout
        if batch_size < 1 or max_batch_tokens < 1 or max_wait_s < 0:
            raise ValueError(
                f"bad batching limits: {batch_size=} {max_batch_tokens=} {max_wait_s=}"
            )
        if parallel_forwards < 1:
            raise ValueError(f"parallel_forwards={parallel_forwards}: at least one")
        super().__init__(tokenizer, **vocab)
        self.model = model.eval()
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.max_batch_tokens = max_batch_tokens
        self.stats = ForwardStats()
        #: Calls answered from the prefix cache's stored results, and calls that were not.
        self.result_hits = 0
        self.result_misses = 0
        self._revision = revision
        self._config = model.config.get_text_config()
        self._cache = PrefixCache(cache_size, _kv_pool(model, max_kv_tokens, kv_memory_fraction))
        self._kv_unfit = False  # set by a forward thread, acted on by the loop thread
        pool = self._cache.pool
        self._graphs = (
            DecodeGraphs(model, pool, forward_options(model), graph_positions)
            if pool is not None and parallel_forwards == 1
            else None
        )
        self._forward_kwargs = forward_options(model)
        #: Whether a batch mixing narrow and wide rows runs as two forwards (None: never).
        self.shape_split = ShapeSplit() if shape_split else None
        self.forward_threads = forward_threads or torch.get_num_threads()
        self.parallel_forwards = parallel_forwards
        self._gate = ModelChangeLock()
        self._executor = ThreadPoolExecutor(
            max_workers=parallel_forwards, thread_name_prefix="lmq-hf-forward",
            initializer=torch.set_num_threads, initargs=(self.forward_threads,),
        )  # fmt: skip
        self._pending: OrderedDict[_Key, _Query] = OrderedDict()
        self._queued_callers = 0  # callers of queued queries: identical calls fill a batch too
        self._inflight: dict[_Key, asyncio.Future[torch.Tensor]] = {}
        self._lora = BatchedLora(self.model)
        self._timer: asyncio.TimerHandle | None = None
        self._forwards: set[asyncio.Task[None]] = set()  # taking or running a batch
        self._closed = False

    #: lmqueue's own options of `from_name` (besides engine_opts); see workers.backends.options.
    OPTIONS = frozenset(
        {"batch_size", "max_wait_s", "timeout", "max_batch_tokens", "max_kv_tokens",
         "kv_memory_fraction", "cache_size", "revision", "device", "bitsandbytes_opts",
         "forward_threads", "parallel_forwards", "graph_positions", "shape_split"}
    )  # fmt: skip

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> AsyncTransformer:
        """Load `model` (an alias, a model directory or a hub id) and its tokenizer.

        Args:
            engine_opts: extra ``from_pretrained`` options; with CUDA the default
                ``device_map`` is ``cuda:0`` (one device: a KV segment holds all layers in one
                tensor).
            options: the constructor's keyword arguments, and ``device`` (the ``device_map``)
                and ``bitsandbytes_opts`` (a ``BitsAndBytesConfig``'s options).

        Raises:
            SettingsError: an option this backend does not accept.
        """
        from lmqueue.workers.models import load_causal_lm, load_tokenizer, resolve_model

        check_options(cls.backend_name, options, cls.OPTIONS)
        device = options.pop("device", None)
        bitsandbytes_opts = options.pop("bitsandbytes_opts", None)
        opts = dict(engine_opts or {})
        if device:
            opts["device_map"] = device
        elif torch.cuda.is_available():
            opts.setdefault("device_map", "cuda:0")
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        loaded = load_causal_lm(model, opts)
        revision = _revision(resolve_model(model).revision, engine_opts, bitsandbytes_opts)
        options.setdefault("revision", revision)
        return cls(loaded, load_tokenizer(model), **options)

    # -- what a worker publishes ---------------------------------------------------------------
    @property
    def vector_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self._config.vocab_size)

    @property
    def max_prompt_tokens(self) -> int:
        return int(getattr(self._config, "max_position_embeddings", 0) or 0)

    @property
    def revision(self) -> str:
        return self._revision

    # -- LoRA adapters -----------------------------------------------------------------------------
    supports_adapters = True

    @property
    def adapter_names(self) -> frozenset[str]:
        return self._lora.names

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter on a forward thread (between forwards); results and KV
        of an adapter of the same name it replaces are forgotten.

        Raises:
            AdaptersUnsupported: the adapter uses a feature `BatchedLora` cannot reproduce.
        """
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._alone, self._lora.load, name, path)
        self._cache.drop_adapter(name)

    async def unload_adapter(self, name: str) -> None:
        if name not in self.adapter_names:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._alone, self._lora.unload, name)
        self._cache.drop_adapter(name)

    def counters(self) -> BackendCounters:
        """Positions computed and reused, result-cache hits, KV positions and bytes held."""
        cache = self._cache
        return BackendCounters(
            computed_tokens=self.stats.new_tokens,
            reused_tokens=self.stats.reused_tokens,
            result_hits=self.result_hits,
            result_misses=self.result_misses,
            kv_tokens=cache.kv_tokens,
            max_kv_tokens=cache.max_kv_tokens,
            kv_bytes=cache.kv_bytes(),
        )

    def reused_tokens(self, prompts: Iterable[tuple[str | None, Sequence[int]]]) -> int:
        """Positions of `prompts` a forward now would take from the prefix cache (a stored
        result: the whole prompt; else the stored past it extends)."""
        cache, reused = self._cache, 0
        for adapter, ids in prompts:
            tokens = tuple(ids)
            if cache.has_result(tokens, adapter):
                reused += len(tokens)
            else:
                reused += cache.stored_length(tokens, len(tokens) - 1, adapter)
        return reused

    @property
    def cache(self) -> PrefixCache:
        """The trie of results and KV segments (read-only use: sizes, for tests and metrics)."""
        return self._cache

    # -- asynchronous queries ------------------------------------------------------------------
    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The next-token log-probabilities after `token_ids`; concurrent calls are batched.

        Raises:
            BadRequest: (a subclass) for an empty, non-integer, out-of-vocabulary or long prompt.
            ModelError: if the forward pass failed.
            Cancelled: if the query was reset, or the backend closed.
        """
        tokens = self._checked(token_ids, lora_name)
        cached = self._cache.get(tokens, lora_name)
        if cached is not None:
            self.result_hits += 1
            return cached
        self.result_misses += 1
        # Shielded: a caller that cancels must not cancel the future other callers share.
        return await asyncio.shield(self._enqueue((lora_name, tokens)))

    async def logprobs_batch(
        self, prompts: Sequence[tuple[str | None, Sequence[int]]]
    ) -> list[torch.Tensor | BaseException]:
        """Each prompt's log-probabilities (or error), computed now: its rows go into the next
        forward without waiting for others (``max_wait_s`` is for single calls). Calls made in the
        same turn of the event loop share that forward. Prompts are not validated again.
        """
        if self._closed:
            raise Cancelled("the backend is closed")
        results: list[Any] = [None] * len(prompts)
        waiting: list[tuple[int, asyncio.Future[torch.Tensor]]] = []
        for index, (adapter, token_ids) in enumerate(prompts):
            tokens = tuple(token_ids)
            if adapter is not None and adapter not in self.adapter_names:
                try:
                    check_loaded_adapter(adapter, self.adapter_names)
                except Exception as exc:  # the typed error of an unknown adapter
                    results[index] = exc
                continue
            cached = self._cache.get(tokens, adapter)
            if cached is not None:
                self.result_hits += 1
                results[index] = cached
                continue
            self.result_misses += 1
            waiting.append((index, self._enqueue((adapter, tokens), urgent=True)))
        if waiting:
            outputs = await asyncio.shield(
                asyncio.gather(*(future for _, future in waiting), return_exceptions=True)
            )
            for (index, _), output in zip(waiting, outputs, strict=True):
                results[index] = output
        return results

    def reset_async_queries(self) -> None:
        """Fail every queued query with `Cancelled` (those in a running forward still finish).

        For programs whose inference algorithm died mid-way: its queued queries will not run.
        """
        self._cancel_timer()
        pending, self._pending, self._queued_callers = self._pending, OrderedDict(), 0
        for query in pending.values():
            self._fail(query, Cancelled("query reset before its forward pass"))

    async def aclose(self) -> None:
        """Cancel queued queries, let running forwards finish, and stop the forward threads."""
        if self._closed:
            return
        self._closed = True
        self.reset_async_queries()
        if self._forwards:
            await asyncio.wait(self._forwards)
        self._executor.shutdown(wait=True)

    def _enqueue(self, key: _Key, urgent: bool = False) -> asyncio.Future[torch.Tensor]:
        """The future of `key`, shared with an identical query queued or running. An `urgent`
        query is queued as if its wait were over: the next forward starts without a timer."""
        future = self._inflight.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._inflight[key] = loop.create_future()
            arrived = loop.time() - (self.max_wait_s if urgent else 0.0)
            self._pending[key] = _Query(key, future, arrived)
        elif key in self._pending:
            self._pending[key].callers += 1
        else:
            return future
        self._queued_callers += 1
        self._schedule()
        return future

    def _dequeue(self, key: _Key) -> _Query:
        query = self._pending.pop(key)
        self._queued_callers -= query.callers
        return query

    def _schedule(self, now: bool = False) -> None:
        """Start a forward if one may start and the queue is ready (or `now`), else arm the
        oldest query's timer (a forward that ends calls this again)."""
        if not self._pending or self._closed or len(self._forwards) >= self.parallel_forwards:
            return
        loop = asyncio.get_running_loop()
        if now or self._batch_ready(loop):
            self._cancel_timer()
            task = loop.create_task(self._forward())
            self._forwards.add(task)
            task.add_done_callback(self._forward_done)
        elif self._timer is None:
            self._timer = loop.call_at(self._deadline(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule(now=True)  # a timer may fire a hair early; its deadline has come

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline(self) -> float:
        return next(iter(self._pending.values())).arrived_at + self.max_wait_s

    def _batch_ready(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._queued_callers >= self.batch_size or loop.time() >= self._deadline()

    async def _forward(self) -> None:
        """Take a batch and compute it. Taken in the task, not when it is created: calls made
        in the same turn of the loop as the one that filled the queue still join it."""
        batch = self._take_batch()
        with self._pool_ticket():  # from here on, evicted slots may still be this batch's pasts
            self._schedule()  # another forward may start beside this one
            await self._run_batch(batch)

    def _forward_done(self, task: asyncio.Task[None]) -> None:
        self._forwards.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("a forward task failed", exc_info=exc)
        if not self._closed:
            self._schedule()

    def _take_batch(self) -> list[tuple[_Query, Row]]:
        """Dequeue the oldest queries that fit the limits, each with its stored past and the
        pool slots its new positions go to (reserved now, never evicting this batch's pasts)."""
        taken: list[tuple[_Query, Row]] = []
        pinned: set[Any] = set()
        width = 0
        for key in list(self._pending):
            if len(taken) == self.batch_size:
                break
            adapter, tokens = key
            cached = self._cache.get(tokens, adapter)
            if cached is not None:  # computed by a synchronous call meanwhile
                self._finish(self._dequeue(key), cached)
                continue
            past = self._past(tokens, adapter)
            new_width = max(width, len(tokens) - past.length)
            if taken and new_width * (len(taken) + 1) > self.max_batch_tokens:
                continue
            taken.append((self._dequeue(key), self._row(tokens, past, adapter, pinned)))
            width = new_width
        return taken

    def _past(self, tokens: tuple[int, ...], adapter: str | None) -> Past:
        """The stored past of `tokens` under `adapter`, leaving at least one token to run."""
        return self._cache.past(tokens, len(tokens) - 1, adapter)

    def _row(
        self, tokens: tuple[int, ...], past: Past, adapter: str | None, pinned: set[Any]
    ) -> Row:
        """A forward row for `tokens` after `past`, with slots reserved for its new KV."""
        if past.node is not None:
            pinned.add(past.node)
        new = tokens[past.length :]
        return Row(past.slots, new, adapter, self._cache.reserve(len(new), pinned))

    @contextlib.contextmanager
    def _pool_ticket(self) -> Any:
        """While a taken batch waits and runs: slots freed meanwhile are not handed out again
        (its pasts were protected while it was taken by pinning them, `reserve`)."""
        pool = self._cache.pool
        ticket = pool.begin() if pool is not None else 0
        try:
            yield
        finally:
            if pool is not None:
                pool.end(ticket)

    async def _run_batch(self, batch: list[tuple[_Query, Row]]) -> None:
        """Compute `batch` on the forward thread, as one forward or, where `ShapeSplit` says
        it is faster, two (each forward's callers have their results as it ends); resolve
        every future on every path."""
        if not batch:
            return
        split = self.shape_split
        groups = split.groups([row for _, row in batch]) if split else [list(range(len(batch)))]
        if len(groups) > 1:
            self.stats.count_shape_split()
        for index, group in enumerate(groups):
            try:
                await self._run_forward([batch[i] for i in group])
            except asyncio.CancelledError:  # this forward's queries and the later ones'
                left = [batch[i] for later in groups[index:] for i in later]
                self._abandon(left, lambda: Cancelled("the backend closed during the forward pass"))
                raise

    async def _run_forward(self, batch: list[tuple[_Query, Row]]) -> None:
        """One forward of `batch` on the forward thread; resolve its futures unless cancelled
        (the caller resolves them then)."""
        rows = [row for _, row in batch]
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, self._compute, rows)
        except Exception as exc:  # the forward thread is gone; `run_rows` catches the rest
            logger.error("a forward of %d rows could not run", len(batch), exc_info=exc)
            self._abandon(batch, functools.partial(model_error, exc))
            return
        self._drop_unfit_pool()
        for (query, row), output in zip(batch, outputs, strict=True):
            self._store(query.tokens, query.adapter, row, output)
            if isinstance(output, BaseException):
                self._fail(query, model_error(output))
            else:
                self._finish(query, output)

    def _abandon(self, batch: list[tuple[_Query, Row]], error: Callable[[], BaseException]) -> None:
        """Give back the slots reserved for `batch`'s new KV and fail its queries (an error
        each: a future's exception carries its own traceback)."""
        for query, row in batch:
            self._cache.release(row.dest)
            self._fail(query, error())

    def _drop_unfit_pool(self) -> None:
        """Run without KV reuse from now on if a forward found the model's KV layout unfit."""
        if self._kv_unfit and self._cache.pool is not None:
            self._cache.drop_pool()

    def _store(
        self, tokens: tuple[int, ...], adapter: str | None, row: Row, output: Output
    ) -> None:
        """Keep a row's result and new KV in the prefix cache (or give its slots back)."""
        if self._cache.pool is None:  # dropped after this forward: the KV layout did not fit
            row = Row(row.past, row.new_tokens, adapter)
        if isinstance(output, BaseException) or not (
            adapter is None or adapter in self.adapter_names
        ):
            self._cache.release(row.dest)
            return
        try:
            self._cache.insert(tokens, output, row.past_len, row.dest, adapter)
        except Exception:  # a bookkeeping fault must not strand the caller
            logger.exception("storing a result in the prefix cache failed")

    def _finish(self, query: _Query, logprobs: torch.Tensor) -> None:
        self._inflight.pop(query.key, None)
        if not query.future.done():
            query.future.set_result(logprobs)

    def _fail(self, query: _Query, error: BaseException) -> None:
        self._inflight.pop(query.key, None)
        if not query.future.done():
            query.future.set_exception(error)

    # -- synchronous queries -------------------------------------------------------------------
    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The same, computed now on the forward thread (no batching; caches are used).

        Call it from the thread that owns the backend (the event loop's, if one runs).
        """
        tokens = self._checked(token_ids, lora_name)
        cached = self._cache.get(tokens, lora_name)
        return cached if cached is not None else self._compute_now(tokens, lora_name)

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """The same from one plain forward over the whole prompt: no cache, no padding."""
        tokens = self._checked(token_ids, lora_name)
        return self._submit(self._uncached, tokens, lora_name)

    def cache_kv(self, prompt_tokens: Sequence[int]) -> None:
        """Compute and keep the KV of `prompt_tokens` (subject to ``max_kv_tokens``)."""
        tokens = self._checked(prompt_tokens)
        if self._cache.pool is not None and self._cache.past(tokens, len(tokens)).length < len(
            tokens
        ):
            self._compute_now(tokens)

    def clear_cache(self) -> None:
        """Forget all results and all KV."""
        self._cache.clear()

    def clear_kv_cache(self) -> None:
        """Forget all KV, keeping the results."""
        self._cache.clear_kv()

    def _compute_now(self, tokens: tuple[int, ...], adapter: str | None = None) -> torch.Tensor:
        """Compute `tokens` alone on the forward thread, reusing and storing KV and result."""
        row = self._row(tokens, self._past(tokens, adapter), adapter, set())
        with self._pool_ticket():
            try:
                (output,) = self._submit(self._compute, [row])
            except BaseException:
                self._cache.release(row.dest)
                raise
            self._drop_unfit_pool()
            self._store(tokens, adapter, row, output)
        if isinstance(output, BaseException):
            raise model_error(output) from output
        return output

    def _checked(self, token_ids: Any, lora_name: str | None = None) -> tuple[int, ...]:
        if self._closed:
            raise Cancelled("the backend is closed")
        check_loaded_adapter(lora_name, self.adapter_names)
        return tuple(self.check_prompt(token_ids))

    def run_on_forward_thread(self, fn: Any) -> Any:
        """Run `fn()` on a forward thread and return its result (for benchmarks and tests: a
        torch dispatch mode or profiler counts only what its own thread runs)."""
        return self._submit(fn)

    def _submit(self, fn: Any, *args: Any) -> Any:
        """Run `fn` on a forward thread and wait."""
        return self._executor.submit(fn, *args).result()

    # -- the forward threads ---------------------------------------------------------------------
    def _alone(self, change: Any, *args: Any) -> None:
        """Change the model (`change(*args)`) while no forward runs; captured graphs of the
        model as it was are dropped."""
        with self._gate.change():
            change(*args)
            if self._graphs is not None:
                self._graphs.forget()

    @torch.no_grad()
    def _compute(self, rows: list[Row]) -> list[Output]:
        """The rows' outputs; an eager forward's time teaches `shape_split` what forwards cost
        (a replayed CUDA graph's does not: its cost is not the eager one's)."""
        pool = self._cache.pool
        with self._gate.forward():
            graphs = self._graphs if pool is not None else None
            replays = graphs.replays if graphs is not None else 0
            started = time.perf_counter()
            try:
                outputs = run_rows(
                    self.model, rows, pool, self._forward_kwargs, self.stats, self._lora,
                    graphs.run if graphs is not None and graphs.enabled else None,
                )  # fmt: skip
            except KvLayoutMismatch as exc:  # on the first forward: no row has a past yet
                logger.warning("KV reuse is off: this model's KV does not fit the pool: %s", exc)
                self._kv_unfit = True  # the loop thread drops the pool (`_drop_unfit_pool`)
                fresh = [Row.fresh(row.new_tokens, row.adapter) for row in rows if not row.past_len]
                if len(fresh) < len(rows):
                    raise
                return run_rows(
                    self.model, fresh, None, self._forward_kwargs, self.stats, self._lora
                )
            split = self.shape_split
            if split is not None and (graphs is None or graphs.replays == replays):
                split.observe(token_slots(rows), time.perf_counter() - started)
            return outputs

    @torch.no_grad()
    def _uncached(self, tokens: tuple[int, ...], adapter: str | None = None) -> torch.Tensor:
        try:
            with self._gate.forward(), self._lora.rows([adapter]):
                return plain_forward(self.model, tokens, self._forward_kwargs)
        except Exception as exc:
            raise model_error(exc) from exc
