"""The per-tenant limit on experiments running at once: leases in a zset, one script each.

Each running experiment holds a member of the tenant's zset (`KeySpace.experiments_running`)
scored by its lease end; the process running it renews the lease, so a killed process's slot
frees itself when the lease runs out. An experiment retried after a crash already holds its
member and gets it back at once.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["TenantLimit"]

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
return 0
"""


class TenantLimit:
    """Acquire, renew and release a tenant's running slots."""

    def __init__(self, redis: Any, limit: int, lease_s: float) -> None:
        self.redis = redis
        self.limit = limit
        self.lease_ms = int(lease_s * 1000)
        self._acquire = redis.register_script(_ACQUIRE)

    async def acquire(self, key: str, member: str) -> bool:
        """Take (or keep) a slot for `member`; False when the tenant is at its limit."""
        now_ms = int(time.time() * 1000)
        args = [member, now_ms, now_ms + self.lease_ms, self.limit]
        return bool(await self._acquire(keys=[key], args=args))

    async def renew(self, key: str, member: str) -> None:
        """Push `member`'s lease end forward (only if it still holds a slot)."""
        await self.redis.zadd(key, {member: int(time.time() * 1000) + self.lease_ms}, xx=True)

    async def release(self, key: str, member: str) -> None:
        """Give the slot back."""
        await self.redis.zrem(key, member)
