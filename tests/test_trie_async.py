"""`AsyncTokenCharacterTrie`: batching, failures, cancellation and its lifespan."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from test_trie import weights_for

from lmqueue.shared.errors import Cancelled, VocabularyMismatch
from lmqueue.shared.lm.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)

WORDS = [b"a", b"ab", b"abc", b"b", b"", b"ab", b"\xc3\xa9"]


class RecordingTrie(ParallelTokenCharacterTrie):
    """Records each bulk call's batch size; can be told to fail or to block."""

    def __init__(self) -> None:
        super().__init__(WORDS, device="cpu")
        self.calls: list[tuple[str, int]] = []
        self.failures = 0
        self.entered = threading.Event()
        self.exited = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def batch_weight_sum(self, ws: Any, nodes: Any = None) -> np.ndarray:
        return self._record("sum", ws, super().batch_weight_sum)

    def batch_weight_max(self, ws: Any, nodes: Any = None) -> np.ndarray:
        return self._record("max", ws, super().batch_weight_max)

    def _record(self, op: str, ws: Any, compute: Any) -> np.ndarray:
        self.calls.append((op, len(ws)))
        self.entered.set()
        try:
            self.release.wait(timeout=30)
            if self.failures:
                self.failures -= 1
                raise RuntimeError("injected failure")
            return compute(ws)
        finally:
            self.exited.set()


@pytest.fixture
async def recording() -> Any:
    """A started async trie over a `RecordingTrie`, shut down after the test."""
    trie = RecordingTrie()
    async with AsyncTokenCharacterTrie(trie) as async_trie:
        yield async_trie, trie


async def test_concurrent_calls_are_computed_in_one_batch_per_operation(recording: Any) -> None:
    async_trie, trie = recording
    p = weights_for(len(WORDS), 6, seed=0)
    results = await asyncio.gather(
        *(async_trie.mass_sum(row) for row in p[:4]),
        *(async_trie.mass_max(np.log(row)) for row in p[4:]),
    )
    assert sorted(trie.calls) == [("max", 2), ("sum", 4)]
    for row, masses in zip(p[:4], results[:4], strict=True):
        np.testing.assert_array_equal(masses, trie.weight_sum(row))
    for row, masses in zip(p[4:], results[4:], strict=True):
        np.testing.assert_array_equal(masses, trie.weight_max(np.log(row)))


async def test_a_failed_batch_fails_every_waiting_call_and_later_calls_still_work(
    recording: Any,
) -> None:
    async_trie, trie = recording
    trie.failures = 1
    p = weights_for(len(WORDS), 3, seed=1)
    outcomes = await asyncio.gather(
        *(async_trie.mass_sum(row) for row in p), return_exceptions=True
    )
    assert all(isinstance(o, RuntimeError) and str(o) == "injected failure" for o in outcomes)
    np.testing.assert_array_equal(await async_trie.mass_sum(p[0]), trie.weight_sum(p[0]))


async def test_a_vector_of_the_wrong_length_fails_only_its_own_call(recording: Any) -> None:
    async_trie, trie = recording
    good = weights_for(len(WORDS), 1, seed=2)[0]
    outcomes = await asyncio.gather(
        async_trie.mass_sum(np.ones(len(WORDS) + 1)),
        async_trie.mass_sum(good),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], VocabularyMismatch)
    np.testing.assert_array_equal(outcomes[1], trie.weight_sum(good))


async def test_a_batch_of_vectors_is_answered_as_a_batch(recording: Any) -> None:
    async_trie, trie = recording
    p = weights_for(len(WORDS), 3, seed=3)
    masses = await async_trie.mass_sum(p)
    np.testing.assert_array_equal(masses, trie.batch_weight_sum(p))


async def test_a_caller_that_cancels_does_not_disturb_the_others(recording: Any) -> None:
    async_trie, trie = recording
    trie.release.clear()
    p = weights_for(len(WORDS), 3, seed=4)
    first = asyncio.create_task(async_trie.mass_sum(p[0]))
    await asyncio.to_thread(trie.entered.wait, 5)  # the first batch is computing, blocked
    cancelled = asyncio.create_task(async_trie.mass_sum(p[1]))
    kept = asyncio.create_task(async_trie.mass_sum(p[2]))
    await asyncio.sleep(0)
    cancelled.cancel()
    trie.release.set()
    np.testing.assert_array_equal(await first, trie.weight_sum(p[0]))
    np.testing.assert_array_equal(await kept, trie.weight_sum(p[2]))
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert ("sum", 1) in trie.calls and ("sum", 2) not in trie.calls


async def test_shutdown_finishes_queued_calls() -> None:
    trie = RecordingTrie()
    async_trie = AsyncTokenCharacterTrie(trie)
    await async_trie.start()
    p = weights_for(len(WORDS), 2, seed=5)
    calls = [asyncio.create_task(async_trie.mass_sum(row)) for row in p]
    await asyncio.sleep(0)
    await async_trie.shutdown()
    for row, call in zip(p, calls, strict=True):
        np.testing.assert_array_equal(call.result(), trie.weight_sum(row))


async def test_calls_still_pending_at_the_shutdown_deadline_fail_with_cancelled() -> None:
    trie = RecordingTrie()
    trie.release.clear()
    async_trie = AsyncTokenCharacterTrie(trie)
    await async_trie.start()
    p = weights_for(len(WORDS), 2, seed=6)
    computing = asyncio.create_task(async_trie.mass_sum(p[0]))
    await asyncio.to_thread(trie.entered.wait, 5)
    queued = asyncio.create_task(async_trie.mass_max(p[1]))
    await asyncio.sleep(0)
    await async_trie.shutdown(timeout_s=0.1)
    for call in (computing, queued):
        with pytest.raises(Cancelled):
            await call
    trie.exited.clear()
    trie.release.set()
    await asyncio.to_thread(trie.exited.wait, 5)  # the abandoned computation ends in this loop


async def test_calls_outside_the_lifespan_are_refused() -> None:
    async_trie = AsyncTokenCharacterTrie.from_vocab(WORDS, backend="sequential")
    assert isinstance(async_trie.trie, TokenCharacterTrie)
    with pytest.raises(RuntimeError):
        await async_trie.mass_sum(np.ones(len(WORDS)))
    async with async_trie:
        assert async_trie.running
        masses = await async_trie.mass_max(np.zeros(len(WORDS)))
        assert masses.shape == (async_trie.trie.num_nodes,)
    assert not async_trie.running
    with pytest.raises(RuntimeError):
        await async_trie.mass_sum(np.ones(len(WORDS)))


async def test_the_trie_can_start_again_after_shutdown() -> None:
    async_trie = AsyncTokenCharacterTrie.from_vocab(WORDS, device="cpu")
    for _ in range(2):
        async with async_trie:
            assert (await async_trie.mass_sum(np.ones(len(WORDS))))[0] == len(WORDS)


def test_bad_arguments_are_refused_and_nothing_runs_at_garbage_collection() -> None:
    with pytest.raises(ValueError):
        AsyncTokenCharacterTrie.from_vocab(WORDS, backend="quantum")
    with pytest.raises(ValueError):
        AsyncTokenCharacterTrie(TokenCharacterTrie(WORDS), max_batch_rows=0)
    assert "__del__" not in vars(AsyncTokenCharacterTrie)
