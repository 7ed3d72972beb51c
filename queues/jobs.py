"""The Redis contract of batch jobs, between the API and the jobs process (``jobs/``): the arq payload
and serializer, chunking, chunk answers, and the job's progress record in Redis.

Decisions:

- arq moves jobs as JSON (orjson), never pickle. A payload holds only JSON types; an exception in a
  failed job's result is stored as ``{"exc_type", "message"}`` and rebuilt on read from a fixed set of
  types (``asyncio.CancelledError`` for an aborted job, ``JobFailedError`` for anything else), so arq's
  own ``Job.result()`` and ``Job.abort()`` keep working and nothing read from Redis is unpickled.
- The API splits the log into chunks to validate them (each chunk's prompt must fit the context); the
  payload carries the lines and options, and the runner splits them again with the same function.
- ``tc:job:{id}`` is written by the API before the arq job exists, so a job id is only known to the
  deployment (key prefix) that accepted it; arq's result decides the final status, the hash carries
  progress and the status before there is a result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import redis.asyncio as aioredis
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix

from queues import scripts
from queues.connection import connection_pool, reply
from queues.keys import Keys
from tailcut.errors import JobFailedError
from tailcut.settings import RedisEndpoint

# Name of the arq job function (registered by the jobs process, enqueued by the API).
JOB_FUNCTION = "analyze_logs"
# arq drops a job nobody started within a day (its ``expires_extra_ms``); the progress hash lives
# at least that long plus the run time and the result TTL.
ARQ_START_WINDOW_S = 86_400

JobStatus = Literal["queued", "running", "complete", "failed", "aborted"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"complete", "failed", "aborted"})


@dataclass(slots=True)
class Chunk:
    index: int
    first_line: int  # 1-based, in the whole log
    lines: list[str]

    @property
    def last_line(self) -> int:
        return self.first_line + len(self.lines) - 1


@dataclass(slots=True)
class JobSpec:
    """The arq payload of a job: everything the runner needs, JSON types only."""

    lines: list[str]
    instruction: str
    chunk_lines: int
    max_tokens: int
    temperature: float = 0.0
    tenant: str | None = None
    ignore_eos: bool = False
    reduce: bool = False

    def to_payload(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_payload(cls, raw: dict[str, Any]) -> JobSpec:
        return cls(**raw)

    def chunks(self) -> list[Chunk]:
        return split_chunks(self.lines, self.chunk_lines)

    @property
    def num_requests(self) -> int:
        """Requests the job runs: one per chunk, plus the combining one with ``reduce``."""
        return len(self.chunks()) + int(self.reduce)


def split_chunks(lines: list[str], chunk_lines: int) -> list[Chunk]:
    return [
        Chunk(index=number, first_line=start + 1, lines=lines[start : start + chunk_lines])
        for number, start in enumerate(range(0, len(lines), chunk_lines))
    ]


@dataclass(slots=True)
class Answer:
    """How one request of a job ended."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def error(self) -> dict[str, str | None] | None:
        return None if self.ok else {"code": self.error_code, "message": self.error_message}

    def dumps(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def loads(cls, data: bytes) -> Answer:
        return cls(**orjson.loads(data))


# --- arq serializer: JSON, never pickle ---------------------------------------------------------------

EXC_TYPE = "exc_type"


def _encode(value: Any) -> Any:
    if isinstance(value, BaseException):
        return {EXC_TYPE: type(value).__name__, "message": str(value)}
    raise TypeError(f"{type(value).__name__} cannot travel in an arq job (JSON only)")


def dumps_job(data: dict[str, Any]) -> bytes:
    """arq ``job_serializer``: job definitions and results as JSON."""
    return orjson.dumps(data, default=_encode)


def loads_job(data: bytes) -> dict[str, Any]:
    """arq ``job_deserializer``: a failed result's exception comes back as one of two known types."""
    raw: dict[str, Any] = orjson.loads(data)
    result = raw.get("r")
    if raw.get("s") is False and isinstance(result, dict) and EXC_TYPE in result:
        raw["r"] = rebuild_exception(result)
    return raw


def rebuild_exception(encoded: dict[str, Any]) -> BaseException:
    message = str(encoded.get("message", ""))
    if encoded[EXC_TYPE] == "CancelledError":
        return asyncio.CancelledError(message)
    return JobFailedError(f"{encoded[EXC_TYPE]}: {message}" if message else str(encoded[EXC_TYPE]))


def connect_arq(endpoint: str | RedisEndpoint, *, queue_name: str, timeout_s: float) -> ArqRedis:
    """An arq client with the JSON serializer, directly or through Sentinel as ``endpoint`` says. Built
    directly rather than with ``arq.create_pool``, which pings (and retries for seconds) at creation:
    the API starts while Redis is down and answers 503s until it is back. Close with
    ``aclose(close_connection_pool=True)``."""
    pool = connection_pool(
        endpoint, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=30
    )
    return ArqRedis(pool, job_serializer=dumps_job, job_deserializer=loads_job, default_queue_name=queue_name)


# --- progress record ----------------------------------------------------------------------------------


@dataclass(slots=True)
class JobProgress:
    status: JobStatus
    num_chunks: int
    total: int
    done: int
    failed: int
    created_ms: int
    error: str | None
    abort_requested: bool
    tenant: str = ""  # who submitted it ("" for a job stored before tenants were recorded)


def now_ms() -> int:
    return int(time.time() * 1000)


class JobStore:
    """A job's status and counters (``tc:job:{id}``) and its finished chunk answers (``tc:job:{id}:chunks``).

    ``done`` counts requests that answered, ``failed`` those that ended with an error; the job is
    finished when ``done + failed == total``.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def create(self, job_id: str, *, num_chunks: int, total: int, ttl_s: int, tenant: str = "") -> None:
        key = self._keys.job(job_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "status": "queued",
                    "num_chunks": num_chunks,
                    "total": total,
                    "done": 0,
                    "failed": 0,
                    "created_ms": now_ms(),
                    "tenant": tenant,
                },
            )
            pipe.expire(key, ttl_s)
            await pipe.execute()

    async def read(self, job_id: str) -> JobProgress | None:
        raw: dict[bytes, bytes] = await reply(self._redis.hgetall(self._keys.job(job_id)))
        if not raw:
            return None
        fields = {key.decode(): value.decode() for key, value in raw.items()}
        return JobProgress(
            status=fields.get("status", "queued"),  # type: ignore[arg-type]
            num_chunks=int(fields.get("num_chunks", 0)),
            total=int(fields.get("total", 0)),
            done=int(fields.get("done", 0)),
            failed=int(fields.get("failed", 0)),
            created_ms=int(fields.get("created_ms", 0)),
            error=fields.get("error"),
            abort_requested=fields.get("abort_requested") == "1",
            tenant=fields.get("tenant", ""),
        )

    async def request_abort(self, job_id: str) -> None:
        """Mark the job so its runner tells an abort apart from its jobs process stopping."""
        await reply(self._redis.hset(self._keys.job(job_id), "abort_requested", "1"))

    async def mark_running(self, job_id: str, *, done: int, failed: int, attempt: int, runner: str) -> None:
        mapping = {
            "status": "running", "done": done, "failed": failed, "attempt": attempt, "started_ms": now_ms(),
            "runner": runner,
        }  # fmt: skip
        await reply(self._redis.hset(self._keys.job(job_id), mapping=mapping))

    async def set_status(self, job_id: str, status: JobStatus, *, error: str | None = None) -> None:
        mapping: dict[str, str | int] = {"status": status}
        if error is not None:
            mapping["error"] = error
        await reply(self._redis.hset(self._keys.job(job_id), mapping=mapping))

    async def record(self, job_id: str, index: int, answer: Answer, *, ttl_s: int) -> None:
        """Keep one finished chunk (for a re-run of the job) and count it."""
        chunks = self._keys.job_chunks(job_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(chunks, mapping={str(index): answer.dumps()})
            pipe.expire(chunks, ttl_s)
            pipe.hincrby(self._keys.job(job_id), "done" if answer.ok else "failed", 1)
            await pipe.execute()

    async def count(self, job_id: str, answer: Answer) -> None:
        """Count a request that is not a chunk (the combining one)."""
        await reply(self._redis.hincrby(self._keys.job(job_id), "done" if answer.ok else "failed", 1))

    async def answers(self, job_id: str) -> dict[int, Answer]:
        raw: dict[bytes, bytes] = await reply(self._redis.hgetall(self._keys.job_chunks(job_id)))
        return {int(index): Answer.loads(value) for index, value in raw.items()}

    async def finish(self, job_id: str, status: JobStatus, *, ttl_s: int, error: str | None = None) -> None:
        """Record the final status; the chunk answers are now in arq's result and are dropped."""
        key = self._keys.job(job_id)
        mapping: dict[str, str | int] = {"status": status, "finished_ms": now_ms()}
        if error is not None:
            mapping["error"] = error
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, ttl_s)
            pipe.delete(self._keys.job_chunks(job_id))
            await pipe.execute()


# --- runner leases: a job held by a jobs process that is gone runs again at once ------------------------

# Deletes a job's arq in-progress mark when the jobs process that holds it is gone, so arq runs the job
# again now instead of after its in-progress timeout (the job's timeout, hours). KEYS: in-progress
# mark, job record. ARGV: the runner lease key prefix, the mark's full life (ms), how old it must be
# (ms) before it is judged: a run that has just started has not named its runner yet. Returns 1 when
# the mark was dropped.
RECLAIM_JOB = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
if tonumber(ARGV[2]) - ttl < tonumber(ARGV[3]) then return 0 end
local runner = redis.call('HGET', KEYS[2], 'runner')
if runner and redis.call('EXISTS', ARGV[1] .. runner) == 1 then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], 'status', 'queued') end
return 1
"""

# Jobs looked at per reclaim pass (the oldest in the queue).
RECLAIM_SCAN = 1000


class JobLeases:
    """A jobs process's lease, renewed every ``beat_s`` and lasting ``LEASE_BEATS`` of them, and the
    reclaim of jobs whose runner's lease is gone (killed, or stopped while Redis was away)."""

    LEASE_BEATS = 5

    def __init__(self, redis: aioredis.Redis, keys: Keys, runner_id: str, *, beat_s: float, in_progress_s: float):
        self._redis = redis
        self._keys = keys
        self.runner_id = runner_id
        self._beat_s = beat_s
        self._in_progress_ms = int(in_progress_s * 1000)

    @property
    def lease_ms(self) -> int:
        return int(self.LEASE_BEATS * self._beat_s * 1000)

    async def renew(self) -> None:
        await self._redis.set(self._keys.jobs_runner(self.runner_id), b"1", px=self.lease_ms)

    async def release(self) -> None:
        await self._redis.delete(self._keys.jobs_runner(self.runner_id))

    async def reclaim(self) -> list[str]:
        """Ids of the queued jobs whose in-progress mark named a runner without a lease, now runnable."""
        members = await self._redis.zrangebyscore(self._keys.arq_queue, "-inf", "+inf", start=0, num=RECLAIM_SCAN)
        reclaimed = []
        for member in members:
            job_id = member.decode() if isinstance(member, bytes) else str(member)
            dropped = await scripts.run(
                self._redis,
                RECLAIM_JOB,
                [in_progress_key_prefix + job_id, self._keys.job(job_id)],
                [self._keys.jobs_runner(""), self._in_progress_ms, 2 * self.lease_ms],
            )
            if dropped:
                reclaimed.append(job_id)
        return reclaimed
