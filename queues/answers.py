"""The answer cache's Redis contract: an LRU-K cache (K = 2 by default) of the whole replies of deterministic
requests, shared by every API process.

- **History** (``tc:ans:h:{digest}``, a list): the times of a key's last K references, newest first,
  expiring with the history window. A reference counts only inside the window.
- **Admission**: a reply is stored only when its request is at least the K-th reference of its key
  within the window; a key referenced once is never cached (one-off questions do not push out repeated
  ones).
- **Entries** (``tc:ans:e:{digest}``): the model identity, a newline, then the reply (orjson), with a
  validity TTL. A reference that finds an entry of another model identity (the model changed under the
  same name) deletes it: stale.
- **Eviction** (``tc:ans:index``, a sorted set): each entry is scored by its K-th most recent reference
  (its backward K-distance); past the capacity the lowest score goes first — the entry whose K-th last
  use is oldest, not merely the one used least recently. An entry that expired by its TTL leaves the
  index when it is next referenced, or when eviction reaches it.

The digest covers the tenant, the model, the prompt's token ids and every sampling parameter, so two
tenants never share an entry (``api.answers`` builds it). All steps are Lua scripts: atomic across API
processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from queues import scripts
from queues.keys import Keys

# KEYS: entry, history, index. ARGV: now (ms), K, history window (ms), model identity.
# Returns {'hit', entry} | {'stale'} | {'admit', score} | {'miss'}.
REFERENCE = """
local now, k, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], 0, k - 1)
redis.call('PEXPIRE', KEYS[2], window)
local counted, kth = 0, nil
for _, at in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if tonumber(at) > now - window then
    counted = counted + 1
    kth = at
  end
end
local entry = redis.call('GET', KEYS[1])
if entry then
  local model = string.match(entry, '^([^\\n]*)\\n')
  if model ~= ARGV[4] then
    redis.call('DEL', KEYS[1])
    redis.call('ZREM', KEYS[3], KEYS[1])
    return {'stale'}
  end
  if counted >= k then redis.call('ZADD', KEYS[3], kth, KEYS[1]) end
  return {'hit', entry}
end
redis.call('ZREM', KEYS[3], KEYS[1])
if counted >= k then return {'admit', kth} end
return {'miss'}
"""

# KEYS: entry, index. ARGV: entry, TTL (ms), score, capacity. Returns how many entries were evicted.
STORE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
local evicted = 0
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[4]) do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  redis.call('DEL', victim[1])
  evicted = evicted + 1
end
return evicted
"""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    k: int = 2
    history_s: float = 600.0
    ttl_s: float = 3600.0
    max_entries: int = 10_000


@dataclass(frozen=True, slots=True)
class Reference:
    """What one reference found: a hit (with the stored reply), a stale entry (deleted), a miss whose
    reply may be stored (``admit``, with its eviction score), or a plain miss."""

    result: Literal["hit", "stale", "admit", "miss"]
    reply: bytes | None = None
    score: int = 0


class AnswerStore:
    """One LRU-K pool: ``pool`` "" is the per-tenant answer cache, "tiny" the shared pool of tiny
    requests (its own keys, index and size bound)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, config: CacheConfig, *, pool: str = "") -> None:
        self._redis = redis
        self._keys = keys
        self.config = config
        self.pool = pool

    async def reference(self, digest: str, model_id: str, *, now_ms: int) -> Reference:
        keys = self._keys
        reply = await scripts.run(
            self._redis,
            REFERENCE,
            [keys.answer(digest, self.pool), keys.answer_history(digest, self.pool), keys.answer_index(self.pool)],
            [now_ms, self.config.k, int(self.config.history_s * 1000), model_id],
        )
        result = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if result == "hit":
            entry: bytes = reply[1]
            return Reference("hit", reply=entry.split(b"\n", 1)[1])
        if result == "admit":
            return Reference("admit", score=int(reply[1]))
        return Reference(result)  # type: ignore[arg-type]

    async def store(self, digest: str, model_id: str, reply: bytes, *, score: int) -> int:
        """Keep ``reply`` for the key; returns how many entries were evicted to make room."""
        if "\n" in model_id:
            raise ValueError("a model identity holds no newline")
        evicted = await scripts.run(
            self._redis,
            STORE,
            [self._keys.answer(digest, self.pool), self._keys.answer_index(self.pool)],
            [model_id.encode() + b"\n" + reply, int(self.config.ttl_s * 1000), score, self.config.max_entries],
        )
        return int(evicted)

    async def cached(self) -> list[str]:
        """Digests in the eviction index (tests, diagnosis)."""
        prefix = self._keys.answer("", self.pool)
        members = await self._redis.zrange(self._keys.answer_index(self.pool), 0, -1)
        return [member.decode().removeprefix(prefix) for member in members]
