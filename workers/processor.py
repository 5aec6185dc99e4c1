"""`BatchProcessor`: from a batch of raw stream entries to an `Outcome`.

The steps, each cheap before the expensive one:

1. admit: decode, size-check, deadline-check and validate every entry; a bad entry gets its
   typed error reply (or a dead letter when it names no client) and never reaches the model;
2. look up every distinct prompt in the shared cache with one MGET;
3. compute each distinct missing prompt once through the backend, the batch in one call
   (`AsyncLM.logprobs_batch`: one forward); when a shared forward fails, bisect to find the
   request that poisons it, so the others still get results. A backend also batches calls of
   *other* batches in flight on this worker, so a failure is only final once re-run with the
   backend to itself
   (`ForwardGate`): another batch's poison never becomes this batch's error;
4. encode vectors once per (prompt, dtype) and answer every request; a fresh result the
   worker writes to the shared cache goes to clients that resolve claim-checks as one.

A prompt is always paired with the LoRA adapter it is asked under (`PromptKey`, built once per
request at admission): de-duplication, cache keys and backend calls never mix rows of two
adapters. Admission checks the adapter against the worker's `AdapterSet` for the lane's tenant
(served? private to another tenant?).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from lmqueue.shared.errors import (
    BadRequest,
    DeadlineExceeded,
    LMQueueError,
    MalformedMessage,
    ModelError,
    OversizeRequest,
    UnknownAdapter,
)
from lmqueue.shared.keys import validate_client_id
from lmqueue.shared.lm.interface import AsyncLM
from lmqueue.shared.lm.validation import check_token_bytes, token_bytes_pass
from lmqueue.shared.prompt_key import PromptKey
from lmqueue.shared.redis_errors import REDIS_TROUBLE
from lmqueue.shared.shared_cache import SharedCache
from lmqueue.shared.wire import (
    Request,
    bytes_to_vector,
    payload_bytes,
    vector_payload,
)

from .adapter_set import AdapterSet
from .late_binding import ForwardPart
from .metrics import WorkerMetrics
from .outcome import Outcome, Payload
from .recent_writes import RecentWrites
from .request_stream import Entry

__all__ = ["BatchProcessor", "ForwardGate", "MassComputer"]

logger = logging.getLogger(__name__)

_VALID_CLIENTS_KEPT = 4096


class MassComputer(Protocol):
    """Turns next-token log-probabilities into token-character trie masses.

    Used between ``async with`` enter and exit (the worker holds it while serving).
    """

    async def __aenter__(self) -> Any:  # pragma: no cover - protocol
        """Start what computing needs (a batching task)."""
        ...

    async def __aexit__(self, *exc_info: Any) -> None:  # pragma: no cover - protocol
        """Stop it; calls after this fail."""
        ...

    async def masses(
        self, logprobs: np.ndarray, request: Request
    ) -> np.ndarray:  # pragma: no cover - protocol
        """Masses of the nodes `request` asks for (all if none) for one log-probability vector."""
        ...


class _Job(NamedTuple):
    """An admitted request, the entry it came from, and what it computes (a tuple: made once
    a request, on the worker's loop)."""

    entry: Entry
    request: Request
    prompt: PromptKey


class ForwardGate:
    """Batches share the backend; a batch isolating a failure has it to itself.

    Shared users enter freely unless an exclusive user holds or awaits the gate; an exclusive
    user waits for the shared ones inside to leave. Counters change without awaiting, so a
    cancelled user can never leave the gate closed.
    """

    def __init__(self) -> None:
        self._shared = 0
        self._exclusive_wanted = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._exclusive = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """Run alongside other shared users."""
        while not self._open.is_set():
            await self._open.wait()
        self._shared += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._shared -= 1
            if not self._shared:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Run alone: no shared user is inside meanwhile."""
        self._exclusive_wanted += 1
        self._open.clear()
        try:
            async with self._exclusive:
                while self._shared:
                    await self._idle.wait()
                yield
        finally:
            self._exclusive_wanted -= 1
            if not self._exclusive_wanted:
                self._open.set()


class BatchProcessor:
    """Answers batches of request entries with one backend and an optional shared cache."""

    def __init__(
        self,
        backend: AsyncLM,
        cache: SharedCache | None,
        max_prompt_tokens: int = 0,
        max_request_bytes: int = 1 << 20,
        masses: MassComputer | None = None,
        metrics: WorkerMetrics | None = None,
        adapters: AdapterSet | None = None,
        tenant: str = "default",
        gate: ForwardGate | None = None,
        recent: RecentWrites | None = None,
    ) -> None:
        self.backend = backend
        #: The shared-cache keys this worker wrote lately (shared by its lanes).
        self.recent = recent if recent is not None else RecentWrites()
        self.cache = cache
        self.adapters = adapters
        self.tenant = tenant
        self.max_prompt_tokens = max_prompt_tokens or backend.max_prompt_tokens
        self.max_request_bytes = max_request_bytes
        self.mass_computer = masses
        self.metrics = metrics
        #: Shared by the lanes of one worker (`TenantLanes`): an isolating batch has the backend
        #: to itself, whichever tenant's it is.
        self.gate = gate if gate is not None else ForwardGate()
        #: Client ids already validated (a regex per entry otherwise); cleared when full.
        self._valid_clients: set[str] = set()

    async def process(
        self, entries: Sequence[Entry], forward: ForwardPart | None = None
    ) -> Outcome:
        """Answer every entry; never raises for a request's fault.

        `forward`: the entries are one part of a batch, whose parts call the backend together
        and report when it is done with them (see `late_binding`).
        """
        outcome = Outcome(acks=[entry.entry_id for entry in entries])
        now_ms = time.time() * 1000
        unknown: list[Entry] = []  # naming an adapter not loaded here (yet)
        checked = self._prompts_pass(entries)
        jobs = [
            job
            for entry in entries
            if (job := self._admit(entry, outcome, now_ms, checked, unknown)) is not None
        ]
        if unknown and self.adapters is not None:  # loaded if published since, else refused
            with contextlib.suppress(*REDIS_TROUBLE):
                await self.adapters.refresh()
            for entry in unknown:
                if (job := self._admit(entry, outcome, now_ms, checked)) is not None:
                    jobs.append(job)
        if self.metrics is not None:
            tokens = sum(job.prompt.token_count for job in jobs)
            self.metrics.observe_batch(len(entries), tokens)
        try:
            if jobs:
                await self._answer(jobs, outcome, forward)
        finally:
            if forward is not None:
                forward.computed()
        return outcome

    # -- 1. admission ------------------------------------------------------------------------------
    def _prompts_pass(self, entries: Sequence[Entry]) -> bool:
        """Whether the prompt of every decodable entry passes `check_token_bytes`, checked for
        the batch at once (`token_bytes_pass`). False: each entry is checked on its own, as
        before, and told what is wrong with its own."""
        prompts = []
        for entry in entries:
            try:
                prompts.append(entry.request().token_bytes)
            except MalformedMessage:
                continue  # refused by its admission
        return token_bytes_pass(prompts, self.backend.vocab_size, self.max_prompt_tokens)

    def _admit(
        self,
        entry: Entry,
        outcome: Outcome,
        now_ms: float,
        prompts_checked: bool = False,
        unknown: list[Entry] | None = None,
    ) -> _Job | None:
        """The entry's job, or None with its error (or dead letter) in `outcome`; an entry
        naming an adapter not served goes to `unknown` instead, when given (see `process`).
        With `prompts_checked`, its prompt passed `_prompts_pass` with the batch."""
        try:
            request = entry.request()
            if request.client_id not in self._valid_clients:
                validate_client_id(request.client_id)
                if len(self._valid_clients) >= _VALID_CLIENTS_KEPT:
                    self._valid_clients.clear()
                self._valid_clients.add(request.client_id)
        except MalformedMessage as exc:
            client, request_id = exc.data.get("client_id"), exc.data.get("request_id")
            if isinstance(client, str) and isinstance(request_id, str) and _valid_client(client):
                outcome.error(client, request_id, exc)
            else:
                logger.info("dead-lettering entry %s: %s", entry.entry_id, exc.message)
                outcome.dead_letter(entry, exc)
            return None
        except ValueError as exc:  # an invalid client name
            outcome.dead_letter(entry, MalformedMessage(str(exc)))
            return None
        if request.packs:
            outcome.packing.add(request.client_id)
        try:
            self._check(entry, request, now_ms, prompts_checked)
        except LMQueueError as exc:
            if isinstance(exc, UnknownAdapter) and unknown is not None:
                unknown.append(entry)
                return None
            logger.info("request %s refused: %s", request.request_id, exc.message)
            outcome.error(request.client_id, request.request_id, exc)
            return None
        return _Job(entry, request, PromptKey.of_request(request))

    def _check(
        self, entry: Entry, request: Request, now_ms: float, prompts_checked: bool = False
    ) -> None:
        size = sum(map(len, entry.fields.values()))
        if size > self.max_request_bytes:
            raise OversizeRequest(
                f"request of {size} bytes exceeds the workers' limit of "
                f"{self.max_request_bytes} (LMQ_MAX_REQUEST_BYTES)",
                size=size,
                limit=self.max_request_bytes,
            )
        if request.deadline_ms and request.deadline_ms < now_ms:
            raise DeadlineExceeded("the request's deadline passed before a worker took it")
        if not prompts_checked:
            check_token_bytes(request.token_bytes, self.backend.vocab_size, self.max_prompt_tokens)
        if request.kind == "mass" and self.mass_computer is None:
            raise BadRequest("this worker serves no trie mass requests")
        if request.adapter is not None:
            if self.adapters is None:
                raise UnknownAdapter(
                    f"LoRA adapter {request.adapter!r} is not served; served: none",
                    adapter=request.adapter, served=[],
                )  # fmt: skip
            self.adapters.check(request.adapter, self.tenant)

    # -- 2-4. answering ----------------------------------------------------------------------------
    async def _answer(
        self, jobs: list[_Job], outcome: Outcome, forward: ForwardPart | None = None
    ) -> None:
        wanted, unlooked = _wanted(jobs)
        #: (prompt, dtype) -> its cache key, made once (a digest each) for the lookup and the write
        cache_keys = self._cache_keys(wanted)
        payloads = await self._cached_payloads(cache_keys, unlooked)
        to_compute = (  # nothing found (the usual batch: its clients looked): no test a prompt
            (
                prompt
                for prompt, dtypes in wanted.items()
                if any((prompt, dtype) not in payloads for dtype in dtypes)
            )
            if payloads
            else wanted
        )
        missing = sorted(to_compute, key=PromptKey.order)
        if missing:  # what the forward will compute: the prefix cache's part is not charged
            outcome.computed_prompts += len(missing)
            tokens = sum(prompt.token_count for prompt in missing)
            reused = self.backend.reused_tokens((p.adapter, p.ids()) for p in missing)
            outcome.computed_tokens += max(tokens - reused, 0)
        started = time.perf_counter()
        computed = await self._compute(missing, forward)
        if missing and self.metrics is not None:
            self.metrics.observe_forward(time.perf_counter() - started)
        #: (prompt, dtype) -> the cache key its payload is being written under
        written: dict[tuple[PromptKey, str], str] = {}
        backend = self.backend
        for prompt in missing:
            result = computed[prompt]
            if isinstance(result, BaseException):
                continue
            for dtype in wanted[prompt]:
                payload = backend.wire_payload(result, dtype)  # else made on the writer thread
                payloads[(prompt, dtype)] = payload
                key = cache_keys.get((prompt, dtype))
                if key is not None:
                    written[(prompt, dtype)] = key
                    outcome.cache_puts.append((key, payload))
        self.recent.add(written.values())
        masses = []  # computed together: whole-vector masses share one bulk trie call
        for job in jobs:
            request, prompt = job.request, job.prompt
            failure = computed.get(prompt)
            if isinstance(failure, BaseException):
                outcome.error(request.client_id, request.request_id, failure)
                continue
            wire = (prompt, _vector_dtype(request))
            cached = prompt not in computed
            if request.kind != "logprobs":
                masses.append(self._reply_masses(request, payloads[wire], cached, outcome))
            elif request.claims and wire in written:
                outcome.claimable_result(
                    request.client_id, request.request_id, payloads[wire], request.dtype,
                    written[wire],
                )  # fmt: skip
            else:
                outcome.result(
                    request.client_id, request.request_id, payloads[wire], request.dtype, cached
                )
        await asyncio.gather(*masses)

    def _cache_keys(self, wanted: dict[PromptKey, set[str]]) -> dict[tuple[PromptKey, str], str]:
        """The shared-cache key of every (prompt, dtype) wanted, in the order wanted; none
        without a cache."""
        cache = self.cache
        if cache is None:
            return {}
        key_of = cache.key_of
        return {
            (prompt, dtype): key_of(prompt, dtype)
            for prompt, dtypes in wanted.items()
            for dtype in dtypes
        }

    async def _cached_payloads(
        self,
        cache_keys: dict[tuple[PromptKey, str], str],
        unlooked: set[tuple[PromptKey, str]],
    ) -> dict[tuple[PromptKey, str], Payload]:
        """What the shared cache holds of what is wanted: looked up where no client looked
        just before, or where this worker has written it since (`RecentWrites`)."""
        if self.cache is None:
            return {}
        recent = self.recent
        keys = [wire for wire, key in cache_keys.items() if wire in unlooked or key in recent]
        if not keys:
            return {}
        values = await self.cache.get_many([cache_keys[wire] for wire in keys],
                                           [dtype for _, dtype in keys])  # fmt: skip
        found: dict[tuple[PromptKey, str], Payload] = {
            key: value for key, value in zip(keys, values, strict=True) if value is not None
        }
        if self.metrics is not None:
            self.metrics.count_shared_cache(len(found), len(keys) - len(found))
        return found

    async def _reply_masses(
        self, request: Request, logprobs_payload: Payload, cached: bool, outcome: Outcome
    ) -> None:
        assert self.mass_computer is not None
        try:
            logprobs = bytes_to_vector(payload_bytes(logprobs_payload), "float32")
            masses = await self.mass_computer.masses(logprobs, request)
        except LMQueueError as exc:
            outcome.error(request.client_id, request.request_id, exc)
            return
        outcome.result(
            request.client_id, request.request_id, vector_payload(masses, request.dtype),
            request.dtype, cached,
        )  # fmt: skip

    async def _compute(
        self, prompts: list[PromptKey], forward: ForwardPart | None = None
    ) -> dict[PromptKey, Any]:
        """Log-probabilities (tensor) or the final error of each distinct prompt.

        With `forward`, the call waits for the batch's other parts, and reports when done.
        """
        if not prompts:
            return {}
        if forward is not None:
            await forward.ready()
        try:
            return await self._compute_now(prompts)
        finally:
            if forward is not None:
                forward.computed()

    async def _compute_now(self, prompts: list[PromptKey]) -> dict[PromptKey, Any]:
        async with self.gate.shared():
            results = await self._run(prompts)
        failures = [p for p in prompts if _is_forward_failure(results[p])]
        if failures:
            logger.info("a forward failed for %d prompts; isolating", len(failures))
            async with self.gate.exclusive():
                results.update(await self._isolate(failures))
        return {p: _final(r) for p, r in results.items()}

    async def _run(self, prompts: list[PromptKey]) -> dict[PromptKey, Any]:
        """The backend's result or error for each prompt, all in one call (one forward)."""
        outputs = await self.backend.logprobs_batch([(p.adapter, p.ids()) for p in prompts])
        return dict(zip(prompts, outputs, strict=True))

    async def _isolate(self, prompts: list[PromptKey]) -> dict[PromptKey, Any]:
        """Re-run failed prompts in halves, one half at a time, until each failure is alone."""
        if len(prompts) == 1:
            return await self._run(prompts)
        middle = len(prompts) // 2
        results: dict[PromptKey, Any] = {}
        for half in (prompts[:middle], prompts[middle:]):
            outputs = await self._run(half)
            failed = [p for p in half if _is_forward_failure(outputs[p])]
            results.update(outputs)
            if len(failed) > 1:
                results.update(await self._isolate(failed))
        return results


def _wanted(
    jobs: Sequence[_Job],
) -> tuple[dict[PromptKey, set[str]], set[tuple[PromptKey, str]]]:
    """The dtypes wanted of each distinct prompt, and the (prompt, dtype) pairs some request
    wants that its client did not look up in the shared cache just before sending."""
    wanted: dict[PromptKey, set[str]] = {}
    unlooked: set[tuple[PromptKey, str]] = set()
    for job in jobs:
        dtype = _vector_dtype(job.request)
        wanted.setdefault(job.prompt, set()).add(dtype)
        if not job.request.looked:
            unlooked.add((job.prompt, dtype))
    return wanted, unlooked


def _vector_dtype(request: Request) -> str:
    """The dtype of the log-probability payload a request needs (masses need float32)."""
    return request.dtype if request.kind == "logprobs" else "float32"


def _valid_client(client_id: str) -> bool:
    try:
        validate_client_id(client_id)
    except ValueError:
        return False
    return True


def _is_forward_failure(result: Any) -> bool:
    """An exception that may come from a shared forward rather than this request itself."""
    return isinstance(result, Exception) and not isinstance(result, BadRequest)


def _final(result: Any) -> Any:
    """Results pass; exceptions become lmqueue errors (foreign ones as ModelError)."""
    if isinstance(result, torch.Tensor) or not isinstance(result, BaseException):
        return result
    if isinstance(result, LMQueueError):
        return result
    if not isinstance(result, Exception):
        raise result  # CancelledError and friends are not a request's outcome
    error = ModelError(f"{type(result).__name__}: {result}")
    error.__cause__ = result
    return error
