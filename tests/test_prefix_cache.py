"""`PrefixCache` over a real `KvPool` with synthetic KV: the slots of a path must gather exactly
the prompt's past, and the pool's slots must never be held twice or lost."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmqueue.workers.backends.kv_pool import KvPool
from lmqueue.workers.backends.prefix_cache import PrefixCache

LAYOUT = (2, 1, 1)  # layers, kv heads, head dim: each slot holds 4 numbers


def cache_of(max_kv_tokens: int, cache_size: int) -> PrefixCache:
    pool = KvPool(max_kv_tokens, LAYOUT, torch.float64, "cpu") if max_kv_tokens else None
    return PrefixCache(cache_size, pool)


def codes(tokens: list[int]) -> list[float]:
    """Per position, a number encoding ``tokens[: i + 1]``: real KV depends on the whole prefix
    up to its position; so does this, exactly (float64 holds the integers without rounding)."""
    values, code = [], 0
    for token in tokens:
        code = (code * 1_000_003 + token + 1) % 1_000_000_007
        values.append(float(code))
    return values


def computed(cache: PrefixCache, tokens: list[int], start: int) -> np.ndarray | None:
    """What a forward does: reserve slots for positions ``[start, len)`` and write their KV."""
    slots = cache.reserve(len(tokens) - start)
    if slots is not None:
        assert cache.pool is not None
        values = torch.tensor(codes(tokens)[start:], dtype=torch.float64)
        cache.pool.kv[torch.from_numpy(slots)] = values.view(-1, 1, 1, 1, 1)
    return slots


def store(cache: PrefixCache, tokens: list[int], logprobs: torch.Tensor | None, start: int) -> None:
    cache.insert(tokens, logprobs, start, computed(cache, tokens, start))


def gathered(cache: PrefixCache, slots: np.ndarray) -> list[float]:
    assert cache.pool is not None
    kv = cache.pool.kv[torch.from_numpy(slots)]
    assert (kv == kv[:, :1, :1]).all()  # every layer, key and value alike
    return kv[:, 0, 0, 0, 0].tolist()


def result(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([float(len(tokens)), float(sum(tokens))])


def test_a_stored_prompt_gives_back_its_result_and_past() -> None:
    cache = cache_of(100, 10)
    store(cache, [1, 2, 3], result([1, 2, 3]), 0)

    assert torch.equal(cache.get([1, 2, 3]), result([1, 2, 3]))
    assert cache.get([1, 2]) is None and cache.get([1, 2, 3, 4]) is None
    slots, covered = cache.kv_prefix([1, 2, 3, 4], limit=3)
    assert covered == 3 and gathered(cache, slots) == codes([1, 2, 3])
    cache._check_invariants()


def test_a_prompt_diverging_mid_edge_reuses_the_shared_part_and_splits_it() -> None:
    cache = cache_of(100, 10)
    store(cache, [1, 2, 3, 4], result([1, 2, 3, 4]), 0)

    slots, covered = cache.kv_prefix([1, 2, 9, 9], limit=3)
    assert covered == 2 and gathered(cache, slots) == codes([1, 2])
    store(cache, [1, 2, 9, 9], result([1, 2, 9, 9]), 2)

    assert cache.kv_tokens == 6  # 1 2 | 3 4 | 9 9: each position stored once
    for prompt in ([1, 2, 3, 4], [1, 2, 9, 9]):
        slots, covered = cache.kv_prefix(prompt, limit=4)
        assert covered == 4 and gathered(cache, slots) == codes(prompt)
    cache._check_invariants()


def test_a_prompt_ending_inside_an_edge_gets_a_node_of_its_own() -> None:
    cache = cache_of(100, 10)
    store(cache, [5, 6, 7], result([5, 6, 7]), 0)
    store(cache, [5, 6], result([5, 6]), 1)  # its KV is stored already: the slot goes back

    assert torch.equal(cache.get([5, 6]), result([5, 6]))
    assert cache.kv_tokens == 3 and cache.pool is not None and cache.pool.free_slots == 97
    cache._check_invariants()


def test_kv_eviction_takes_the_least_recent_leaf_and_never_an_ancestor_first() -> None:
    cache = cache_of(6, 10)
    store(cache, [1, 1, 1], None, 0)
    store(cache, [1, 1, 1, 2], None, 3)
    store(cache, [1, 1, 1, 3], None, 3)
    store(cache, [1, 1, 1, 3, 4], None, 4)
    assert cache.kv_tokens == 6

    store(cache, [1, 1, 1, 5], None, 3)  # one over: [.., 2] goes

    assert cache.kv_prefix([1, 1, 1, 2], limit=4)[1] == 3
    assert cache.kv_prefix([1, 1, 1, 3, 4], limit=5)[1] == 5
    assert cache.kv_prefix([1, 1, 1, 5], limit=4)[1] == 4
    cache._check_invariants()


def test_a_reservation_never_evicts_a_pinned_past() -> None:
    cache = cache_of(4, 10)
    store(cache, [1, 2], None, 0)
    store(cache, [3, 4], None, 0)
    past = cache.past([1, 2, 9], 2)
    cache.past([3, 4, 9], 2)  # [3, 4] is now the most recent, [1, 2] the least

    slots = cache.reserve(2, {past.node})

    assert slots is not None
    assert cache.kv_prefix([1, 2, 9], 2)[1] == 2 and cache.kv_prefix([3, 4, 9], 2)[1] == 0
    cache._check_invariants()


def test_slots_freed_while_a_forward_runs_wait_until_it_ends() -> None:
    cache = cache_of(4, 10)
    store(cache, [1, 2, 3, 4], None, 0)
    pool = cache.pool
    assert pool is not None
    ticket = pool.begin()  # a forward that gathered [1, 2, 3, 4] runs
    cache.clear_kv()

    assert pool.free_slots == 0 and pool.quarantined_slots == 4
    assert cache.reserve(1) is None  # none handed out while the forward may read them
    pool.end(ticket)
    assert pool.free_slots == 4 and pool.quarantined_slots == 0


def test_results_are_evicted_least_recently_used() -> None:
    cache = cache_of(0, 2)
    cache.insert([1], result([1]))
    cache.insert([2], result([2]))
    cache.get([1])
    cache.insert([3], result([3]))

    assert cache.get([2]) is None and cache.get([1]) is not None and cache.get([3]) is not None
    assert cache.num_nodes() == 2
    cache._check_invariants()


def test_results_that_are_rows_of_one_output_count_the_whole_output() -> None:
    cache = cache_of(0, 4)
    batch = torch.zeros(4, 2)  # one forward's output: four rows of two
    for i, row in enumerate(batch.unbind(0)):
        cache.insert([i], row)
    assert cache.num_results == 4 and cache.result_bytes == batch.nbytes
    for i in range(4, 8):  # rows of their own: the batch's buffer is freed only when all go
        cache.insert([i], torch.zeros(2))

    assert cache.result_bytes == 4 * torch.zeros(2).nbytes
    assert all(cache.get([i]) is None for i in range(4))
    cache._check_invariants()


def test_clear_kv_keeps_results_and_clear_drops_everything() -> None:
    cache = cache_of(100, 10)
    store(cache, [1, 2], result([1, 2]), 0)
    store(cache, [1, 3], result([1, 3]), 1)

    cache.clear_kv()
    assert cache.kv_tokens == 0 and cache.get([1, 3]) is not None
    assert cache.pool is not None and cache.pool.free_slots == 100
    cache._check_invariants()
    cache.clear()
    assert cache.num_results == 0 and cache.num_nodes() == 0


def test_kv_is_not_stored_below_a_past_evicted_meanwhile() -> None:
    cache = cache_of(100, 10)
    store(cache, [1, 2], None, 0)
    _, covered = cache.kv_prefix([1, 2, 3], limit=2)
    slots = computed(cache, [1, 2, 3], covered)
    cache.clear_kv()  # the past used by the forward is gone when its result arrives

    cache.insert([1, 2, 3], result([1, 2, 3]), covered, slots)

    assert cache.kv_tokens == 0 and cache.get([1, 2, 3]) is not None
    assert cache.pool is not None and cache.pool.free_slots == 100  # nothing lost
    cache._check_invariants()


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="cache_size"):
        PrefixCache(cache_size=-1)
    with pytest.raises(ValueError, match="capacity"):
        KvPool(0, LAYOUT, torch.float32, "cpu")


@pytest.mark.parametrize("seed", range(4))
def test_a_long_random_workload_keeps_bounds_and_exact_pasts(seed: int) -> None:
    """Particles extend, share and diverge; every past handed out matches the prompt exactly,
    and every slot of the pool is either free or held by exactly one node."""
    rng = random.Random(seed)
    cache = cache_of(40, 12)
    particles = [[rng.randrange(4) for _ in range(5)] for _ in range(6)]
    for _step in range(60):
        i = rng.randrange(len(particles))
        prompt = particles[i] + [rng.randrange(4)]
        if rng.random() < 0.2:
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
        slots, covered = cache.kv_prefix(prompt, limit=len(prompt) - 1)
        assert gathered(cache, slots) == codes(prompt[:covered])
        store(cache, prompt, result(prompt), covered)
        particles[i] = prompt if len(prompt) < 20 else prompt[:5]
        cache._check_invariants()
        assert cache.pool is not None
        assert cache.kv_tokens + cache.pool.free_slots == 40  # no slot lost or held twice
        assert cache.kv_tokens <= 40 and cache.num_results <= 12
        assert cache.num_nodes() <= 2 * (cache.num_results + cache.kv_tokens) + 1


def test_peeks_report_the_stored_length_and_result_without_touching_recency() -> None:
    cache = cache_of(max_kv_tokens=16, cache_size=4)
    store(cache, [1, 2, 3, 4], result([1, 2, 3, 4]), 0)
    store(cache, [5, 6], result([5, 6]), 0)
    assert cache.stored_length((1, 2, 3, 4, 5, 6), 5) == 4
    assert cache.stored_length((1, 2, 9), 2) == 2  # diverges inside the edge
    assert cache.stored_length((1, 2, 3, 4), 3) == 3  # bounded by the limit
    assert cache.stored_length((7, 8), 1) == 0
    assert cache.stored_length((1, 2), 1, adapter="other") == 0
    assert cache.has_result((1, 2, 3, 4)) and not cache.has_result((1, 2, 3))
    assert not cache.has_result((1, 2, 3, 4), adapter="other")
    assert cache.stored_length((1, 2, 3, 4, 5), 4) == cache.past((1, 2, 3, 4, 5), 4).length
    assert cache.has_result((1, 2, 3, 4))  # a peek, not a use: [1..4] stays least recent
    store(cache, [7, 8], result([7, 8]), 0)
    store(cache, [9, 10], result([9, 10]), 0)
    store(cache, [11, 12], result([11, 12]), 0)
    assert cache.get((1, 2, 3, 4)) is None and cache.get((5, 6)) is not None
