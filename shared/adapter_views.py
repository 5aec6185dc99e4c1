"""Who reads which adapter record: the model's full hash and the views tenants may read.

A model's adapter records live in three kinds of hashes (`shared.keys`), all in the model's
``{<model>}`` hash slot:

- ``lmq:model:{<model>}:adapters``: every record. Workers serve what it holds and the
  operator lists it; no tenant's ACL user may read it.
- ``lmq:model:{<model>}:public-adapters``: a copy of each public record, for every tenant.
- ``lmq:<tenant>:model:{<model>}:adapters``: a copy of each record private to that tenant;
  the tenant's key pattern covers it, no other tenant's does.

A record changes (added, replaced, made public or private, removed) only through `MOVE_LUA`,
which edits the full hash and both views in one script: the full hash is changed in place
(``HSET`` of the same field), so a worker reading it never misses an adapter that is being
moved, and a view never lists a record the full hash does not hold. `REBUILD_LUA` writes the
views again from the full hash (a worker does at start: records written by a version that
kept one hash, or by hand, get their views).

Scripts declare every key they touch, and all of them share the model's slot, so they run
on a Redis Cluster too. Each checks what its caller read first and does nothing (returns 0)
if another writer came between: the caller reads again and retries.
"""

from __future__ import annotations

__all__ = ["MOVE_LUA", "REBUILD_LUA", "rebuild_arguments"]

#: Replace or remove one record. KEYS: the full hash, the view that lists the old record
#: (any view if there is none), the view for the new record. ARGV: the name, the old record's
#: bytes as the caller read them ('' if none), the new record's bytes ('' removes it).
MOVE_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if old ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
end
return 1
"""

#: Write the views again from the full hash. KEYS: the full hash, then every view to write
#: (emptied first). ARGV: the number of records the caller read, then for each its name, its
#: bytes and the index in KEYS of its view (0: none, a record no one may serve).
REBUILD_LUA = """
local n = tonumber(ARGV[1])
if redis.call('HLEN', KEYS[1]) ~= n then
  return 0
end
for i = 0, n - 1 do
  if redis.call('HGET', KEYS[1], ARGV[2 + 3 * i]) ~= ARGV[3 + 3 * i] then
    return 0
  end
end
for k = 2, #KEYS do
  redis.call('DEL', KEYS[k])
end
for i = 0, n - 1 do
  local view = tonumber(ARGV[4 + 3 * i])
  if view > 1 then
    redis.call('HSET', KEYS[view], ARGV[2 + 3 * i], ARGV[3 + 3 * i])
  end
end
return 1
"""


def rebuild_arguments(
    full: str, public: str, entries: list[tuple[bytes, bytes, str | None]]
) -> tuple[list[str], list[bytes | int]]:
    """`REBUILD_LUA`'s keys and arguments for `entries` (name, bytes, view key or None) read
    from the hash `full`; the public view is always among the keys (it is emptied when no
    record is public)."""
    keys = [full, public]
    args: list[bytes | int] = [len(entries)]
    for name, raw, view in entries:
        if view is not None and view not in keys:
            keys.append(view)
        args += [name, raw, keys.index(view) + 1 if view is not None else 0]
    return keys, args
