"""The admission script: one atomic step that checks a tenant's bounds and enqueues requests.

It lives in `shared` because both sides need it: clients run it (EVALSHA), and workers and
the operator load it (SCRIPT LOAD), since a tenant's ACL user may run loaded scripts but not
Lua of its own (EVAL or SCRIPT LOAD would let it run any script, a busy loop included).

``KEYS[1]`` is the tenant's request stream, ``KEYS[2]`` (optional) its token-rate bucket.
``ARGV``: the model's backlog bound (0: none), the tenant's quota hash name ('' for none),
the number ``n`` of requests, their ``n`` token costs, their ``n`` envelopes.

The quota hash is read by name (an ``ARGV``), not declared in ``KEYS``: EVALSHA's declared keys
need read *and* write permission, and a tenant may only read its quota. The script still touches
nothing outside its slot, since the quota key carries the request stream's ``{<model>}`` hash
tag, and Redis checks every command inside the script against the caller's ACL.

Requests are admitted in order while they fit: the backlog bound refuses the whole batch
(as before), a quota refuses the rest of it from the first request that does not fit.
Returns ``{admitted, refused quota ('' if none), backlog after, limit, retry after ms}``.
"""

from __future__ import annotations

import hashlib

__all__ = ["ADMISSION_LUA", "ADMISSION_SHA", "load_admission_script"]

ADMISSION_LUA = """
local bound = tonumber(ARGV[1])
local n = tonumber(ARGV[3])
local backlog = redis.call('XLEN', KEYS[1])
if bound > 0 and backlog + n > bound then
  return {0, 'backlog', backlog, tostring(bound), 0}
end
local max_inflight, max_rate = 0, 0
if ARGV[2] ~= '' then
  local quota = redis.call('HMGET', ARGV[2], 'max_inflight', 'max_tokens_per_s')
  max_inflight = tonumber(quota[1]) or 0
  max_rate = tonumber(quota[2]) or 0
end
local admit, refused, limit, retry_ms = n, '', '0', 0
if max_inflight > 0 and backlog + n > max_inflight then
  admit = math.max(max_inflight - backlog, 0)
  refused, limit = 'max_inflight', tostring(max_inflight)
end
if max_rate > 0 and KEYS[2] then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local bucket = redis.call('HMGET', KEYS[2], 'level', 'ms')
  local level = tonumber(bucket[1]) or max_rate
  local since_ms = math.max(now_ms - (tonumber(bucket[2]) or now_ms), 0)
  level = math.min(max_rate, level + since_ms * max_rate / 1000)
  for i = 1, admit do
    local need = math.min(tonumber(ARGV[3 + i]), max_rate)
    if level < need then
      admit = i - 1
      refused, limit = 'max_tokens_per_s', tostring(max_rate)
      retry_ms = math.ceil((need - level) * 1000 / max_rate)
      break
    end
    level = level - tonumber(ARGV[3 + i])
  end
  redis.call('HSET', KEYS[2], 'level', tostring(level), 'ms', string.format('%d', now_ms))
  redis.call('PEXPIRE', KEYS[2], 60000)
end
for i = 1, admit do
  redis.call('XADD', KEYS[1], '*', 'm', ARGV[3 + n + i])
end
return {admit, refused, backlog + admit, limit, retry_ms}
"""

#: What EVALSHA names the script by (SHA-1 of its text, as Redis computes it).
ADMISSION_SHA = hashlib.sha1(ADMISSION_LUA.encode()).hexdigest()


async def load_admission_script(redis: object) -> str:
    """SCRIPT LOAD the admission script on `redis` (a user allowed to); returns its SHA-1.

    Workers call this on start and after a Redis restart (the script cache is not persisted),
    so tenants, who may only EVALSHA, find it loaded.
    """
    sha = await redis.script_load(ADMISSION_LUA)  # type: ignore[attr-defined]
    return sha.decode() if isinstance(sha, bytes) else str(sha)
