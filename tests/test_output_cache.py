"""OutputCache: a bounded LRU of tensors."""

from __future__ import annotations

import torch

from lmqueue.shared.lm.output_cache import OutputCache


def test_the_least_recently_used_entry_is_evicted_first():
    cache = OutputCache(maxsize=2)
    cache["a"], cache["b"] = torch.zeros(1), torch.ones(1)
    assert cache["a"].item() == 0  # refreshes a
    cache["c"] = torch.full((1,), 2.0)
    assert "b" not in cache and "a" in cache and "c" in cache and len(cache) == 2


def test_move_to_cpu_stores_on_cpu_and_returns_on_the_original_device():
    cache = OutputCache(maxsize=4, move_to_cpu=True)
    value = torch.arange(3.0)
    cache["k"] = value
    assert cache["k"].device == value.device and torch.equal(cache["k"], value)


def test_size_zero_stores_nothing_and_clear_empties():
    cache = OutputCache(maxsize=0)
    cache["a"] = torch.zeros(1)
    assert len(cache) == 0 and cache.get("a") is None
    other = OutputCache(maxsize=3)
    other["a"] = torch.zeros(1)
    other.clear()
    assert len(other) == 0
