"""`freeze_heap`: the objects a process holds once it is set up leave the garbage collector's
full passes.

Python's full (generation 2) collection traverses every tracked object. A process that has
imported torch and transformers, loaded a model and decoded a vocabulary holds hundreds of
thousands of them; one full pass then takes 100-400 ms, and the loop waits for it. In a
worker under a flood that allocates steadily one ran every minute or so, and it was the whole
of a light tenant's p99 tail (BENCHMARKS.md, fairness; the tail's history there); the
fairness benchmark's client processes freeze for the same reason.

Frozen objects are not traversed, nor collected by the cycle collector: what dies later is
still freed by reference counting, and what the process allocates afterwards is collected in
short passes as before. Garbage cycles alive at the moment of freezing are collected first.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze_heap"]

logger = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect, then freeze everything alive; the number of objects frozen in all."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logger.debug("froze %d objects of the heap", count)
    return count
