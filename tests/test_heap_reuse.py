"""heap_reuse: glibc's thresholds are raised once per process."""

from __future__ import annotations

import ctypes.util

import pytest

from lmqueue.shared.heap_reuse import keep_freed_vectors_mapped


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to tune")
def test_the_thresholds_are_raised_once_and_the_answer_kept() -> None:
    first = keep_freed_vectors_mapped()
    assert first is True  # glibc here: mallopt accepted both
    assert keep_freed_vectors_mapped() is first
