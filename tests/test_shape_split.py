"""`ShapeSplit`: the fit of forward seconds against token slots, and the split it advises."""

from __future__ import annotations

import numpy as np
import pytest

from lmqueue.workers.backends.batch_inputs import Row
from lmqueue.workers.backends.shape_split import MIN_FORWARDS, ShapeSplit, token_slots


def rows_of(widths: list[int]) -> list[Row]:
    return [Row(np.zeros(0, dtype=np.int64), tuple(range(1, w + 1))) for w in widths]


def taught(
    fixed_s: float, per_slot_s: float, sizes: tuple[int, ...] = (16, 256, 64, 128)
) -> ShapeSplit:
    split = ShapeSplit()
    for i in range(2 * MIN_FORWARDS):
        slots = sizes[i % len(sizes)]
        split.observe(slots, fixed_s + per_slot_s * slots)
    return split


# A sampler's 16 decode rows beside a flood's 16 eight-token prompts, interleaved as picked.
MIXED = [1, 8] * 16


def test_token_slots_are_rows_times_the_widest_run_of_new_tokens() -> None:
    assert token_slots(rows_of([1, 8, 3])) == 24
    assert token_slots([]) == 0


def test_the_fit_recovers_a_forwards_fixed_cost_and_cost_per_slot() -> None:
    fixed_s, per_slot_s = taught(0.012, 0.0025).costs() or (0.0, 0.0)
    assert fixed_s == pytest.approx(0.012, rel=1e-6)
    assert per_slot_s == pytest.approx(0.0025, rel=1e-6)


def test_where_time_follows_slots_decode_rows_run_on_their_own_after_the_prompts() -> None:
    groups = taught(0.012, 0.0025).groups(rows_of(MIXED))
    assert groups == [list(range(1, 32, 2)), list(range(0, 32, 2))]


def test_where_a_forwards_fixed_cost_dominates_the_batch_stays_whole() -> None:
    assert taught(0.020, 0.00001).groups(rows_of(MIXED)) == [list(range(32))]


def test_a_split_saving_little_is_not_made() -> None:
    # one decode row among 31 prompts: two forwards would save 7 of 256 slots
    assert taught(0.012, 0.0025).groups(rows_of([1] + [8] * 31)) == [list(range(32))]


def test_rows_of_one_width_stay_whole() -> None:
    assert taught(0.0, 0.0025).groups(rows_of([8] * 32)) == [list(range(32))]
    assert taught(0.0, 0.0025).groups(rows_of([5])) == [[0]]


def test_nothing_is_split_before_the_fit_is_trusted() -> None:
    few = ShapeSplit()
    for slots in (16, 256, 16):
        few.observe(slots, 0.0025 * slots)
    assert few.costs() is None
    assert few.groups(rows_of(MIXED)) == [list(range(32))]
    same_size = taught(0.0, 0.0025, sizes=(256,))
    assert same_size.costs() is None  # forwards all of one size fit no line
    assert same_size.groups(rows_of(MIXED)) == [list(range(32))]


def test_the_fit_follows_the_device_as_it_changes() -> None:
    split = taught(0.020, 0.00001)
    for i in range(400):  # the newer forwards weigh more: a CPU's costs now
        slots = (16, 256, 64, 128)[i % 4]
        split.observe(slots, 0.012 + 0.0025 * slots)
    assert len(split.groups(rows_of(MIXED))) == 2
