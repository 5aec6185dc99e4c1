"""gc_threshold: a client raises the collector's young-generation threshold, never lowers it."""

from __future__ import annotations

import gc

import pytest

from lmqueue.shared.errors import SettingsError
from lmqueue.shared.gc_threshold import raise_young_threshold
from lmqueue.shared.settings import ClientSettings


def test_a_lower_young_threshold_is_raised_and_the_older_ones_kept(
    interpreter_gc_thresholds: None,
) -> None:
    gc.set_threshold(700, 7, 3)
    assert raise_young_threshold(10_000) is True
    assert gc.get_threshold() == (10_000, 7, 3)
    assert raise_young_threshold(10_000) is False  # already there
    assert gc.get_threshold() == (10_000, 7, 3)


@pytest.mark.parametrize("chosen", [50_000, 0], ids=["a larger one", "collection switched off"])
def test_what_the_program_chose_is_kept(interpreter_gc_thresholds: None, chosen: int) -> None:
    gc.set_threshold(chosen, 10, 10)
    assert raise_young_threshold(10_000) is False
    assert gc.get_threshold() == (chosen, 10, 10)


def test_zero_leaves_the_collector_alone(interpreter_gc_thresholds: None) -> None:
    assert raise_young_threshold(0) is False
    assert gc.get_threshold() == (700, 10, 10)


def test_the_client_setting_is_read_from_the_environment_and_checked() -> None:
    assert ClientSettings().gc_young_threshold == 10_000
    assert ClientSettings.from_env({"LMQ_GC_YOUNG_THRESHOLD": "0"}).gc_young_threshold == 0
    with pytest.raises(SettingsError, match="gc_young_threshold=-1"):
        ClientSettings.from_env({"LMQ_GC_YOUNG_THRESHOLD": "-1"})
