"""`Admission`: atomic enqueue within the model's backlog bound and the tenant's quotas.

One Lua script (`shared.admission_script`) checks the stream's length, the tenant's in-flight
quota and its token-rate bucket, and adds the requests that fit in one step, so two clients
cannot both squeeze past a bound. Acknowledged entries are deleted from the stream, so its
length is exactly the backlog: delivered-but-unfinished plus not yet delivered.

The script is called by its SHA (EVALSHA): tenants' ACL users may not load scripts, workers
load it. If Redis does not know it (just restarted, no worker up yet) and this user may not
EVAL, the batch fails with `Unavailable`, which the submitter retries like a lost connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError

from lmqueue.shared.admission_script import ADMISSION_LUA, ADMISSION_SHA
from lmqueue.shared.errors import Busy, QuotaExceeded, Unavailable

__all__ = ["Admission"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Admission:
    """Enqueues envelopes on one request stream within its backlog bound and quotas.

    Args:
        max_backlog: entries past which a whole batch is refused with `Busy` (0: none).
        quota_key: the tenant's quota hash for this model (None: no quotas).
        rate_key: the tenant's token-rate bucket for this model (needed for a rate quota).
    """

    def __init__(
        self,
        redis: Any,
        stream: str,
        max_backlog: int,
        quota_key: str | None = None,
        rate_key: str | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.max_backlog = max_backlog
        self.quota_key = quota_key
        self.rate_key = rate_key

    async def enqueue(self, envelopes: Sequence[bytes], tokens: Sequence[int] | None = None) -> int:
        """Add `envelopes` in order while they fit; returns the backlog after adding.

        Args:
            tokens: each envelope's prompt tokens, charged to the rate quota (default 1 each).

        Raises:
            Busy: if the backlog plus this batch would exceed the bound (nothing was added).
            QuotaExceeded: if a quota refused envelopes from ``data["admitted"]`` on; the
                ones before were added. ``data["quota"]`` names the quota.
        """
        costs = list(tokens) if tokens is not None else [1] * len(envelopes)
        if len(costs) != len(envelopes):
            raise ValueError("tokens must give one count per envelope")
        keys = [self.stream, *([self.rate_key] if self.rate_key else [])]
        args = [self.max_backlog, self.quota_key or "", len(envelopes), *costs, *envelopes]
        admitted, refused, backlog, limit, retry_ms = await self._run(keys, args)
        refused, admitted, backlog = _text(refused), int(admitted), int(backlog)
        if refused == "backlog":
            raise Busy(
                f"backlog of {backlog} requests is at the bound of {self.max_backlog}; retry later",
                backlog=backlog,
                bound=self.max_backlog,
            )
        if refused:
            limit_value = float(_text(limit))
            raise QuotaExceeded(
                f"quota {refused}={limit_value:g} reached: {len(envelopes) - admitted} of "
                f"{len(envelopes)} requests refused",
                quota=refused,
                limit=limit_value,
                admitted=admitted,
                retry_after_s=int(retry_ms) / 1000,
            )
        return backlog

    async def _run(self, keys: list[str], args: list[Any]) -> list[Any]:
        try:
            return list(await self.redis.evalsha(ADMISSION_SHA, len(keys), *keys, *args))
        except NoScriptError:
            pass
        try:  # a user allowed to EVAL (single-user Redis) loads it by running it
            return list(await self.redis.eval(ADMISSION_LUA, len(keys), *keys, *args))
        except NoPermissionError:
            raise Unavailable(
                "the admission script is not loaded in Redis (restarted, no worker up yet?)"
            ) from None
