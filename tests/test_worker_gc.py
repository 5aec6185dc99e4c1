"""A serving worker keeps its start-up heap out of the garbage collector's full passes.

A full collection traverses every tracked object; with torch and a model loaded one held
the worker's loop for 150-365 ms, a light tenant's whole p99 tail under a flood (issue 23).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from lmqueue.workers.backends.mock import MockAsyncLM
from workers_in_threads import ThreadedWorker


def test_a_serving_worker_has_frozen_what_was_alive_when_it_started(
    redis_url: str, smol_tokenizer: Any
) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    backend = MockAsyncLM(smol_tokenizer)
    gc.collect()  # what is alive, not the cyclic garbage this process's collector has not reached
    alive_before = len(gc.get_objects())
    worker = ThreadedWorker(backend, redis_url).start()
    try:
        deadline = time.monotonic() + 10
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        frozen = gc.get_freeze_count()
        full_pass_sees = len(gc.get_objects(generation=2))
    finally:
        worker.stop()
        gc.unfreeze()
    assert frozen >= alive_before // 2  # the test process's heap, tokenizer and torch among it
    assert full_pass_sees < frozen // 10  # a full pass no longer walks them
