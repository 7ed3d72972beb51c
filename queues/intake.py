"""Intake streams: enqueue with XADD, read with XREADGROUP, acknowledge after the terminal event.

The consumer group is created idempotently with MKSTREAM; a ``NOGROUP`` reply (Redis restarted or
was flushed) recreates it and retries once. Every delivery (a read, a take-over) gives the request a
new fencing token (``queues.fencing``); acknowledging, requeueing and dead-lettering are refused to a
holder of an older one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from queues import fencing, scripts
from queues.keys import FENCE_TTL_S, WORKER_GROUP, Keys
from queues.messages import RequestMessage

# Field of an intake entry that holds the orjson-encoded RequestMessage.
MESSAGE_FIELD = b"d"
# Field with the tokens the request will cost the engine (``RequestMessage.cost_tokens``), so the queued
# tokens can be summed without decoding messages.
TOKENS_FIELD = b"t"
# The queued-tokens probe reads at most this many unread entries per stream and extrapolates beyond.
QUEUED_TOKENS_SCAN = 5000
# A withdrawn entry's cancel tombstone outlives any worker's read of it.
WITHDRAWN_TTL_S = 3600
# The dead-letter stream keeps about this many entries.
DEAD_LETTER_MAXLEN = 100_000


@dataclass(slots=True)
class IntakeEntry:
    """An intake entry delivered to this consumer: where it came from and what it says."""

    stream: str
    entry_id: str
    message: RequestMessage
    delivery_count: int = 1
    # This delivery's fencing token (0: unfenced, an entry outside any delivery).
    fence: int = 0
    # A cancel tombstone named the request when it was delivered (its client left, or the API withdrew
    # it): it is answered ``cancelled`` without running.
    cancelled: bool = False


async def ensure_groups(redis: aioredis.Redis, keys: Keys) -> None:
    """Create the worker group on every intake stream (and the stream itself) if missing.

    The group starts at id 0, so entries written while the group was missing (after a FLUSHALL the
    API's XADD recreates the stream without a group) are still delivered.
    """
    for stream in keys.intake_all():
        try:
            await redis.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def entry_args(message: RequestMessage) -> list[bytes | int]:
    """The field-value arguments of the intake entry that carries ``message``."""
    return [MESSAGE_FIELD, message.dumps(), TOKENS_FIELD, message.cost_tokens()]


class NotReplicatedError(RedisError):
    """No replica confirmed an intake entry within the wait; the entry was withdrawn (not accepted)."""


async def enqueue(
    redis: aioredis.Redis, keys: Keys, message: RequestMessage, *, replicas: int = 0, wait_ms: int = 0
) -> str:
    """Append the request to its intake stream; returns the entry id. Accepted once this returns
    (with ``replicas``, see ``append``)."""
    return await append(redis, keys, message, replicas=replicas, wait_ms=wait_ms)


async def append(
    redis: aioredis.Redis,
    keys: Keys,
    message: RequestMessage,
    *,
    replicas: int,
    wait_ms: int,
    before: Sequence[bytes] = (),
    recorded: bool = False,
) -> str:
    """Send the commands ``before`` (packed, ``scripts.pack_command``) and the XADD of ``message`` in one
    write on one connection, and return the entry id. Packed here rather than through redis-py's
    pipeline object, which cost the API more CPU than the rest of accepting a request (BENCHMARKS.md).
    The XADD runs in ``fencing.INTAKE``, which draws the fencing token of the entry's first delivery
    with it (``read``: the worker that reads it fresh needs no round trip of its own before it starts).
    The commands ``before`` must be safe to repeat: after a NOSCRIPT reply all are sent again.

    With ``replicas`` the same write ends in ``WAIT replicas wait_ms``, which Redis answers once that
    many replicas have every write of this connection so far: the request then survives a failover to
    any of them. When fewer confirm in time the entry is withdrawn — deleted, and a cancel tombstone
    keeps a worker that already read it from running it — and ``NotReplicatedError`` says so: the
    caller answers that the request was not accepted. ``recorded``: the request has a record
    (``queues.requests``), withdrawn with it."""
    stream = keys.intake(message.tier, message.bucket)
    fence_key = keys.fence(message.id)
    add = scripts.pack_call(redis, fencing.INTAKE, [fence_key, stream], [FENCE_TTL_S, *entry_args(message)])
    commands = [*before, add]
    if replicas:
        commands.append(scripts.pack_command((b"WAIT", replicas, wait_ms)))
    packed = b"".join(commands)
    try:
        replies = await scripts.execute_packed_all(redis, packed, num_replies=len(commands))
    except NoScriptError:
        await redis.script_load(fencing.INTAKE)  # a new primary, or a flushed script cache
        replies = await scripts.execute_packed_all(redis, packed, num_replies=len(commands))
    raw = replies[len(before)]
    entry_id = raw.decode() if isinstance(raw, bytes) else str(raw)
    if replicas and int(replies[-1]) < replicas:
        await withdraw(redis, keys, message.id, stream, entry_id, recorded=recorded)
        raise NotReplicatedError(
            f"no replica confirmed the request within {wait_ms} ms (intake durability 'replica'); "
            "it was not accepted and can be sent again"
        )
    return entry_id


async def withdraw(
    redis: aioredis.Redis, keys: Keys, request_id: str, stream: str, entry_id: str, *, recorded: bool
) -> None:
    """Take back an intake entry nobody was told was accepted: a worker that already holds it finds
    the cancel tombstone and drops it."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.cancelled(request_id), b"1", ex=WITHDRAWN_TTL_S)
        pipe.publish(keys.cancel_channel, request_id.encode())
        pipe.xdel(stream, entry_id)
        if recorded:
            pipe.delete(keys.request(request_id))
        await pipe.execute()


async def read(
    redis: aioredis.Redis,
    keys: Keys,
    consumer: str,
    streams: list[str],
    *,
    count: int,
    block_ms: int | None,
    trusted_from_ms: Callable[[], int | None] | None = None,
) -> list[IntakeEntry]:
    """Read up to ``count`` new entries per stream for ``consumer``; recreates a lost group once.

    Each entry gets its delivery's fencing token. An entry that carries the token drawn when it was
    appended (``append``) and whose id is at least ``trusted_from_ms()`` (Redis's clock, asked once the
    read returns) keeps that token: no round trip, and no cancel tombstone read either, so the caller
    says from when every cancel published is known to it (``IntakeEntry.cancelled`` stays False for
    those). Every other entry is fenced here (``fence``: the next token, and the tombstone)."""
    request: dict[bytes | str | memoryview, int | bytes | str | memoryview] = {stream: ">" for stream in streams}
    try:
        reply = await redis.xreadgroup(WORKER_GROUP, consumer, request, count=count, block=block_ms)
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        await ensure_groups(redis, keys)
        reply = await redis.xreadgroup(WORKER_GROUP, consumer, request, count=count, block=block_ms)
    entries: list[IntakeEntry] = []
    unfenced: list[IntakeEntry] = []
    trusted_from = trusted_from_ms() if trusted_from_ms is not None and reply else None
    for stream, items in reply or []:
        stream_name = stream.decode() if isinstance(stream, bytes) else stream
        for raw_id, fields in items:
            entry_id = raw_id.decode()
            message = RequestMessage.loads(fields[MESSAGE_FIELD])
            entry = IntakeEntry(stream=stream_name, entry_id=entry_id, message=message)
            token = fields.get(fencing.INTAKE_FENCE_FIELD)
            if token is not None and trusted_from is not None and entry_key(entry_id)[0] >= trusted_from:
                entry.fence = int(token)
            else:
                unfenced.append(entry)
            entries.append(entry)
    await fence(redis, keys, unfenced)
    return entries


async def fence(redis: aioredis.Redis, keys: Keys, entries: Sequence[IntakeEntry]) -> None:
    """Give each freshly delivered entry the request's next fencing token: from now on the holder of
    any earlier token can no longer write the request's output or acknowledge its entry. The same
    round trip tells whether a cancel tombstone names the request (``IntakeEntry.cancelled``); a cancel
    sent after it reaches the worker over the cancel channel."""
    if not entries:
        return
    script_keys = [key for entry in entries for key in (keys.fence(entry.message.id), keys.cancelled(entry.message.id))]
    replies = await scripts.run_packed(redis, fencing.FENCE, script_keys, [FENCE_TTL_S])
    for entry, token, cancelled in zip(entries, replies[::2], replies[1::2], strict=True):
        entry.fence = int(token)
        entry.cancelled = bool(cancelled)


async def ack(redis: aioredis.Redis, keys: Keys, entry: IntakeEntry) -> bool:
    """Acknowledge and delete a finished entry (one group per stream, so nobody else needs it) and
    drop its fencing token; False, and nothing done, when a newer delivery holds the request."""
    done = await scripts.run(
        redis, fencing.ACK, [keys.fence(entry.message.id), entry.stream], [entry.fence, WORKER_GROUP, entry.entry_id]
    )
    return bool(done)


async def dead_letter(redis: aioredis.Redis, keys: Keys, entry: IntakeEntry, reason: str) -> bool:
    """Move an entry to the dead-letter stream with its reason and acknowledge it; False when fenced."""
    done = await scripts.run(
        redis,
        fencing.DEAD_LETTER,
        [keys.fence(entry.message.id), entry.stream, keys.dead_letter],
        [entry.fence, WORKER_GROUP, entry.entry_id, reason, MESSAGE_FIELD, entry.message.dumps(), DEAD_LETTER_MAXLEN],
    )
    return bool(done)


async def keep_claimed(redis: aioredis.Redis, keys: Keys, consumer: str, entries: list[IntakeEntry]) -> list[str]:
    """Reset the idle time of entries this consumer is still working on, so nobody reclaims them;
    returns the request ids of those a newer delivery holds (this consumer must let them go)."""
    if not entries:
        return []
    script_keys = [key for entry in entries for key in (keys.fence(entry.message.id), entry.stream)]
    args: list[str | int] = [WORKER_GROUP, consumer]
    for entry in entries:
        args += [entry.fence, entry.entry_id]
    fenced = await scripts.run(redis, fencing.KEEP_CLAIMED, script_keys, args)
    return [entries[int(index) - 1].message.id for index in fenced]


async def reclaim(
    redis: aioredis.Redis, keys: Keys, consumer: str, stream: str, *, min_idle_ms: int, count: int
) -> list[IntakeEntry]:
    """Take over up to ``count`` entries of ``stream`` idle longer than ``min_idle_ms`` (their
    consumer died or hangs); each comes with its delivery count, this delivery included, and no
    fencing token yet: the caller gives one (``fence``) to those it takes on."""
    reply = await redis.xautoclaim(stream, WORKER_GROUP, consumer, min_idle_ms, start_id="0-0", count=count)
    return await _claimed(redis, stream, reply[1])


async def take_over(
    redis: aioredis.Redis, keys: Keys, consumer: str, dead: str, stream: str, *, min_idle_ms: int, count: int
) -> list[IntakeEntry]:
    """Claim up to ``count`` entries of ``stream`` pending on the consumer ``dead`` (its heartbeat
    stopped), idle at least ``min_idle_ms`` so that two survivors never claim the same one; unfenced,
    as ``reclaim``'s."""
    pending = await redis.xpending_range(stream, WORKER_GROUP, min="-", max="+", count=count, consumername=dead)
    ids = [item["message_id"] for item in pending]
    if not ids:
        return []
    claimed = await redis.xclaim(stream, WORKER_GROUP, consumer, min_idle_time=min_idle_ms, message_ids=ids)
    return await _claimed(redis, stream, claimed)


async def _claimed(
    redis: aioredis.Redis, stream: str, claimed: list[tuple[bytes, dict[bytes, bytes] | None]]
) -> list[IntakeEntry]:
    entries: list[IntakeEntry] = []
    for entry_id, fields in claimed:
        if not fields:  # deleted while pending
            continue
        ident = entry_id.decode()
        info = await redis.xpending_range(stream, WORKER_GROUP, min=ident, max=ident, count=1)
        entries.append(
            IntakeEntry(
                stream=stream,
                entry_id=ident,
                message=RequestMessage.loads(fields[MESSAGE_FIELD]),
                delivery_count=int(info[0]["times_delivered"]) if info else 1,
            )
        )
    return entries


async def has_pending(redis: aioredis.Redis, stream: str, consumer: str) -> bool:
    """Whether any entry of ``stream`` is pending on ``consumer``."""
    return bool(await redis.xpending_range(stream, WORKER_GROUP, min="-", max="+", count=1, consumername=consumer))


async def requeue(redis: aioredis.Redis, keys: Keys, entry: IntakeEntry, message: RequestMessage) -> str | None:
    """Replace ``entry`` by ``message`` (a continuation) at the end of its intake stream, atomically:
    the continuation exists exactly when the original is acknowledged. None, and nothing done, when a
    newer delivery holds the request."""
    stream = keys.intake(message.tier, message.bucket)
    fields = [MESSAGE_FIELD, message.dumps(), TOKENS_FIELD, message.cost_tokens()]
    new_id = await scripts.run(
        redis,
        fencing.REQUEUE,
        [keys.fence(entry.message.id), entry.stream, stream],
        [entry.fence, WORKER_GROUP, entry.entry_id, *fields],
    )
    if new_id is None:
        return None
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


async def backlog(redis: aioredis.Redis, streams: list[str]) -> dict[str, int]:
    """Entries of each stream not yet delivered to any worker (the group's lag, or the stream's length
    while it has no group): ``lags`` without the ids, one script call for every stream (the worker
    probes ten times a second while busy; a pipeline of one ``XINFO GROUPS`` per stream, each reply
    parsed into dictionaries, cost it about twice the CPU)."""
    return {stream: lag.waiting for stream, lag in (await lags(redis, streams, oldest=False)).items()}


EntryKey = tuple[int, int]


def entry_key(entry_id: str | bytes) -> EntryKey:
    """A stream entry id (``ms-seq``) as a pair that sorts as Redis orders the entries."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Lag:
    """One stream's entries not yet delivered to any worker, read in one step with ``upto``: every entry
    with an id up to it had been added when the count was taken, every later one came after."""

    waiting: int
    upto: EntryKey
    # How long the oldest waiting entry had waited, in Redis's own clock (its id, which XADD stamps,
    # against the server's TIME); 0 with none waiting, or when not asked for.
    oldest_wait_ms: int = 0


async def lags(
    redis: aioredis.Redis, streams: list[str], *, scan: int = QUEUED_TOKENS_SCAN, oldest: bool = True
) -> dict[str, Lag]:
    """``backlog`` for a caller that counts its own appends on top (the API's shedding): it can tell an
    append the count already holds from a later one, however their round trips overlap. ``oldest``: also
    time each stream's oldest waiting entry (``Lag.oldest_wait_ms``; one more read per stream)."""
    reply = await scripts.run(redis, LAGS, streams, [WORKER_GROUP, scan, int(oldest)])
    found: dict[str, Lag] = {}
    for stream, (waiting, newest, delivered, first, now_ms) in zip(streams, reply, strict=True):
        first_ms = entry_key(first)[0]
        waited_ms = max(0, int(now_ms) - first_ms) if int(waiting) > 0 and first_ms > 0 else 0
        found[stream] = Lag(int(waiting), max(entry_key(newest), entry_key(delivered)), waited_ms)
    return found


# Per stream (KEYS): the worker group's lag (without the group, the stream's length; where Redis cannot
# say, the entries after the last delivered one, counted up to ARGV[2]), the id of the newest entry, the
# group's last delivered id (an entry gone from the stream had been delivered), the id of the oldest
# entry not delivered ('0-0': none, or not asked for) and the server's TIME in ms (0: not asked for).
# ARGV: group, scan limit, 1 to read the oldest.
LAGS = """
local out = {}
local now_ms = 0
if ARGV[3] == '1' then
  local now = redis.call('TIME')
  now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
for i, stream in ipairs(KEYS) do
  local lag, delivered, grouped = nil, '0-0', false
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if ok then
    for _, group in ipairs(groups) do
      local fields = {}
      for j = 1, #group, 2 do fields[group[j]] = group[j + 1] end
      if fields['name'] == ARGV[1] then
        grouped, delivered, lag = true, fields['last-delivered-id'], fields['lag']
      end
    end
  end
  if type(lag) ~= 'number' then
    if grouped then
      lag = #redis.call('XRANGE', stream, '(' .. delivered, '+', 'COUNT', ARGV[2])
    else
      lag = redis.call('XLEN', stream)
    end
  end
  local newest = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  local oldest = {}
  if ARGV[3] == '1' and lag > 0 then
    oldest = redis.call('XRANGE', stream, grouped and ('(' .. delivered) or '-', '+', 'COUNT', 1)
  end
  out[i] = {lag, newest[1] and newest[1][1] or '0-0', delivered, oldest[1] and oldest[1][1] or '0-0', now_ms}
end
return out
"""


async def queued_tokens(redis: aioredis.Redis, streams: list[str], *, scan: int = QUEUED_TOKENS_SCAN) -> dict[str, int]:
    """Tokens of the entries of each stream not yet delivered to any worker (the sum of their
    ``TOKENS_FIELD``). Past ``scan`` unread entries in a stream, the rest are counted at the mean of
    those read."""
    reply = await scripts.run(redis, QUEUED_TOKENS, streams, [WORKER_GROUP, scan])
    totals: dict[str, int] = {}
    for stream, (tokens, read, lag) in zip(streams, reply, strict=True):
        tokens, read, lag = int(tokens), int(read), int(lag)
        totals[stream] = tokens if read >= lag or read == 0 else round(tokens * lag / read)
    return totals


# Per stream (KEYS): the sum of the token field over the entries after the worker group's last
# delivered id (all entries while the group is missing), at most ARGV[2] of them, how many were read,
# and the group's lag. ARGV: group, scan limit.
QUEUED_TOKENS = f"""
local out = {{}}
for i, stream in ipairs(KEYS) do
  local start, lag = '-', nil
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if ok then
    for _, group in ipairs(groups) do
      local fields = {{}}
      for j = 1, #group, 2 do fields[group[j]] = group[j + 1] end
      if fields['name'] == ARGV[1] then
        start = '(' .. fields['last-delivered-id']
        lag = fields['lag']
      end
    end
  end
  local entries = redis.call('XRANGE', stream, start, '+', 'COUNT', ARGV[2])
  local tokens = 0
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    for j = 1, #fields, 2 do
      if fields[j] == '{TOKENS_FIELD.decode()}' then tokens = tokens + tonumber(fields[j + 1]) end
    end
  end
  if type(lag) ~= 'number' then lag = (start == '-') and redis.call('XLEN', stream) or #entries end
  out[i] = {{tokens, #entries, lag}}
end
return out
"""
