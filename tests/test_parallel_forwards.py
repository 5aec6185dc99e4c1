"""Forwards side by side on a CPU: the hf backend's ``parallel_forwards``, the worker's slot for
them, the gate that keeps adapter changes out of running forwards, and the staging tensor each
forward thread keeps for its pasts."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_backends import backend_factory
from lora_adapters import make_adapter, peft_reference, reference_logprobs

from lmqueue.shared.lm.vocab import decode_vocab
from lmqueue.workers.backends import AsyncTransformer
from lmqueue.workers.backends.batch_inputs import BatchInputs, Row
from lmqueue.workers.backends.kv_pool import KvPool
from lmqueue.workers.backends.model_change_lock import ModelChangeLock
from lmqueue.workers.backends.pool_cache import past_cache
from lmqueue.workers.late_binding import PICK_LEAD, BackendOccupancy

TOLERANCE = 1e-4
#: How long each patched forward sleeps: long enough that overlapping forwards are plain.
STALL_S = 0.3


@pytest.fixture(scope="module")
def vocab(smol_tokenizer: Any) -> dict[str, Any]:
    byte_vocab, str_vocab = decode_vocab(smol_tokenizer)
    return {"byte_vocab": byte_vocab, "str_vocab": str_vocab}


@pytest.fixture
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def spans(model: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float, str]]:
    """``(start, end, thread)`` of every forward of `model`, each stalled `STALL_S`."""
    recorded: list[tuple[float, float, str]] = []
    original = model.forward

    @functools.wraps(original)
    def stalled(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        time.sleep(STALL_S)
        output = original(*args, **kwargs)
        recorded.append((started, time.monotonic(), threading.current_thread().name))
        return output

    monkeypatch.setattr(model, "forward", stalled)
    return recorded


@pytest.fixture
async def make_lm(
    model: Any, smol_tokenizer: Any, vocab: dict[str, Any]
) -> AsyncIterator[Callable[..., AsyncTransformer]]:
    """Build backends over the model; all are closed after the test."""
    async with backend_factory(model, smol_tokenizer, vocab, timeout=0.0) as make:
        yield make


def _overlapping(spans: list[tuple[float, float, str]]) -> int:
    """How many pairs of forwards ran at the same time."""
    return sum(
        1 for i, a in enumerate(spans) for b in spans[i + 1 :] if a[0] < b[1] and b[0] < a[1]
    )


# -- the hf backend --------------------------------------------------------------------------------
@pytest.mark.parametrize("forwards", [1, 2])
async def test_batches_run_side_by_side_only_with_parallel_forwards(
    make_lm: Callable, spans: list, forwards: int
) -> None:
    lm = make_lm(batch_size=2, parallel_forwards=forwards, forward_threads=1)
    prompts = [[1, 2, 3 + i] for i in range(4)]  # two batches of two
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    assert len(spans) == 2
    if forwards == 2:
        assert _overlapping(spans) == 1
        assert len({thread for _, _, thread in spans}) == 2
    else:
        assert _overlapping(spans) == 0
    for prompt, row in zip(prompts, rows, strict=True):
        expected = lm.next_token_logprobs_uncached(prompt)
        assert torch.allclose(row, expected, atol=TOLERANCE, rtol=0)


async def test_side_by_side_forwards_reuse_kv_and_match_the_uncached_forward(
    make_lm: Callable,
) -> None:
    """SMC-like steps: every batch extends pasts that forwards on either thread stored."""
    lm = make_lm(batch_size=3, parallel_forwards=2, forward_threads=1)
    stem = [5, 17, 40, 41, 99, 3]
    prompts = [stem + [i] for i in range(6)]
    for step in range(4):
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        for prompt, row in zip(prompts, rows, strict=True):
            expected = lm.next_token_logprobs_uncached(prompt)
            assert torch.allclose(row, expected, atol=TOLERANCE, rtol=0), (step, prompt)
        prompts = [p + [7 + step] for p in prompts]
    assert lm.stats.reused_tokens > 0 and lm.stats.forwards >= 8


async def test_side_by_side_forwards_of_different_adapters_each_match_peft(
    make_lm: Callable, spans: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The LoRA rows of a forward are its thread's own: two forwards at once, one of each
    adapter (and the base), never mix their rows."""
    adapters = {
        name: make_adapter(tiny_model_dir, tmp_path / name, seed)
        for seed, name in ((1, "a"), (2, "b"))
    }
    reference = peft_reference(tiny_model_dir, adapters)
    lm = make_lm(batch_size=2, parallel_forwards=2, forward_threads=1)
    for name, path in adapters.items():
        await lm.load_adapter(name, str(path))
    asks = [([1, 2, 3], "a"), ([4, 5, 6], "a"), ([1, 2, 3], "b"), ([1, 2, 3], None)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=n) for p, n in asks))
    assert _overlapping(spans) >= 1
    for (prompt, name), row in zip(asks, rows, strict=True):
        expected = reference_logprobs(reference, prompt, name)
        assert torch.allclose(row, expected, atol=TOLERANCE, rtol=0), (prompt, name)


async def test_an_adapter_loads_only_once_the_running_forwards_are_done(
    make_lm: Callable, spans: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    lm = make_lm(batch_size=1, parallel_forwards=2, forward_threads=1)
    path = make_adapter(tiny_model_dir, tmp_path / "late", 3)
    computing = [asyncio.create_task(lm.next_token_logprobs([i, 9])) for i in range(2)]
    await asyncio.sleep(STALL_S / 3)  # both forwards are running
    await lm.load_adapter("late", str(path))
    loaded_at = time.monotonic()
    await asyncio.gather(*computing)
    assert len(spans) == 2 and all(end <= loaded_at for _, end, _ in spans)


def test_parallel_forwards_must_be_positive(model: Any, smol_tokenizer: Any, vocab: dict) -> None:
    with pytest.raises(ValueError, match="parallel_forwards"):
        AsyncTransformer(model, smol_tokenizer, **vocab, parallel_forwards=0)


# -- the gate --------------------------------------------------------------------------------------
def test_a_change_waits_for_running_forwards_and_holds_new_ones_back() -> None:
    gate = ModelChangeLock()
    events: list[str] = []
    forward_running, change_waiting = threading.Event(), threading.Event()

    def first_forward() -> None:
        with gate.forward():
            events.append("forward 1 in")
            forward_running.set()
            change_waiting.wait(5)
            time.sleep(0.1)  # the change is waiting on this forward now
            events.append("forward 1 out")

    def change() -> None:
        forward_running.wait(5)
        change_waiting.set()
        with gate.change():
            events.append("change")
            time.sleep(0.1)

    def second_forward() -> None:
        change_waiting.wait(5)
        time.sleep(0.05)  # after the change asked for the gate
        with gate.forward():
            events.append("forward 2 in")

    threads = [threading.Thread(target=f) for f in (first_forward, change, second_forward)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert events == ["forward 1 in", "forward 1 out", "change", "forward 2 in"]


def test_forwards_pass_the_gate_together() -> None:
    gate = ModelChangeLock()
    inside = threading.Barrier(2, timeout=5)  # each waits inside for the other

    def forward() -> None:
        with gate.forward():
            inside.wait()

    threads = [threading.Thread(target=forward) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert not inside.broken


# -- the worker's slot -----------------------------------------------------------------------------
def test_a_slot_for_two_forwards_picks_at_once_until_both_are_held() -> None:
    now = [0.0]
    slot = BackendOccupancy(clock=lambda: now[0], forwards=2)
    first = slot.hold()
    assert slot.pick_in_s() == 0.0  # the second forward is free
    now[0] = 0.5
    second = slot.hold()
    assert slot.pick_in_s() == 0.0  # nothing measured yet: one batch ahead
    third = slot.hold()
    assert slot.pick_in_s() is None  # one waits for a place already
    now[0] = 1.0
    first()  # took 1.0; the waiting batch gets its place now
    assert slot.forward_s == 1.0
    assert slot.pick_in_s() == pytest.approx(0.5 + (1 - PICK_LEAD) - 1.0)  # second's end, nearly
    second()
    assert slot.pick_in_s() == 0.0
    third()
    assert not slot.busy


def test_a_batch_released_before_it_had_a_place_took_no_forward_time() -> None:
    now = [0.0]
    slot = BackendOccupancy(clock=lambda: now[0])
    running, waiting = slot.hold(), slot.hold()
    now[0] = 0.2
    waiting()  # all cache hits: done without the backend
    assert slot.forward_s == 0.0
    now[0] = 1.0
    running()
    assert slot.forward_s == 1.0


def test_a_slot_needs_a_forward() -> None:
    with pytest.raises(ValueError):
        BackendOccupancy(forwards=0)


# -- the staging tensor ----------------------------------------------------------------------------
LAYOUT = (3, 2, 4)  # layers, kv heads, head dim


def _pool_rows(rows: int, shared: int, own: list[int], seed: int = 0) -> tuple[KvPool, list[Row]]:
    """A pool of random KV, and rows whose pasts start with slots they share and go on with
    slots of their own (as trie paths do)."""
    pool = KvPool(256, LAYOUT, torch.float32, "cpu")
    pool.kv[2:] = torch.randn(pool.kv[2:].shape, generator=torch.Generator().manual_seed(seed))
    stem = pool.allocate(shared)
    out = []
    for b in range(rows):
        tail = [pool.allocate(n) for n in own[: b % (len(own) + 1)]]
        out.append(Row(np.concatenate([stem, *tail]), (1,)))
    return pool, out


def _staged(pool: KvPool, rows: list[Row]) -> Any:
    width = max(r.past_len for r in rows)
    return past_cache(pool, BatchInputs.of(rows, width, 2, "cpu"), len(rows))


def test_the_past_cache_holds_each_rows_gathered_slots_then_zeros() -> None:
    pool, rows = _pool_rows(5, shared=4, own=[1, 2, 1])
    cache = _staged(pool, rows)
    for layer_index, layer in enumerate(cache.layers):
        for b, row in enumerate(rows):
            whole = pool.kv[torch.from_numpy(row.past), layer_index]  # (past_len, 2, heads, dim)
            assert torch.equal(layer.keys[b, :, : row.past_len], whole[:, 0].transpose(0, 1))
            assert torch.equal(layer.values[b, :, : row.past_len], whole[:, 1].transpose(0, 1))
            assert not layer.keys[b, :, row.past_len :].any()
            assert not layer.values[b, :, row.past_len :].any()


def test_a_forward_thread_reuses_its_staging_tensor_until_it_is_too_small() -> None:
    def staged(made: tuple[KvPool, list[Row]]) -> int:
        return int(_staged(*made).staging.untyped_storage().data_ptr())

    def on_a_new_thread(work: Callable[[], list[int]]) -> list[int]:
        result: list[list[int]] = []
        thread = threading.Thread(target=lambda: result.append(work()))
        thread.start()
        thread.join(30)
        return result[0]

    small, smaller = _pool_rows(4, 6, [1]), _pool_rows(2, 6, [1])
    large = _pool_rows(8, 30, [2, 2])
    first, again, fewer, grown = on_a_new_thread(
        lambda: [staged(small), staged(small), staged(smaller), staged(large)]
    )
    assert first == again == fewer  # the same storage while it fits
    assert grown != first  # replaced when too small


def test_each_forward_thread_has_a_staging_tensor_of_its_own() -> None:
    pool, rows = _pool_rows(4, 6, [1])
    pointers: list[int] = []
    both_hold = threading.Barrier(2, timeout=10)

    def forward_thread() -> None:
        cache = _staged(pool, rows)
        pointers.append(int(cache.staging.untyped_storage().data_ptr()))
        both_hold.wait()  # both threads alive, each holding its tensor

    threads = [threading.Thread(target=forward_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(pointers) == 2 and pointers[0] != pointers[1]
