"""Running the Lua scripts of the Redis contract (``queues.fencing``, ``queues.requests``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

_registered: weakref.WeakKeyDictionary[aioredis.Redis, dict[str, AsyncScript]] = weakref.WeakKeyDictionary()

Arg = bytes | str | int


def _script(redis: aioredis.Redis, source: str) -> AsyncScript:
    scripts = _registered.setdefault(redis, {})
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = redis.register_script(source)
    return script


async def run(redis: aioredis.Redis, source: str, keys: list[str], args: list[Any]) -> Any:
    """Run the Lua ``source`` on ``redis`` (EVALSHA, loading it once per client)."""
    return await _script(redis, source)(keys=keys, args=args)


async def run_packed(redis: aioredis.Redis, source: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
    """``run`` for a call with hundreds of arguments (the output writer's, once per round trip): the
    command is packed here, at a third of what redis-py's general packer costs per argument, and sent
    on a connection of ``redis`` as redis-py would (connecting, or reconnecting to the primary the
    Sentinels name, on the way; a failed or cancelled read drops the connection)."""
    packed = pack_call(redis, source, keys, args)
    try:
        return await execute_packed(redis, packed)
    except NoScriptError:
        await redis.script_load(source)  # a new primary, or a flushed script cache
        return await execute_packed(redis, packed)


def pack_call(redis: aioredis.Redis, source: str, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
    """The EVALSHA of ``source`` packed, to be sent with other commands (``execute_packed_all``); a
    ``NoScriptError`` from it is the caller's to answer (load the script, then send again)."""
    return pack_command((b"EVALSHA", _script(redis, source).sha, len(keys), *keys, *args))


def pack_command(args: Sequence[Arg]) -> bytes:
    """A command in RESP, as redis-py's ``Connection.pack_command`` writes it (bytes as they are, text
    as UTF-8, integers in decimal), by hiredis's packer in C: half the cost of packing it in Python, a
    twelfth of the worker's CPU at a GPU's step rate before."""
    # hiredis's stub types the argument as a tuple of one item and leaves the result untyped.
    packed: bytes = hiredis.pack_command(tuple(args))  # type: ignore[arg-type]
    return packed


async def execute_packed(redis: aioredis.Redis, packed: bytes) -> Any:
    """Send one packed command on ``redis``'s own connection (a single-connection client) or on one from
    its pool, and read its reply (an error reply is raised). redis-py's lock around a single connection
    is not taken: such a client must have one caller at a time (the output writer's has: one write in
    flight, nothing else on it)."""
    return (await execute_packed_all(redis, packed, num_replies=1))[0]


async def execute_packed_all(redis: aioredis.Redis, packed: bytes, *, num_replies: int) -> list[Any]:
    """``execute_packed`` for several commands packed one after another (a pipeline without redis-py's
    pipeline object): every reply is read, so the connection stays in step, and the first error reply
    is raised after. A connection error or a cancelled read drops the connection (redis-py's
    ``read_response`` does), so a reply left unread never reaches the next caller."""
    await redis.initialize()
    own = redis.connection
    connection = own or await redis.connection_pool.get_connection()
    try:
        await connection.send_packed_command(packed)
        replies: list[Any] = []
        failed: ResponseError | None = None
        for _ in range(num_replies):
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                failed = failed or exc
                replies.append(exc)
        if failed is not None:
            raise failed
        return replies
    finally:
        if own is None:
            await redis.connection_pool.release(connection)
