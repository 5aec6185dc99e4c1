"""`OutputCache`: an in-process LRU of result tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

__all__ = ["OutputCache"]


class OutputCache:
    """A bounded least-recently-used map from a hashable key to a tensor.

    With ``move_to_cpu=True`` values are stored on the CPU and moved back to the device they
    came from on lookup, which keeps GPU memory free for the model at the cost of a copy.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False) -> None:
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self._entries: OrderedDict[Hashable, tuple[Any, Any]] = OrderedDict()

    def __getitem__(self, key: Hashable) -> Any:
        device, value = self._entries[key]
        self._entries.move_to_end(key)
        if self.move_to_cpu and device is not None:
            return value.to(device)
        return value

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value under `key` (refreshing its recency), or `default`."""
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: Hashable, value: Any) -> None:
        if self.maxsize == 0:
            return
        device = getattr(value, "device", None)
        if self.move_to_cpu and device is not None:
            value = value.to("cpu")
        self._entries[key] = (device, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
