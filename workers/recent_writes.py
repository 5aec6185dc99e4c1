"""`RecentWrites`: the shared-cache keys a worker wrote lately, to skip lookups that must miss.

A client looks every log-probabilities request up in the shared cache just before sending it,
and says so when it missed (the request's ``looked``). Looking it up again on the worker
finds a result only if someone wrote it in between: another client's identical request,
computed while this one waited. Prompt partitions send identical prompts to one worker
(`shared.partitions`), so that someone is nearly always this worker, and it knows what it
wrote: a looked-up request is looked up again only if its key is among this worker's recent
writes. The others skip a round trip per batch on the worker's event loop, which was
duplicating the client's lookup for every request (~3% of the loop on one instance, ~6% on a
cluster: docs/benchmarks-history.md). What is given up: a result another worker wrote in that
window is computed again here, as it would have been had the two requests met in neither.

The keys are remembered in the order written, the oldest forgotten past `capacity`: a window
of that many results, longer than any request waits under ``max_backlog``'s default. A key
remembered after its entry left the cache is looked up and misses, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["DEFAULT_CAPACITY", "RecentWrites"]

#: Keys remembered (a few MB of strings).
DEFAULT_CAPACITY = 65_536


class RecentWrites:
    """The last `capacity` shared-cache keys this worker wrote.

    An `OrderedDict`, whose oldest key is dropped in constant time: a plain dict kept in
    order by deleting from its front made each drop skip the slots freed before it (until the
    dict is resized): 1.1-1.3 against 0.4-0.7 us a key when full (batches of 32 keys).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[str]) -> None:
        """Remember `keys` as written now (a key written again moves to the newest end)."""
        remembered = self._keys
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > self.capacity:
            remembered.popitem(last=False)
