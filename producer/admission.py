"""`Admission`: atomic enqueue that refuses new work past the model's backlog bound.

A Lua script checks the stream's length and adds the whole micro-batch in one step, so two
clients cannot both squeeze past the bound. Acknowledged entries are deleted from the stream,
so its length is exactly the backlog: delivered-but-unfinished plus not yet delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.errors import Busy

__all__ = ["Admission"]

_ENQUEUE = """
local bound = tonumber(ARGV[1])
local backlog = redis.call('XLEN', KEYS[1])
if bound > 0 and backlog + #ARGV - 1 > bound then
  return {0, backlog}
end
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'm', ARGV[i])
end
return {1, backlog + #ARGV - 1}
"""


class Admission:
    """Enqueues envelopes on one request stream unless its backlog would pass `max_backlog`."""

    def __init__(self, redis: Any, stream: str, max_backlog: int) -> None:
        self.stream = stream
        self.max_backlog = max_backlog
        self._script = redis.register_script(_ENQUEUE)

    async def enqueue(self, envelopes: Sequence[bytes]) -> int:
        """Add all `envelopes` or none; returns the backlog after adding.

        Raises:
            Busy: if the backlog plus this batch would exceed the bound.
        """
        args = [self.max_backlog, *envelopes]
        admitted, backlog = await self._script(keys=[self.stream], args=args)
        if not admitted:
            raise Busy(
                f"backlog of {backlog} requests is at the bound of {self.max_backlog}; retry later",
                backlog=int(backlog),
                bound=self.max_backlog,
            )
        return int(backlog)
