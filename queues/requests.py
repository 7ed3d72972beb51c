"""Records of accepted requests (``tc:req:{id}``) and idempotency keys (``tc:idem:{tenant}:{key}``).

A record says who owns a request and how its response is shaped, so that a resume
(``GET /v1/requests/{id}``) or a repeated ``Idempotency-Key`` is answered from the request's durable
output by any API process. It is written before the intake entry and kept as long as the output.
An idempotency key is claimed together with the record in one script: of two concurrent requests
with the same key, exactly one is accepted; the other is answered with the first one's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import redis.asyncio as aioredis

from queues import scripts
from queues.intake import append
from queues.keys import Keys
from queues.messages import RequestMessage

Route = Literal["chat", "completion"]

# KEYS: idempotency key, record key. ARGV: request id, record, ttl_s.
# Returns the id of the request that already holds the key, or false after claiming it.
CLAIM = """
local existing = redis.call('GET', KEYS[1])
if existing then return existing end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return false
"""


@dataclass(slots=True)
class RequestRecord:
    id: str
    tenant: str
    route: Route
    model: str
    return_token_ids: bool = False
    include_usage: bool = False
    created_s: int = 0
    # The client sent an Idempotency-Key: it may come back, so leaving does not cancel at once.
    resumable: bool = False
    # Hash of the request body: a repeated key with another body is refused, not replayed.
    fingerprint: str = ""

    def dumps(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def loads(cls, data: bytes) -> RequestRecord:
        raw: dict[str, Any] = orjson.loads(data)
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in raw.items() if name in known})


async def claim(
    redis: aioredis.Redis, keys: Keys, record: RequestRecord, idempotency_key: str, *, ttl_s: int
) -> RequestRecord | None:
    """Claim ``idempotency_key`` for ``record`` (and store the record); None when claimed, else the
    record of the request that holds the key."""
    existing = await scripts.run(
        redis,
        CLAIM,
        [keys.idempotency(record.tenant, idempotency_key), keys.request(record.id)],
        [record.id, record.dumps(), ttl_s],
    )
    if existing is None:
        return None
    holder = await load(redis, keys, existing.decode() if isinstance(existing, bytes) else str(existing))
    if holder is None:  # the holder's record expired first: the key names nothing any more
        await redis.delete(keys.idempotency(record.tenant, idempotency_key))
        return await claim(redis, keys, record, idempotency_key, ttl_s=ttl_s)
    return holder


async def release(redis: aioredis.Redis, keys: Keys, record: RequestRecord, idempotency_key: str) -> None:
    """Undo a claim whose request was then refused (admission, a full queue, Redis)."""
    await redis.delete(keys.idempotency(record.tenant, idempotency_key), keys.request(record.id))


async def enqueue(
    redis: aioredis.Redis,
    keys: Keys,
    message: RequestMessage,
    record: RequestRecord,
    *,
    ttl_s: int,
    replicas: int = 0,
    wait_ms: int = 0,
) -> str:
    """Store the record (unless ``claim`` stored it: a resumable request) and append the request to
    its intake stream, in one round trip: accepted once this returns, with the entry's id (``replicas``:
    see ``intake.append``; a withdrawn request's record goes with it)."""
    store: tuple[bytes, ...] = ()
    if not record.resumable:
        store = (scripts.pack_command((b"SET", keys.request(record.id), record.dumps(), b"EX", ttl_s)),)
    return await append(redis, keys, message, replicas=replicas, wait_ms=wait_ms, before=store, recorded=True)


async def load(redis: aioredis.Redis, keys: Keys, request_id: str) -> RequestRecord | None:
    data = await redis.get(keys.request(request_id))
    return None if data is None else RequestRecord.loads(data)


async def attach(redis: aioredis.Redis, keys: Keys, request_id: str, *, ttl_s: int) -> int:
    """Count one more client attached to ``request_id``; returns the count."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.incr(keys.attachments(request_id))
        pipe.expire(keys.attachments(request_id), ttl_s)
        count, _ = await pipe.execute()
    return int(count)


async def attachments(redis: aioredis.Redis, keys: Keys, request_id: str) -> int:
    value = await redis.get(keys.attachments(request_id))
    return int(value or 0)
