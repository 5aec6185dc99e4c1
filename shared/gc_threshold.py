"""`raise_young_threshold`: a client's process collects its young objects less often.

Python's cycle collector runs a young-generation pass every 700 container allocations (the
interpreter's default), and promotes what survives, so older passes follow. A client with
hundreds of calls in flight allocates several containers a call (the request, its future and
deadline, the caller's task frames) and keeps them alive until the reply: its passes each
walked hundreds of live objects, and a full pass (every 10 of the middle ones) walked the whole
heap of torch's imports, ~90 ms each. Measured in the transport benchmark's client (one process,
512 calls in flight, float16 replies; `gc.callbacks` timing each pass): 2.8 s of collections in
the run, 8% of the client's CPU in `perf`; with a young threshold of 10,000, 0.19 s. Memory
freed by reference counting is freed as before; cyclic garbage waits longer, and garbage that
outlived a young pass waits for the older passes, which now come ~14x less often.

Process-wide, like glibc's thresholds (`shared.heap_reuse`): a client raises it when it
connects, unless told not to (``ClientSettings.gc_young_threshold = 0``,
``LMQ_GC_YOUNG_THRESHOLD=0``). It only raises: a larger threshold the program chose, or
automatic collection switched off (0), is kept. A process that connects a client per job and
drops it after (the experiment scheduler) leaves it alone: there, dropped clients caught in
reference cycles waited for the rarer full passes, and its memory rose by ~60 MiB in the
5-minute soak (`lmq bench soak`).
"""

from __future__ import annotations

import gc
import logging

__all__ = ["raise_young_threshold"]

logger = logging.getLogger(__name__)


def raise_young_threshold(threshold: int) -> bool:
    """Raise the collector's young-generation threshold to `threshold` if it is lower (and
    not 0: automatic collection off); the older generations' thresholds are kept. Returns
    whether it changed anything."""
    young, *older = gc.get_threshold()
    if threshold <= 0 or young == 0 or young >= threshold:
        return False
    gc.set_threshold(threshold, *older)
    logger.debug("young-generation collection threshold raised from %d to %d", young, threshold)
    return True
