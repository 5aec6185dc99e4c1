"""heap_freeze: what a process holds once set up leaves the collector's full passes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from lmqueue.shared.heap_freeze import freeze_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """A process as if nothing had been frozen; unfrozen again afterwards."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freezing_moves_what_is_alive_out_of_the_full_pass(unfrozen: None) -> None:
    kept = [[n] for n in range(10_000)]
    assert freeze_heap() >= len(kept)
    assert not any(o is kept for o in gc.get_objects(generation=2))
    later = [[n] for n in range(100)]
    gc.collect(1)
    assert any(o is later for o in gc.get_objects(generation=2))  # new objects: collected


def test_garbage_cycles_alive_when_freezing_are_collected_first(unfrozen: None) -> None:
    class Node:
        other: object

    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    freeze_heap()
    assert not any(type(o) is Node for o in gc.get_objects())
