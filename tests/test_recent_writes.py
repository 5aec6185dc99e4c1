"""RecentWrites: the shared-cache keys a worker wrote lately, oldest forgotten first."""

from __future__ import annotations

import pytest

from lmqueue.workers.recent_writes import RecentWrites


def test_the_oldest_keys_are_forgotten_past_the_capacity():
    recent = RecentWrites(capacity=3)
    recent.add(["a", "b", "c"])
    recent.add(["d"])
    assert "a" not in recent and all(k in recent for k in "bcd") and len(recent) == 3
    recent.add(["e", "f", "g", "h"])  # more than fit at once: the newest stay
    assert [k for k in "abcdefgh" if k in recent] == ["f", "g", "h"]


def test_a_key_written_again_is_the_newest_again():
    recent = RecentWrites(capacity=3)
    recent.add(["a", "b", "c"])
    recent.add(["a"])
    recent.add(["d"])
    assert "b" not in recent and all(k in recent for k in "acd")


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_capacity_below_one_is_refused(capacity):
    with pytest.raises(ValueError, match="positive"):
        RecentWrites(capacity)
