"""The dead-letter stream ``tc:dlq`` for operators: its entries newest first, and a replay of one.

A dead-lettered request already gave its client one terminal error (``expired``, ``max_deliveries``), at
the position its message names as its next (``RequestMessage.next_seq``). A replay puts the request back
on its intake stream as a new attempt and takes the entry out of the dead-letter stream in one script,
so of two replays of one entry exactly one enqueues anything. In the same step the error leaves the
request's output stream (``tc:out:{id}``) and the replay writes after its position: a reader from the
start sees the positions the client had, then the replay's, with one terminal event; a client that got
the error (and its position as ``Last-Event-ID``) or stopped just before it reads the replay's positions
with ``GET /v1/requests/{id}``. Nothing is rewritten, so no position reaches a client twice.

A replay starts afresh: enqueued now, with its tier's deadline from now. Having output positions behind
it, it counts as started (a deadline means "start by"), so it is not expired again. Its first delivery
draws a fencing token above every earlier one (dead-lettering keeps the request's token), so a former
owner of the request stays fenced off. A request nobody could read any more — its record expired, or a
batch job's chunk (whose job counted the error) — is not replayed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from queues import scripts
from queues.intake import MESSAGE_FIELD, TOKENS_FIELD
from queues.keys import Keys
from queues.messages import RequestMessage
from queues.output import read_output

# KEYS: dead-letter stream, output stream, request record, intake stream, and its idempotency key if any.
# ARGV: dead-letter entry id, position of the dead-letter error (0: none), message field, message,
# tokens field, tokens, ttl_s. Returns the new intake entry id, 0 when the dead-letter entry is gone
# (unknown, or replayed already), -1 when the request's record is gone (nobody could read a replay).
REPLAY = """
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
redis.call('XDEL', KEYS[1], ARGV[1])
if ARGV[2] ~= '0' then redis.call('XDEL', KEYS[2], '0-' .. ARGV[2]) end
local id = redis.call('XADD', KEYS[4], '*', ARGV[3], ARGV[4], ARGV[5], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[7])
redis.call('EXPIRE', KEYS[3], ARGV[7])
if #KEYS == 5 then redis.call('EXPIRE', KEYS[5], ARGV[7]) end
return id
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    entry_id: str
    reason: str
    # The intake stream the request was on.
    stream: str
    message: RequestMessage

    @property
    def dead_lettered_at_ms(self) -> int:
        return int(self.entry_id.split("-", 1)[0])

    def summary(self) -> dict[str, str | int]:
        """What an operator sees of the entry: ids, reason, tier and sizes, never the prompt."""
        message = self.message
        return {
            "id": self.entry_id,
            "request_id": message.id,
            "reason": self.reason,
            "tenant": message.tenant,
            "tier": message.tier,
            "bucket": message.bucket,
            "stream": self.stream,
            "dead_lettered_at_ms": self.dead_lettered_at_ms,
            "enqueued_at_ms": message.enqueued_at_ms,
            "attempt": message.attempt,
            "prompt_tokens": len(message.prompt_token_ids),
            "generated_tokens": len(message.generated_token_ids),
        }


@dataclass(frozen=True, slots=True)
class Replayed:
    request_id: str
    stream: str
    intake_entry_id: str
    # The last position the client had before the request failed (the ``Last-Event-ID`` to resume with).
    last_seq: int
    # The position of the error the client was given (0: none was written); the replay writes after it.
    error_seq: int


ReplayRefusal = Literal["unknown", "unreadable"]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _dead_letter(entry_id: bytes | str, fields: dict[bytes, bytes]) -> DeadLetter:
    return DeadLetter(
        entry_id=_text(entry_id),
        reason=_text(fields.get(b"reason", b"")),
        stream=_text(fields.get(b"stream", b"")),
        message=RequestMessage.loads(fields[MESSAGE_FIELD]),
    )


async def dead_letters(redis: aioredis.Redis, keys: Keys, *, limit: int) -> tuple[int, list[DeadLetter]]:
    """How many entries the dead-letter stream holds, and the newest ``limit`` of them, newest first."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.dead_letter)
        pipe.xrevrange(keys.dead_letter, "+", "-", count=limit)
        total, rows = await pipe.execute()
    return int(total), [_dead_letter(entry_id, fields) for entry_id, fields in rows]


async def dead_letter(redis: aioredis.Redis, keys: Keys, entry_id: str) -> DeadLetter | None:
    rows = await redis.xrange(keys.dead_letter, min=entry_id, max=entry_id)
    return _dead_letter(*rows[0]) if rows else None


async def replay(
    redis: aioredis.Redis, keys: Keys, entry_id: str, *, now_ms: int, ttl_s: int
) -> Replayed | ReplayRefusal:
    """Put the request of dead-letter entry ``entry_id`` back on its intake stream (see the module);
    ``ttl_s``: how long its record and output are kept from now. "unknown": no such entry (or it was
    replayed already); "unreadable": the request's record is gone."""
    found = await dead_letter(redis, keys, entry_id)
    if found is None:
        return "unknown"
    message = found.message
    at = await read_output(redis, keys, message.id, from_seq=message.next_seq, to_seq=message.next_seq)
    error_seq = message.next_seq if at and at[0].type == "error" else 0
    again = dataclasses.replace(
        message,
        enqueued_at_ms=now_ms,
        deadline_ms=now_ms + max(0, message.deadline_ms - message.enqueued_at_ms),
        attempt=message.attempt + 1,
        next_seq=message.next_seq + 1 if error_seq else message.next_seq,
    )
    stream = keys.intake(again.tier, again.bucket)
    script_keys = [keys.dead_letter, keys.output(message.id), keys.request(message.id), stream]
    if message.idempotency_key:
        script_keys.append(keys.idempotency(message.tenant, message.idempotency_key))
    new_id = await scripts.run(
        redis,
        REPLAY,
        script_keys,
        [entry_id, error_seq, MESSAGE_FIELD, again.dumps(), TOKENS_FIELD, again.cost_tokens(), ttl_s],
    )
    if new_id == 0:
        return "unknown"
    if new_id == -1:
        return "unreadable"
    return Replayed(message.id, stream, _text(new_id), message.next_seq - 1, error_seq)
