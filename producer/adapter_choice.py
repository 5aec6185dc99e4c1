"""`AdapterChoice`: which LoRA adapter a client's call asks for, checked against the registry.

A client may be bound to one adapter (``QueueLM.connect(..., adapter=NAME)``); a call's
``lora_name=`` overrides it for that call. Names are checked here against the model's adapter
records (the worker checks again: a client is not trusted), so a typo fails at once with the
list of adapters served. Adapters are added while clients run (``lmq adapter add``), so a name
not known yet makes the client read the records again, at most once a second.
"""

from __future__ import annotations

import time
from typing import Any

from lmqueue.shared.adapters import AdapterRecord, AdapterRegistry, check_adapter
from lmqueue.shared.errors import UnknownAdapter
from lmqueue.shared.keys import KeySpace

__all__ = ["AdapterChoice"]

#: Least time between two re-reads of the records prompted by an unknown name.
_REREAD_S = 1.0


class AdapterChoice:
    """The adapter records of one model as one tenant's client sees them, and its binding."""

    def __init__(self, redis: Any, keys: KeySpace, model: str, bound: str | None = None) -> None:
        self.registry = AdapterRegistry(redis, keys, model)
        self.tenant = keys.tenant
        self.bound = bound
        self.records: dict[str, AdapterRecord] = {}
        self._read_at = 0.0

    async def refresh(self) -> dict[str, AdapterRecord]:
        """Read the records again; the new mapping (also kept in `records`)."""
        self.records = await self.registry.records()
        self._read_at = time.monotonic()
        return self.records

    async def resolve(self, lora_name: str | None) -> str | None:
        """The adapter a call asks for: `lora_name`, else the bound one (None: the base).

        Raises:
            UnknownAdapter: no such adapter is served (after reading the records again).
            Forbidden: it is private to another tenant.
        """
        name = lora_name if lora_name is not None else self.bound
        if name is None:
            return None
        try:
            check_adapter(self.records, name, self.tenant)
        except UnknownAdapter:
            if time.monotonic() - self._read_at < _REREAD_S:
                raise
            await self.refresh()
            check_adapter(self.records, name, self.tenant)
        return name
