"""`MockAsyncLM`: deterministic log-probabilities for tests and transport benchmarks."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmqueue.shared.adapters import adapter_revision
from lmqueue.shared.errors import ModelError, SettingsError, UnknownAdapter
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.lm.validation import check_loaded_adapter
from lmqueue.shared.wire import ids_to_bytes, vector_payload

from .options import check_options

__all__ = ["MockAsyncLM"]

#: A row of a batch: its prompt's token ids and its adapter (None: the base model).
_Row = tuple[list[int], str | None]


class MockAsyncLM(AsyncLM):
    """Log-probabilities drawn from a generator seeded by the exact token tuple.

    Equal prompts give bit-identical vectors in every process, so results through the queue
    can be compared with results computed in-process. It serves LoRA adapters too: a loaded
    adapter perturbs every vector by noise seeded by the adapter directory's files and the
    prompt, so rows of different adapters differ, deterministically, at no model's cost (fast
    tests of the whole adapter path; the HF backend is the real thing). Concurrent calls are
    batched like a real backend's: one batch at a time, callers arriving meanwhile join the
    next one.

    Args:
        tokenizer: a HuggingFace tokenizer; its vocabulary sizes the vectors.
        batch_delay_s: each batch sleeps this long, like a GPU busy on a forward pass (no CPU
            is used while waiting), so a worker's throughput is bounded as a real one's is.
        token_delay_s: each batch also sleeps this long per prompt token in it, so a batch
            costs in proportion to the tokens it computes (the fairness benchmark).
        poison_token: a token id whose presence in a prompt fails the whole batch with
            `ModelError`, as a bad input can crash a shared forward pass (for fault tests).
        crash_token: a token id whose presence in a batch kills the whole process at once
            (``os._exit(1)``), as a segfaulting kernel would; for fault tests only.
        oom_batch_size: batches of more prompts than this fail with `torch.OutOfMemoryError`,
            as a GPU runs out of memory on a batch too large (for fault tests).
        vector_size: the length of every vector, past the vocabulary's (0: the vocabulary's), to
            move vectors of a larger model's size in benchmarks.
        distinct_vectors: when > 0, that many vectors are computed once and each prompt gets
            the one its digest picks (still deterministic), so a call costs no CPU beyond the
            digest: transport and scaling benchmarks then measure the queue, not the mock.
            The returned tensors are shared between calls; treat them as read-only.
    """

    backend_name = "mock"

    def __init__(
        self,
        tokenizer: Any,
        batch_delay_s: float = 0.0,
        poison_token: int | None = None,
        distinct_vectors: int = 0,
        crash_token: int | None = None,
        oom_batch_size: int | None = None,
        vector_size: int = 0,
        token_delay_s: float = 0.0,
        **vocab: Any,
    ) -> None:
        super().__init__(tokenizer, **vocab)
        if distinct_vectors < 0:
            raise ValueError(f"distinct_vectors={distinct_vectors!r}: must be >= 0")
        if vector_size and vector_size < self.vocab_size:
            raise ValueError(
                f"vector_size={vector_size!r}: below the vocabulary's {self.vocab_size}"
            )
        self._vector_size = vector_size or self.vocab_size
        self.batch_delay_s = batch_delay_s
        self.token_delay_s = token_delay_s
        self.poison_token = poison_token
        self.crash_token = crash_token
        self.oom_batch_size = oom_batch_size
        self._vectors = [self._vector_of_seed(seed) for seed in range(distinct_vectors)]
        #: A shared vector's place in `_vectors` by its id (they live as long as the mock).
        self._vector_index = {id(vector): index for index, vector in enumerate(self._vectors)}
        #: (place, wire dtype) -> a shared vector's bytes in that dtype, made on first use.
        self._wire_bytes: dict[tuple[int, str], memoryview] = {}
        self.batch_sizes: list[int] = []
        #: Calls waiting for the next batch: their rows, and the future of the rows' results.
        self._waiting: list[tuple[list[_Row], asyncio.Future[list[Any]]]] = []
        #: Loaded adapters: name -> the seed of its perturbation (its files' digest).
        self._adapter_seeds: dict[str, bytes] = {}
        self._busy: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    #: lmqueue's own options of `from_name`; see workers.backends.options.
    OPTIONS = frozenset(
        {"batch_delay_s", "poison_token", "distinct_vectors", "crash_token", "oom_batch_size",
         "vector_size", "token_delay_s"}
    )  # fmt: skip

    @classmethod
    def from_name(
        cls, model: str, *, engine_opts: dict[str, Any] | None = None, **options: Any
    ) -> MockAsyncLM:
        """A mock over the vocabulary of `model`'s tokenizer.

        Raises:
            SettingsError: `engine_opts` (there is no engine) or an option it does not accept.
        """
        from lmqueue.workers.models import load_tokenizer

        if engine_opts:
            raise SettingsError("the mock backend has no engine: engine_opts cannot be honoured")
        check_options(cls.backend_name, options, cls.OPTIONS)
        return cls(load_tokenizer(model), **options)

    @property
    def revision(self) -> str:
        return "mock-v1"

    @property
    def vector_size(self) -> int:
        """The vocabulary's size, or the ``vector_size`` option: rows past the vocabulary are
        padding that never comes up (-inf), as in models whose output layer is padded."""
        return self._vector_size

    supports_adapters = True

    @property
    def adapter_names(self) -> frozenset[str]:
        return frozenset(self._adapter_seeds)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load an adapter: only its files' digest is read (it seeds the perturbation)."""
        self._adapter_seeds[name] = (await asyncio.to_thread(adapter_revision, path)).encode()

    async def unload_adapter(self, name: str) -> None:
        self._adapter_seeds.pop(name, None)

    def logprobs_of(self, token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        """The deterministic log-probability vector of one prompt (under a loaded adapter)."""
        ids = self.check_prompt(token_ids)
        check_loaded_adapter(lora_name, self.adapter_names)
        return self._vector(ids, lora_name)

    def _vector(self, ids: Sequence[int], lora_name: str | None) -> torch.Tensor:
        """`logprobs_of` a prompt validated already, under an adapter known to be loaded.

        A shared vector (`distinct_vectors`) is picked by the hash of the ids' tuple: ints hash
        to themselves and a tuple combines them with fixed constants (no ``PYTHONHASHSEED``),
        so every process picks the same, at 0.1 us a row against 1.3 for packing the ids and
        digesting them (``timeit``), a cost the transport benchmarks charged to the queue.
        """
        vectors = self._vectors
        base = vectors[hash(tuple(ids)) % len(vectors)] if vectors else None
        if base is not None and lora_name is None:
            return base
        token_bytes = ids_to_bytes(ids)  # the bytes its requests travel as
        if base is None:
            digest = hashlib.blake2b(token_bytes, digest_size=8).digest()
            base = self._vector_of_seed(int.from_bytes(digest, "little"))
        if lora_name is None:
            return base
        noise_seed = hashlib.blake2b(self._adapter_seeds[lora_name] + token_bytes, digest_size=8)
        rng = np.random.default_rng(int.from_bytes(noise_seed.digest(), "little"))
        noise = torch.from_numpy(rng.standard_normal(self.vector_size, dtype=np.float32))
        return torch.log_softmax(base + noise, dim=-1)

    def _vector_of_seed(self, seed: int) -> torch.Tensor:
        rng = np.random.default_rng(seed)
        logits = torch.from_numpy(rng.standard_normal(self.vocab_size, dtype=np.float32) * 3)
        vector = torch.log_softmax(logits, dim=-1)
        if self.vector_size == self.vocab_size:
            return vector
        padding = torch.full((self.vector_size - self.vocab_size,), -torch.inf)
        return torch.cat([vector, padding])

    def wire_payload(self, logprobs: torch.Tensor, dtype: str) -> Any:
        """A shared vector (`distinct_vectors`) is converted to a wire dtype once, not for
        every reply: the backend's part costs nothing in a 16-bit dtype either, as on a GPU
        that narrows on the device (and as the transport benchmark's probe sends precomputed
        bytes). Any other row converts as on every backend (`AsyncLM.wire_payload`)."""
        index = self._vector_index.get(id(logprobs))
        if dtype == "float32" or index is None:  # ids of live vectors name no other object
            return super().wire_payload(logprobs, dtype)
        payload = self._wire_bytes.get((index, dtype))
        if payload is None:
            payload = vector_payload(logprobs, dtype).toreadonly()
            self._wire_bytes[(index, dtype)] = payload
        return payload

    def next_token_logprobs_sync(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        self._check_poison([self.check_prompt(token_ids)])
        return self.logprobs_of(token_ids, lora_name)

    async def next_token_logprobs(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        ids = self.check_prompt(token_ids)
        check_loaded_adapter(lora_name, self.adapter_names)
        (result,) = await self._call([(ids, lora_name)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def logprobs_batch(
        self, prompts: Sequence[tuple[str | None, Sequence[int]]]
    ) -> list[torch.Tensor | BaseException]:
        """The prompts as one batch (joined by calls of the same instant), each row's result or
        error in order. Prompts are not validated again (the worker did)."""
        return await self._call([(list(ids), adapter) for adapter, ids in prompts])

    async def _call(self, rows: list[_Row]) -> list[Any]:
        """Each row's result or error, computed in the next batch (one future per call, not
        per row: transport benchmarks charge the mock's own CPU to the queue)."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append((rows, future))
        async with self._batch_lock():
            if not future.done():
                await self._run_batch()
        return await future

    def _batch_lock(self) -> asyncio.Lock:
        """The lock serializing batches on the running loop (tests use several loops)."""
        loop = asyncio.get_running_loop()
        if self._busy is None or self._busy[0] is not loop:
            self._busy = (loop, asyncio.Lock())
        return self._busy[1]

    async def _run_batch(self) -> None:
        """Take every waiting call as one batch; on interruption hand them to the next leader."""
        await asyncio.sleep(0)  # let callers of this same instant join
        batch, self._waiting = self._waiting, []
        rows = [row for call_rows, _ in batch for row in call_rows]
        try:
            delay_s = self.batch_delay_s + self.token_delay_s * sum(len(ids) for ids, _ in rows)
            if delay_s:
                await asyncio.sleep(delay_s)
        except BaseException:
            self._waiting[:0] = batch
            raise
        self.batch_sizes.append(len(rows))
        try:
            self._check_poison([ids for ids, _ in rows])
            loaded = self.adapter_names
            results: list[Any] = [self._row(ids, name, loaded) for ids, name in rows]
        except (ModelError, torch.OutOfMemoryError) as exc:
            results = [exc] * len(rows)
        start = 0
        for call_rows, future in batch:
            end = start + len(call_rows)
            if not future.done():
                future.set_result(results[start:end])
            start = end

    def _row(self, ids: list[int], lora_name: str | None, loaded: frozenset[str]) -> Any:
        """One row's vector, or its own error (an adapter unloaded while it waited).

        Its prompt is not validated again: a call checked it on arrival, and the worker checks
        a batch's before `logprobs_batch` (as the hf backend trusts it to); a second check was
        the mock's own CPU, which transport benchmarks charged to the queue.
        """
        if lora_name is not None:
            try:
                check_loaded_adapter(lora_name, loaded)
            except UnknownAdapter as exc:
                return exc
        return self._vector(ids, lora_name)

    def _check_poison(self, prompts: list[list[int]]) -> None:
        if self.crash_token is not None and any(self.crash_token in ids for ids in prompts):
            os._exit(1)
        if self.oom_batch_size is not None and len(prompts) > self.oom_batch_size:
            raise torch.OutOfMemoryError(f"a batch of {len(prompts)} prompts does not fit")
        if self.poison_token is None:
            return
        if any(self.poison_token in ids for ids in prompts):
            raise ModelError(f"poison token {self.poison_token} failed the batch", poison=True)
