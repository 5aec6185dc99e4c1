"""`ExperimentContext`: what a kind gets besides the model: its checkpoint and its progress.

`checkpoint` appends result rows and records the kind's resume state in one Lua script on the
experiment's two keys (same hash slot: ``{tenant:id}``), and only while this run still owns the
experiment (its run token), so a run that lost its lease to a retry cannot add rows: after a
crash the retry resumes from the last checkpoint with no row missing or written twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lmqueue.shared.keys import KeySpace

from .outage import retrying

__all__ = ["ExperimentContext", "LostOwnership"]

_CHECKPOINT = """
if redis.call('HGET', KEYS[1], 'run_token') ~= ARGV[1] then return 0 end
if #ARGV > 7 then
  local have, before = redis.call('LLEN', KEYS[2]), tonumber(ARGV[7])
  if have == before then
    for i = 8, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
  elseif have ~= before + #ARGV - 7 then
    return -1
  end
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'state', ARGV[2]) end
redis.call('HSET', KEYS[1], 'done', ARGV[3], 'total', ARGV[4], 'rate', ARGV[5],
           'updated_ms', ARGV[6])
return 1
"""


class LostOwnership(RuntimeError):
    """Raised when another run took the experiment over (this one's lease had run out)."""


class ExperimentContext:
    """A running experiment as its kind sees it.

    Attributes:
        tenant, id, model: whose experiment, which, on which model.
        state: the resume state of the last checkpoint ({} on a first run).
        rows_written: result rows already in Redis (from earlier runs too).
    """

    def __init__(
        self,
        redis: Any,
        keys: KeySpace,
        experiment_id: str,
        model: str,
        run_token: str,
        state: Mapping[str, Any],
        rows_written: int,
        done: int = 0,
        total: int = 0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.tenant = keys.tenant
        self.id = experiment_id
        self.model = model
        self.run_token = run_token
        self.state = dict(state)
        self.rows_written = rows_written
        self.done = done
        self.total = total
        self._start = (time.monotonic(), done)
        self._script = redis.register_script(_CHECKPOINT)

    @property
    def rate(self) -> float:
        """Progress units per second since this run started."""
        elapsed = time.monotonic() - self._start[0]
        return (self.done - self._start[1]) / elapsed if elapsed > 0 else 0.0

    def report(self, done: int, total: int | None = None) -> None:
        """Note progress; the scheduler writes it to the record within half a second."""
        self.done = done
        if total is not None:
            self.total = total

    async def checkpoint(
        self,
        rows: Sequence[Mapping[str, Any]],
        state: Mapping[str, Any] | None = None,
        done: int | None = None,
        total: int | None = None,
    ) -> None:
        """Append `rows` and record `state` (what a retry resumes from) atomically.

        Raises:
            LostOwnership: if another run owns the experiment now (nothing was written).
        """
        self.report(self.done if done is None else done, total)
        encoded_state = json.dumps(dict(state), separators=(",", ":")) if state is not None else ""
        args: list[Any] = [
            self.run_token, encoded_state, self.done, self.total, f"{self.rate:.6g}",
            int(time.time() * 1000), self.rows_written,
            *(json.dumps(dict(row), separators=(",", ":")) for row in rows),
        ]  # fmt: skip
        keys = [self.keys.experiment_record(self.id), self.keys.experiment_results(self.id)]
        # retried while Redis is away; applied once (see scheduler.outage)
        done = await retrying(lambda: self._script(keys=keys, args=args), f"checkpoint {self.id}")
        if done == 0:
            raise LostOwnership(f"experiment {self.id!r} is owned by another run")
        if done == -1:
            raise LostOwnership(
                f"experiment {self.id!r}: its results are not where this run left them"
            )
        if state is not None:
            self.state = dict(state)
        self.rows_written += len(rows)

    async def flush_progress(self) -> None:
        """Write the noted progress (no rows, state unchanged)."""
        await self.checkpoint([], None)
