"""`AsyncTokenCharacterTrie`: concurrent mass requests batched into one bulk computation.

Many programs (particles of a sequential Monte Carlo run, say) ask for masses of their own
distribution at the same moment. Each call queues its vector and awaits a future; one
background task takes everything queued, computes each operation's batch in one call of the
underlying trie on a worker thread (so the event loop keeps serving), and resolves the futures.

Every queued future is resolved on every path: with its rows, with the exception that failed
its batch (the trie keeps serving later calls), or with `Cancelled` when the trie shuts down
first. A caller only sees `asyncio.CancelledError` if it cancelled its own call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from ...errors import Cancelled
from .inputs import MAX, SUM, Reduction, as_weight_matrix
from .parallel import ParallelTokenCharacterTrie
from .structure import TokenCharacterTrie

__all__ = ["AsyncTokenCharacterTrie"]

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """One caller's weights and the future its masses go to."""

    matrix: np.ndarray
    single: bool
    reduction: Reduction
    future: asyncio.Future[np.ndarray]


class AsyncTokenCharacterTrie:
    """Batches concurrent `mass_sum` / `mass_max` calls over one `TokenCharacterTrie`.

    Use as ``async with AsyncTokenCharacterTrie.from_vocab(vocab) as trie:`` or call `start`
    and `shutdown` yourself; calls outside that lifespan raise `RuntimeError`.

    Args:
        trie: the trie that computes (its batch methods run on a worker thread).
        max_batch_rows: the most weight vectors computed in one call (a batch's result is
            ``rows x nodes`` float64: 64 rows of a 49k vocabulary's trie are ~77 MB).

    Each caller's result is its rows of the batch's array (a view, not a copy).
    """

    def __init__(self, trie: TokenCharacterTrie, *, max_batch_rows: int = 64) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be at least 1, got {max_batch_rows}")
        self.trie = trie
        self.max_batch_rows = max_batch_rows
        self._queue: asyncio.Queue[_Request | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closing = False

    @classmethod
    def from_vocab(
        cls,
        byte_vocab: Sequence[bytes],
        backend: str = "parallel",
        *,
        max_batch_rows: int = 64,
        **trie_kwargs: Any,
    ) -> AsyncTokenCharacterTrie:
        """Build the trie of `byte_vocab` with `backend` (``"parallel"`` or ``"sequential"``).

        `trie_kwargs` go to the trie's constructor (``device=`` for the parallel one).
        """
        trie: TokenCharacterTrie
        if backend == "parallel":
            trie = ParallelTokenCharacterTrie(byte_vocab, **trie_kwargs)
        elif backend == "sequential":
            trie = TokenCharacterTrie(byte_vocab, **trie_kwargs)
        else:
            raise ValueError(f"backend must be 'parallel' or 'sequential', got {backend!r}")
        return cls(trie, max_batch_rows=max_batch_rows)

    @property
    def running(self) -> bool:
        """Whether the trie takes requests (started and not shutting down)."""
        return self._task is not None and not self._task.done() and not self._closing

    async def start(self) -> None:
        """Start the background batcher on the running event loop."""
        if self._task is not None:
            raise RuntimeError("AsyncTokenCharacterTrie is already started")
        self._closing = False
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trie")
        self._task = asyncio.create_task(self._serve(self._queue), name="trie-batcher")

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Refuse new calls, finish the queued ones within `timeout_s`, then cancel the rest."""
        if self._task is None or self._queue is None or self._executor is None:
            return
        task, queue, executor = self._task, self._queue, self._executor
        self._closing = True
        queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            _fail_all(_drain(queue), Cancelled("the trie shut down before this request ran"))
            executor.shutdown(wait=False, cancel_futures=True)
            self._task = self._queue = self._executor = None

    async def __aenter__(self) -> AsyncTokenCharacterTrie:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.shutdown()

    async def mass_sum(self, p: Any) -> np.ndarray:
        """Total weight under every node; `p` is one vector (or a batch, answered as one)."""
        return await self._submit(p, SUM)

    async def mass_max(self, p: Any) -> np.ndarray:
        """Largest weight under every node; `p` is one vector (or a batch, answered as one)."""
        return await self._submit(p, MAX)

    async def _submit(self, weights: Any, reduction: Reduction) -> np.ndarray:
        """Check `weights` here, so a bad vector fails its own call and no one else's."""
        if not self.running or self._queue is None:
            raise RuntimeError(
                "AsyncTokenCharacterTrie is not running: use `async with` or start()"
            )
        matrix, single = as_weight_matrix(weights, len(self.trie.decode))
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Request(matrix, single, reduction, future))
        return await future

    async def _serve(self, queue: asyncio.Queue[_Request | None]) -> None:
        """Take what is queued, compute it, repeat; stop at the shutdown sentinel."""
        batch: list[_Request] = []
        try:
            while True:
                batch, stop = await self._next_batch(queue)
                for reduction in (SUM, MAX):
                    await self._compute([r for r in batch if r.reduction is reduction])
                batch = []
                if stop:
                    return
        except BaseException:
            _fail_all(batch + _drain(queue), Cancelled("the trie stopped before this request ran"))
            raise

    async def _next_batch(
        self, queue: asyncio.Queue[_Request | None]
    ) -> tuple[list[_Request], bool]:
        """Wait for one request, then take what else is already queued (up to the row cap)."""
        first = await queue.get()
        if first is None:
            return [], True
        batch, rows = [first], len(first.matrix)
        while rows < self.max_batch_rows and not queue.empty():
            request = queue.get_nowait()
            if request is None:
                return batch, True
            batch.append(request)
            rows += len(request.matrix)
        return batch, False

    async def _compute(self, requests: list[_Request]) -> None:
        """One bulk call for `requests`; its rows, or its failure, go to every live future."""
        live = [r for r in requests if not r.future.done()]
        if not live:
            return
        compute = (
            self.trie.batch_weight_sum if live[0].reduction is SUM else self.trie.batch_weight_max
        )
        matrix = live[0].matrix if len(live) == 1 else np.concatenate([r.matrix for r in live])
        loop = asyncio.get_running_loop()
        try:
            masses = await loop.run_in_executor(self._executor, compute, matrix)
        except Exception as exc:
            logger.error(
                "trie %s batch of %d rows failed",
                live[0].reduction.name,
                len(matrix),
                exc_info=True,
            )
            _fail_all(live, exc)
            return
        offset = 0
        for request in live:
            rows = masses[offset : offset + len(request.matrix)]
            offset += len(request.matrix)
            if not request.future.done():
                request.future.set_result(rows[0] if request.single else rows)


def _drain(queue: asyncio.Queue[_Request | None]) -> list[_Request]:
    """Everything still queued (sentinels dropped)."""
    items = []
    while not queue.empty():
        item = queue.get_nowait()
        if item is not None:
            items.append(item)
    return items


def _fail_all(requests: list[_Request], error: BaseException) -> None:
    """Set `error` on every request whose future is still pending."""
    for request in requests:
        if not request.future.done():
            request.future.set_exception(error)
