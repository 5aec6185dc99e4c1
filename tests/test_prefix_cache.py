"""`PrefixCache` on synthetic KV: segments along a path must rebuild exactly the prompt's past."""

from __future__ import annotations

import random

import pytest
import torch

from lmqueue.workers.backends.prefix_cache import PrefixCache


def fake_kv(tokens: list[int], start: int) -> torch.Tensor:
    """KV of positions ``[start, len)`` whose value at position i encodes ``tokens[: i + 1]``.

    Real KV depends on the whole prefix up to its position; so does this, exactly (float64
    holds the integers without rounding), so a past stitched from the wrong segments shows.
    """
    values, code = [], 0
    for i, token in enumerate(tokens):
        code = (code * 1_000_003 + token + 1) % 1_000_000_007
        if i >= start:
            values.append(float(code))
    return torch.tensor(values, dtype=torch.float64).view(1, 1, 1, -1, 1).expand(2, 2, 1, -1, 1)


def stitched(segments: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(segments, dim=3) if segments else torch.zeros(2, 2, 1, 0, 1)


def result(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([float(len(tokens)), float(sum(tokens))])


def test_a_stored_prompt_gives_back_its_result_and_past() -> None:
    cache = PrefixCache(max_kv_tokens=100, cache_size=10)
    cache.insert([1, 2, 3], result([1, 2, 3]), 0, fake_kv([1, 2, 3], 0))

    assert torch.equal(cache.get([1, 2, 3]), result([1, 2, 3]))
    assert cache.get([1, 2]) is None and cache.get([1, 2, 3, 4]) is None
    segments, covered = cache.kv_prefix([1, 2, 3, 4], limit=3)
    assert covered == 3 and torch.equal(stitched(segments), fake_kv([1, 2, 3], 0))
    cache._check_invariants()


def test_a_prompt_diverging_mid_edge_reuses_the_shared_part_and_splits_it() -> None:
    cache = PrefixCache(max_kv_tokens=100, cache_size=10)
    cache.insert([1, 2, 3, 4], result([1, 2, 3, 4]), 0, fake_kv([1, 2, 3, 4], 0))

    segments, covered = cache.kv_prefix([1, 2, 9, 9], limit=3)
    assert covered == 2 and torch.equal(stitched(segments), fake_kv([1, 2], 0))
    cache.insert([1, 2, 9, 9], result([1, 2, 9, 9]), 2, fake_kv([1, 2, 9, 9], 2))

    assert cache.kv_tokens == 6  # 1 2 | 3 4 | 9 9: each position stored once
    for prompt in ([1, 2, 3, 4], [1, 2, 9, 9]):
        segments, covered = cache.kv_prefix(prompt, limit=4)
        assert covered == 4 and torch.equal(stitched(segments), fake_kv(prompt, 0))
    cache._check_invariants()


def test_a_prompt_ending_inside_an_edge_gets_a_node_of_its_own() -> None:
    cache = PrefixCache(max_kv_tokens=100, cache_size=10)
    cache.insert([5, 6, 7], result([5, 6, 7]), 0, fake_kv([5, 6, 7], 0))
    cache.insert([5, 6], result([5, 6]), 1, fake_kv([5, 6], 1))

    assert torch.equal(cache.get([5, 6]), result([5, 6]))
    assert cache.kv_tokens == 3
    cache._check_invariants()


def test_kv_eviction_takes_the_least_recent_leaf_and_never_an_ancestor_first() -> None:
    cache = PrefixCache(max_kv_tokens=6, cache_size=10)
    cache.insert([1, 1, 1], None, 0, fake_kv([1, 1, 1], 0))
    cache.insert([1, 1, 1, 2], None, 3, fake_kv([1, 1, 1, 2], 3))
    cache.insert([1, 1, 1, 3], None, 3, fake_kv([1, 1, 1, 3], 3))
    cache.insert([1, 1, 1, 3, 4], None, 4, fake_kv([1, 1, 1, 3, 4], 4))
    assert cache.kv_tokens == 6

    cache.insert([1, 1, 1, 5], None, 3, fake_kv([1, 1, 1, 5], 3))  # one over: [.., 2] goes

    assert cache.kv_prefix([1, 1, 1, 2], limit=4)[1] == 3
    assert cache.kv_prefix([1, 1, 1, 3, 4], limit=5)[1] == 5
    cache._check_invariants()


def test_results_are_evicted_least_recently_used() -> None:
    cache = PrefixCache(max_kv_tokens=0, cache_size=2)
    cache.insert([1], result([1]))
    cache.insert([2], result([2]))
    cache.get([1])
    cache.insert([3], result([3]))

    assert cache.get([2]) is None and cache.get([1]) is not None and cache.get([3]) is not None
    assert cache.num_nodes() == 2
    cache._check_invariants()


def test_clear_kv_keeps_results_and_clear_drops_everything() -> None:
    cache = PrefixCache(max_kv_tokens=100, cache_size=10)
    cache.insert([1, 2], result([1, 2]), 0, fake_kv([1, 2], 0))
    cache.insert([1, 3], result([1, 3]), 1, fake_kv([1, 3], 1))

    cache.clear_kv()
    assert cache.kv_tokens == 0 and cache.get([1, 3]) is not None
    cache._check_invariants()
    cache.clear()
    assert cache.num_results == 0 and cache.num_nodes() == 0


def test_kv_is_not_stored_below_a_past_evicted_meanwhile() -> None:
    cache = PrefixCache(max_kv_tokens=100, cache_size=10)
    cache.insert([1, 2], None, 0, fake_kv([1, 2], 0))
    _, covered = cache.kv_prefix([1, 2, 3], limit=2)
    cache.clear_kv()  # the past used by the forward is gone when its result arrives

    cache.insert([1, 2, 3], result([1, 2, 3]), covered, fake_kv([1, 2, 3], covered))

    assert cache.kv_tokens == 0 and cache.get([1, 2, 3]) is not None
    cache._check_invariants()


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bounds"):
        PrefixCache(max_kv_tokens=-1, cache_size=1)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_random_workload_keeps_bounds_and_exact_pasts(seed: int) -> None:
    """Particles extend, share and diverge; every past handed out matches the prompt exactly."""
    rng = random.Random(seed)
    cache = PrefixCache(max_kv_tokens=40, cache_size=12)
    particles = [[rng.randrange(4) for _ in range(5)] for _ in range(6)]
    for _step in range(60):
        i = rng.randrange(len(particles))
        prompt = particles[i] + [rng.randrange(4)]
        if rng.random() < 0.2:
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
        segments, covered = cache.kv_prefix(prompt, limit=len(prompt) - 1)
        assert torch.equal(stitched(segments), fake_kv(prompt[:covered], 0))
        cache.insert(prompt, result(prompt), covered, fake_kv(prompt, covered))
        particles[i] = prompt if len(prompt) < 20 else prompt[:5]
        cache._check_invariants()
        assert cache.kv_tokens <= 40 and cache.num_results <= 12
        assert cache.num_nodes() <= 2 * (cache.num_results + cache.kv_tokens) + 1
