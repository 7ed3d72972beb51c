"""The compose stack's Redis (``deploy/redis``: a user per role, ``default`` off, AOF, noeviction), started
outside Docker through its own entrypoint, and each role doing what its process does through its own
user: the API's admission, replies, resumes and arq client; a worker's consumer group, fenced Lua
scripts, take-over, heartbeats and breakers; the jobs process's arq worker and job store; then the
real API, a worker (zero-cost engine) and the jobs process together. Redis records every command, key
or channel an ACL refuses (``ACL LOG``), also those a background loop would only log: after each test
that log must be empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from arq.constants import abort_jobs_ss
from arq.jobs import Job, JobStatus
from arq.worker import func
from redis.exceptions import AuthenticationError, NoPermissionError

from admission.shedding import Backlog
from api.settings import ApiSettings
from api.status import live_workers
from bench.sse import sse_lines
from jobs.arq_worker import JobsWorker, build_worker, close_worker, run_worker
from jobs.runner import JobRunner
from jobs.settings import JobsSettings
from queues import dlq, drain, events, intake, output, requests
from queues.apikeys import KeyStore
from queues.breakers import read_breakers, reset_breaker
from queues.connection import check_redis, connect, connect_blocking
from queues.jobs import JOB_FUNCTION, Answer, JobLeases, JobStore, connect_arq, loads_job
from queues.keys import WORKER_GROUP, Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter, read_output
from queues.replies import ReplyRouter
from queues.requests import RequestRecord
from tailcut.processes import free_port, start_child, stop_child
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.sse import DONE
from tests.sse import frames as sse_frames
from tests.stack import running_api, running_workers
from workers.breakers import BreakerConfig, Breakers
from workers.engines.factory import start_engine
from workers.settings import EngineSettings, WorkerSettings

ENTRYPOINT = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "entrypoint.sh"
PASSWORDS = {
    "api": "api-test-password",
    "worker": "worker-test-password",
    "jobs": "jobs-test-password",
    "healthcheck": "healthcheck-test-password",
    "admin": "admin-test-password",
}
# The key prefix the ACL patterns are written for (the default one).
KEYS = Keys()
# redis-py sends CLIENT SETINFO at connect and ignores the refusal (Redis 7.2+; unknown before).
IGNORED_DENIALS = {"client|setinfo"}


@dataclass
class AclRedis:
    port: int
    folder: Path

    def url(self, user: str | None, password: str | None = None) -> str:
        if user is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"redis://{user}:{password or PASSWORDS[user]}@127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """redis-server started by deploy/redis/entrypoint.sh with the stack's redis.conf and ACL template."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server): the ACL needs a real Redis")
    folder = tmp_path_factory.mktemp("redis-acl")
    server = AclRedis(free_port(), folder)
    env = {f"REDIS_{role.upper()}_PASSWORD": password for role, password in PASSWORDS.items()}
    env |= {"PATH": "/usr/local/bin:/usr/bin:/bin", "REDIS_ACL_FILE": str(folder / "users.acl"), "REDIS_SERVER": binary}
    argv = ["sh", str(ENTRYPOINT), "--port", str(server.port), "--bind", "127.0.0.1", "--dir", str(folder)]
    child = start_child("redis-acl", argv, env, log_path=folder / "redis.log")
    admin = redis.Redis.from_url(server.url("admin"), socket_connect_timeout=1)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert child.process.poll() is None, f"redis did not start: {child.log_tail()}"
                assert time.monotonic() < deadline, f"redis did not answer: {child.log_tail()}"
                time.sleep(0.05)
        yield server
    finally:
        admin.close()
        stop_child(child, timeout_s=10)


@pytest.fixture
async def admin(acl_redis: AclRedis) -> AsyncIterator[aioredis.Redis]:
    """An empty Redis with an empty ACL log, for the test; the admin user's client."""
    client = connect(acl_redis.url("admin"), timeout_s=2.0)
    await client.flushall()
    await client.acl_log_reset()
    yield client
    await client.aclose()


async def denials(admin: aioredis.Redis) -> list[dict[str, Any]]:
    """What the ACL refused since the log was reset (but CLIENT SETINFO, which redis-py ignores)."""
    entries = []
    for entry in await admin.acl_log(count=1000):  # ACL LOG shows 10 entries unless asked
        decoded = {text(key): text(value) for key, value in entry.items()}
        if decoded.get("reason") != "auth" and decoded.get("object") not in IGNORED_DENIALS:
            entries.append(decoded)
    return entries


def text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


@contextlib.asynccontextmanager
async def clients(acl_redis: AclRedis, user: str) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    """A role's two clients, as its process makes them: short commands, and blocking reads and pub/sub."""
    short = connect(acl_redis.url(user), timeout_s=2.0)
    blocking = connect_blocking(acl_redis.url(user), block_s=1.0, connect_timeout_s=2.0)
    try:
        yield short, blocking
    finally:
        await blocking.aclose()
        await short.aclose()


def message(request_id: str, *, tier: str = "normal", bucket: str = "short", reply_to: str = "api-1") -> RequestMessage:
    return RequestMessage(
        id=request_id,
        tenant="t",
        tier=tier,  # type: ignore[arg-type]
        bucket=bucket,  # type: ignore[arg-type]
        prompt_token_ids=[5, 6, 7],
        sampling=SamplingSpec(max_tokens=4),
        predicted_output_tokens=4,
        enqueued_at_ms=int(time.time() * 1000),
        deadline_ms=int(time.time() * 1000) + 60_000,
        reply_to=reply_to,
    )


async def until_terminal(stream: Any) -> list[OutputEvent]:
    async with asyncio.timeout(10):
        return [event async for event in stream.events()]


# --- the server and who may connect --------------------------------------------------------------------


async def test_the_stack_redis_runs_its_configuration(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    config = await admin.config_get("appendonly")
    config |= await admin.config_get("appendfsync")
    config |= await admin.config_get("maxmemory-policy")
    assert {text(key): text(value) for key, value in config.items()} == {
        "appendonly": "yes",
        "appendfsync": "everysec",
        "maxmemory-policy": "noeviction",
    }
    users = {text(user) for user in await admin.acl_users()}
    assert users == {"default", *PASSWORDS}
    assert "off" in [text(flag) for flag in (await admin.acl_getuser("default"))["flags"]]
    # Every role passes the check each tailcut process makes at start (INFO memory: noeviction).
    for role in ("api", "worker", "jobs"):
        async with clients(acl_redis, role) as (short, _blocking):
            await check_redis(short)
    assert not (acl_redis.folder / "users.acl").read_text().count("password"), "passwords are stored hashed"


async def test_nobody_connects_without_a_user_and_password(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    anonymous = connect(acl_redis.url(None), timeout_s=2.0)
    try:
        with pytest.raises(AuthenticationError, match="Authentication required"):
            await anonymous.ping()
    finally:
        await anonymous.aclose()
    for url in (acl_redis.url("default", "anything"), acl_redis.url("api", "wrong-password")):
        wrong = connect(url, timeout_s=2.0)
        try:
            with pytest.raises(AuthenticationError):
                await wrong.ping()
        finally:
            await wrong.aclose()
    healthcheck = connect(acl_redis.url("healthcheck"), timeout_s=2.0)
    try:
        assert await healthcheck.ping()
        with pytest.raises(NoPermissionError):
            await healthcheck.get(KEYS.workers)
    finally:
        await healthcheck.aclose()


async def test_each_role_is_refused_what_it_does_not_use(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    refused: list[tuple[str, str]] = [
        ("api", "FLUSHALL"),
        ("api", "CONFIG GET maxmemory"),
        ("api", "KEYS *"),
        ("api", "GET other:key"),
        ("api", f"XACK {KEYS.intake('normal', 'short')} {WORKER_GROUP} 0-1"),
        ("worker", f"GET {KEYS.request('r1')}"),
        ("worker", "GET arq:job:j1"),
        ("worker", "ACL LIST"),
        ("jobs", f"XREADGROUP GROUP {WORKER_GROUP} c STREAMS {KEYS.intake('normal', 'short')} >"),
        ("jobs", "SHUTDOWN"),
    ]
    for role, command in refused:
        async with clients(acl_redis, role) as (short, _blocking):
            with pytest.raises(NoPermissionError):
                await short.execute_command(*command.split())
    async with clients(acl_redis, "api") as (_short, blocking):
        async with blocking.pubsub() as pubsub:
            with pytest.raises(NoPermissionError):
                await pubsub.subscribe("other-channel")
                await pubsub.get_message(timeout=1.0)
    assert len(await denials(admin)) == len(refused) + 1


# --- each role's own calls -------------------------------------------------------------------------------


async def test_the_api_user_admits_replies_resumes_and_submits_jobs(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    async with clients(acl_redis, "api") as (api, api_blocking), clients(acl_redis, "worker") as (worker, _):
        # The reply channel, subscribed as the API (pub/sub), hears what a worker writes.
        router = ReplyRouter(api, api_blocking, KEYS, "api-1", poll_max_s=1.0)
        await router.start(wait_s=5.0)
        assert router.ready
        try:
            # Admission: an idempotency key claimed with the record, the intake entry, a plain one.
            record = RequestRecord(id="r1", tenant="t", route="chat", model="m", resumable=True)
            assert await requests.claim(api, KEYS, record, "key-1", ttl_s=60) is None
            again = RequestRecord(id="r2", tenant="t", route="chat", model="m", resumable=True)
            holder = await requests.claim(api, KEYS, again, "key-1", ttl_s=60)
            assert holder is not None and holder.id == "r1"
            stream = router.open("r1")
            await requests.enqueue(api, KEYS, message("r1"), record, ttl_s=60)
            await requests.enqueue(
                api, KEYS, message("r4"), RequestRecord(id="r4", tenant="t", route="chat", model="m"), ttl_s=60
            )
            await intake.enqueue(api, KEYS, message("r3", tier="realtime"))
            assert (await requests.load(api, KEYS, "r1")) == record
            assert await requests.attach(api, KEYS, "r1", ttl_s=60) == 1
            assert await requests.attachments(api, KEYS, "r1") == 1
            await requests.release(api, KEYS, again, "key-2")
            # Shedding's probe (XINFO GROUPS, XLEN, XRANGE and TIME for the oldest entry's wait, the
            # queued-tokens script), readiness, breakers.
            backlog = Backlog(api, KEYS, interval_s=0.1)
            await asyncio.sleep(0.02)
            await backlog.probe()
            assert backlog.depth["normal", "short"] == 2 and backlog.depth["realtime", "short"] == 1
            assert backlog.oldest_wait_ms("normal") >= 20
            await intake.ensure_groups(worker, KEYS)
            await backlog.probe()
            assert await api.zcount(KEYS.workers, time.time(), "+inf") == 0
            assert set(await read_breakers(api, KEYS)) == {"realtime", "normal", "background"}

            # A worker's fenced write: live on the API's channel, durable for gap fill and resumes.
            writer = OutputWriter(worker, KEYS, ttl_s=60)
            writer.start()
            writer.emit("api-1", OutputEvent(rid="r1", seq=1, type="chunk", text="hi"))
            writer.emit("api-1", OutputEvent(rid="r1", seq=2, type="final", finish_reason="stop"))
            await writer.flush()
            await writer.close()
            assert [event.seq for event in await until_terminal(stream)] == [1, 2]
            stream.close()
            assert [event.seq for event in await read_output(api, KEYS, "r1", from_seq=1)] == [1, 2]
            async with asyncio.timeout(10):
                followed = [batch async for batch in output.follow_output(api_blocking, KEYS, "r1", after_seq=0)]
            assert followed[-1][-1].type == "final"

            # Cancelling (tombstone + broadcast) and the operators' event stream.
            await output.cancel(api, KEYS, "r3", ttl_s=60)
            assert await admin.exists(KEYS.cancelled("r3"))
            await events.publish(api, KEYS, {"type": "event_loop_lag", "lag_ms": 120}, source={"api": "api-1"})
            assert await admin.xlen(KEYS.events) == 1, "events.publish logs a refusal instead of raising"

            # Batch jobs: the progress record, arq's queue, status, abort.
            store = JobStore(api, KEYS)
            await store.create("j1", num_chunks=1, total=1, ttl_s=60)
            arq = connect_arq(acl_redis.url("api"), queue_name=KEYS.arq_queue, timeout_s=2.0)
            try:
                assert await arq.enqueue_job(JOB_FUNCTION, {"lines": ["x"]}, _job_id="j1") is not None
                assert await arq.enqueue_job(JOB_FUNCTION, {"lines": ["x"]}, _job_id="j1") is None, "one job per id"
                job = Job("j1", arq, _queue_name=KEYS.arq_queue, _deserializer=loads_job)
                assert await job.status() == JobStatus.queued
                assert await job.result_info() is None and await job.info() is not None
                await store.request_abort("j1")
                with pytest.raises(TimeoutError):
                    await job.abort(timeout=0.1, poll_delay=0.05)
                await arq.zrem(abort_jobs_ss, "j1")
            finally:
                await arq.aclose(close_connection_pool=True)
            progress = await store.read("j1")
            assert progress is not None and progress.abort_requested
            await store.finish("j1", "aborted", ttl_s=60)
        finally:
            await router.stop()
    assert not await denials(admin)


async def test_the_worker_user_consumes_writes_takes_over_and_trips_breakers(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    async with clients(acl_redis, "worker") as (worker, worker_blocking), clients(acl_redis, "api") as (api, _):
        for request_id in ("r1", "r2", "r3", "r4", "r5"):
            await intake.enqueue(api, KEYS, message(request_id))
        stream = KEYS.intake("normal", "short")
        await intake.ensure_groups(worker, KEYS)
        await intake.ensure_groups(worker, KEYS)  # BUSYGROUP: already there
        # Reads (blocking and not), each delivery fenced (the first under the token drawn at intake, the
        # others fenced again by the worker); claims kept; fenced output; ack.
        first = await intake.read(
            worker_blocking, KEYS, "w1", [stream], count=1, block_ms=100, trusted_from_ms=lambda: 0
        )
        taken = first + await intake.read(worker, KEYS, "w1", [stream], count=4, block_ms=None)
        assert [entry.message.id for entry in taken] == ["r1", "r2", "r3", "r4", "r5"]
        assert [entry.fence for entry in taken] == [1, 2, 2, 2, 2]
        assert await intake.keep_claimed(worker, KEYS, "w1", taken) == []
        writer = OutputWriter(worker, KEYS, ttl_s=60)
        writer.start()
        writer.emit("api-1", OutputEvent(rid="r1", seq=1, type="final"), fence=taken[0].fence)
        await writer.close()
        assert [event.type for event in await read_output(worker, KEYS, "r1", from_seq=1)] == ["final"]
        assert await intake.ack(worker, KEYS, taken[0])
        # A continuation handed back, a dead letter.
        assert await intake.requeue(worker, KEYS, taken[1], taken[1].message) is not None
        assert await intake.dead_letter(worker, KEYS, taken[2], "expired")
        assert await admin.xlen(KEYS.dead_letter) == 1
        # Another worker takes over w1's entries (its heartbeat stopped), and an idle one by age.
        assert await intake.has_pending(worker, stream, "w1")
        moved = await intake.take_over(worker, KEYS, "w2", "w1", stream, min_idle_ms=0, count=1)
        await intake.fence(worker, KEYS, moved)
        assert [entry.message.id for entry in moved] == ["r4"] and moved[0].fence == 3
        reclaimed = await intake.reclaim(worker, KEYS, "w3", stream, min_idle_ms=0, count=10)
        assert {entry.message.id for entry in reclaimed} >= {"r5"}
        assert stream in await intake.backlog(worker, [stream])
        # Heartbeats, the dead worker's removal, a cancel tombstone.
        await worker.zadd(KEYS.workers, {"w1": time.time() - 10, "w2": time.time() + 2})
        assert await worker.zrangebyscore(KEYS.workers, 0, time.time()) == [b"w1"]
        async with worker.pipeline(transaction=False) as pipe:
            pipe.zrem(KEYS.workers, "w1")
            pipe.xgroup_delconsumer(stream, WORKER_GROUP, "w1")
            await pipe.execute()
        assert not await worker.exists(KEYS.cancelled("r5"))

        # The cancel broadcast reaches a worker's subscription.
        async with worker_blocking.pubsub() as pubsub:
            await pubsub.subscribe(KEYS.cancel_channel)
            heard: list[dict[str, Any]] = []
            async with asyncio.timeout(5):
                while not heard or heard[-1]["type"] != "message":
                    found = await pubsub.get_message(timeout=1.0)
                    if found is not None:
                        heard.append(found)
                        if found["type"] == "subscribe":
                            await output.cancel(api, KEYS, "r5", ttl_s=60)
            assert heard[-1]["data"] == b"r5"

        # The breakers: realtime's consecutive rule (a script), the windows, the evaluation lock.
        signals: list[str] = []

        async def on_event(kind: str, **_fields: object) -> None:
            signals.append(kind)
            await events.publish(worker, KEYS, {"type": kind}, source={"worker": "w2"})

        config = BreakerConfig(realtime_trip_count=2, min_samples=1, normal_p99_ms=10, evaluate_interval_s=0.2)
        breakers = Breakers(worker, KEYS, config, events=on_event)
        now_ms = int(time.time() * 1000)
        for index in range(2):
            await breakers.record("realtime", ttft_ms=900, e2e_ms=900, request_id=f"rt{index}", now_ms=now_ms)
        await breakers.record("normal", ttft_ms=500, e2e_ms=900, request_id="n1", now_ms=now_ms)
        await breakers.evaluate(now_ms + 1)
        views = await breakers.refresh()
        assert (views["realtime"].state, views["normal"].state) == ("open", "open")
        await breakers.evaluate_now(now_ms + int(config.realtime_open_s * 1000) + 1)
        assert (await breakers.refresh())["realtime"].state == "half_open"
        await breakers.close()
        assert "breaker_open" in signals and await admin.xlen(KEYS.events) >= 2
    assert not await denials(admin)


async def test_the_api_user_runs_the_admin_routes_and_tailcut_keys(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    """What the admin routes send (a drain request, the dead-letter stream and a replay, a breaker reset),
    the worker taking its drain request, and `tailcut keys` run in the api container."""
    async with clients(acl_redis, "api") as (api, _), clients(acl_redis, "worker") as (worker, _):
        # A drain: the API asks a live worker, the worker's heartbeat takes it.
        await worker.zadd(KEYS.workers, {"w1": time.time() + 2})
        assert await drain.request_drain(api, KEYS, "w1") and not await drain.request_drain(api, KEYS, "w2")
        assert await drain.take_drain_request(worker, KEYS, "w1")
        assert [row["id"] for row in await live_workers(api, KEYS)] == ["w1"]
        # A dead letter, listed and replayed by the API.
        record = RequestRecord(id="d1", tenant="t", route="chat", model="m")
        await requests.enqueue(api, KEYS, message("d1"), record, ttl_s=60)
        await intake.ensure_groups(worker, KEYS)
        (entry,) = await intake.read(worker, KEYS, "w1", [KEYS.intake("normal", "short")], count=1, block_ms=None)
        writer = OutputWriter(worker, KEYS, ttl_s=60)
        writer.start()
        writer.emit("api-1", OutputEvent(rid="d1", seq=1, type="error", error_code="expired"), fence=entry.fence)
        await writer.close()
        assert await intake.dead_letter(worker, KEYS, entry, "expired")
        total, (dead,) = await dlq.dead_letters(api, KEYS, limit=10)
        assert total == 1 and dead.message.id == "d1"
        replayed = await dlq.replay(api, KEYS, dead.entry_id, now_ms=int(time.time() * 1000), ttl_s=60)
        assert not isinstance(replayed, str) and replayed.error_seq == 1
        assert await dlq.replay(api, KEYS, dead.entry_id, now_ms=int(time.time() * 1000), ttl_s=60) == "unknown"
        # A breaker reset.
        await worker.hset(KEYS.breaker("realtime"), mapping={"state": "open", "since_ms": 1, "reason": "slow"})
        before = await reset_breaker(api, KEYS, "realtime", now_ms=2, reason="reset by an operator")
        assert before.state == "open" and (await read_breakers(api, KEYS))["realtime"].state == "closed"
        await events.publish(api, KEYS, {"type": "breaker_reset", "tier": "realtime"}, source={"api": "api-1"})
        assert await admin.xlen(KEYS.events) == 1, "events.publish logs a refusal instead of raising"
        # `docker compose exec api tailcut keys create|list|revoke` runs on the api user.
        store = KeyStore(api, KEYS, "a-secret")
        key, created = await store.create("ops", admin=True)
        assert (await store.verify(key)) is not None and [found.key_id for found in await store.list()] == [
            created.key_id
        ]
        assert await store.revoke(created.key_id)
    assert not await denials(admin)


async def test_the_jobs_user_runs_arq_jobs_and_their_requests(acl_redis: AclRedis, admin: aioredis.Redis) -> None:
    ran: list[str] = []

    async def analyze(ctx: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
        ran.append(ctx["job_id"])
        if payload.get("slow"):
            await asyncio.sleep(30)
        return {"ok": True}

    async with clients(acl_redis, "jobs") as (jobs, jobs_blocking), clients(acl_redis, "api") as (api, _):
        await check_redis(jobs)
        # What the runner does for a chunk: enqueue it, hear its reply, record and count it, cancel.
        router = ReplyRouter(jobs, jobs_blocking, KEYS, "jobs-1", poll_max_s=1.0)
        await router.start(wait_s=5.0)
        assert router.ready
        await intake.enqueue(jobs, KEYS, message("c1", tier="background", bucket="medium", reply_to="jobs-1"))
        assert await router.read("c1", from_seq=1) == []
        await router.stop()
        await output.cancel(jobs, KEYS, "c1", ttl_s=60)
        store = JobStore(api, KEYS)
        await store.create("j1", num_chunks=1, total=2, ttl_s=60)
        runner_store = JobStore(jobs, KEYS)
        assert await jobs.exists(KEYS.job("j1"))
        await runner_store.mark_running("j1", done=0, failed=0, attempt=1, runner="jobs-1")
        # Its lease, and the reclaim of jobs whose runner is gone (the Lua script's calls).
        leases = JobLeases(jobs, KEYS, "jobs-1", beat_s=1.0, in_progress_s=60)
        await leases.renew()
        assert await leases.reclaim() == []
        await leases.release()
        await runner_store.record("j1", 0, Answer(text="fine"), ttl_s=60)
        await runner_store.count("j1", Answer(error_code="expired", error_message="late"))
        assert (await runner_store.answers("j1"))[0].text == "fine"
        await runner_store.set_status("j1", "running")
        await runner_store.finish("j1", "complete", ttl_s=60)

        # arq: the API enqueues, the jobs process's arq worker runs one job and has another aborted.
        api_arq = connect_arq(acl_redis.url("api"), queue_name=KEYS.arq_queue, timeout_s=2.0)
        jobs_arq = connect_arq(acl_redis.url("jobs"), queue_name=KEYS.arq_queue, timeout_s=2.0)
        worker = JobsWorker(
            functions=[func(analyze, name=JOB_FUNCTION, max_tries=2)],
            queue_name=KEYS.arq_queue,
            redis_pool=jobs_arq,
            handle_signals=False,
            poll_delay=0.05,
            keep_result=60,
            allow_abort_jobs=True,
            job_serializer=jobs_arq.job_serializer,
            job_deserializer=jobs_arq.job_deserializer,
            log_results=False,
        )
        task = asyncio.create_task(run_worker(worker))
        try:
            done = await api_arq.enqueue_job(JOB_FUNCTION, {"slow": False}, _job_id="a1")
            assert done is not None
            assert await done.result(timeout=10, poll_delay=0.05) == {"ok": True}
            slow = await api_arq.enqueue_job(JOB_FUNCTION, {"slow": True}, _job_id="a2")
            assert slow is not None
            async with asyncio.timeout(10):
                while "a2" not in ran:
                    await asyncio.sleep(0.02)
            assert await slow.status() == JobStatus.in_progress
            assert await slow.abort(timeout=10, poll_delay=0.05)
        finally:
            await close_worker(worker, jobs_arq)
            await asyncio.gather(task, return_exceptions=True)
            await api_arq.aclose(close_connection_pool=True)
    assert ran == ["a1", "a2"]
    assert not await denials(admin)


async def test_api_and_jobs_users_wait_for_a_replica_and_withdraw_what_none_confirmed(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    """TAILCUT_INTAKE_DURABILITY=replica (the Kubernetes gpu-ha overlay): the enqueue ends in ``WAIT 1``;
    this Redis has no replica, so none confirms and the entry is withdrawn (tombstone, cancel, XDEL, the
    record deleted), by the API (a request with its record) and by the jobs process (a chunk)."""
    async with clients(acl_redis, "api") as (api, _), clients(acl_redis, "jobs") as (jobs, _):
        record = RequestRecord(id="w1", tenant="t", route="chat", model="m")
        with pytest.raises(intake.NotReplicatedError):
            await requests.enqueue(api, KEYS, message("w1"), record, ttl_s=60, replicas=1, wait_ms=10)
        chunk = message("w2", tier="background", bucket="medium", reply_to="jobs-1")
        with pytest.raises(intake.NotReplicatedError):
            await intake.enqueue(jobs, KEYS, chunk, replicas=1, wait_ms=10)
        for request_id, stream in (("w1", KEYS.intake("normal", "short")), ("w2", KEYS.intake("background", "medium"))):
            assert await admin.xlen(stream) == 0, f"{request_id} was not withdrawn from {stream}"
            assert await admin.exists(KEYS.cancelled(request_id)), f"{request_id} has no cancel tombstone"
        assert not await admin.exists(KEYS.request("w1"))
    assert not await denials(admin)


# --- the whole pipeline ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_jobs_process(settings: JobsSettings, model_dir: Path) -> AsyncIterator[JobRunner]:
    """``tailcut jobs`` in the test's event loop (jobs/main.py without its signal handlers)."""
    runner = await JobRunner.open(settings, model_dir)
    pool = connect_arq(settings.redis_url, queue_name=runner.keys.arq_queue, timeout_s=5.0)
    worker = build_worker(runner, pool, handle_signals=False)
    task = asyncio.create_task(run_worker(worker))
    leases = asyncio.create_task(runner.keep_leases())
    try:
        yield runner
    finally:
        await close_worker(worker, pool)
        runner.stop_leases()
        await asyncio.gather(task, leases, return_exceptions=True)
        await runner.close()


async def wait_until(condition: Any, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def test_api_worker_and_jobs_process_serve_through_their_own_users(
    acl_redis: AclRedis, admin: aioredis.Redis, tiny_model: Path
) -> None:
    """The real processes' code, each with its role's URL: streams, an idempotent request and its
    resume, a cancelled stream, a batch job, readiness, metrics and the status page; then start-up,
    the background loops (heartbeats, take-over scans, breaker evaluation, the backlog probe) and
    shutdown left nothing in the ACL log."""
    model = {"model": str(tiny_model), "max_model_len": TEST_MAX_MODEL_LEN}
    api_settings = ApiSettings(redis_url=acl_redis.url("api"), cache_enabled=True, **model)  # type: ignore[arg-type]
    api_jobs = JobsSettings(redis_url=acl_redis.url("api"), **model)  # type: ignore[arg-type]
    worker_settings = WorkerSettings(
        redis_url=acl_redis.url("worker"),
        worker_id="w-acl",
        read_block_ms=200,
        drain_timeout_s=2,
        breakers={"evaluate_interval_s": 0.2},  # type: ignore[arg-type]
        **model,  # type: ignore[arg-type]
    )
    jobs_settings = JobsSettings(
        redis_url=acl_redis.url("jobs"),
        jobs_poll_delay_s=0.05,
        jobs_result_ttl_s=600,
        **model,  # type: ignore[arg-type]
    )
    engine = start_engine(EngineSettings(kind="null", null_step_ms=2), tiny_model, TEST_MAX_MODEL_LEN)
    try:
        async with (
            running_api(api_settings, tiny_model, api_jobs) as api,
            running_workers([worker_settings], engine, acl_redis.url("worker")) as workers,
            running_jobs_process(jobs_settings, tiny_model),
            httpx.AsyncClient(base_url=api.base_url, timeout=30) as client,
        ):

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_until(ready, timeout_s=10, what="/readyz (a live worker's heartbeat)")
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True}
            for tier in ("realtime", "normal", "background"):
                async with client.stream("POST", "/v1/completions", json={**body, "tier": tier}) as response:
                    assert response.status_code == 200, await response.aread()
                    payloads = [payload async for _id, payload in sse_frames(response)]
                assert payloads[-1] == DONE and not any("error" in p for p in payloads if isinstance(p, dict)), payloads

            # The answer cache and the tiny pool: the second greedy repeat is stored, the third is a hit.
            for prompt, pool, marker in (
                (list(range(9, 30)), "", {"cache": "hit"}),
                ([9, 8, 7], "tiny", {"cache": "hit", "pool": "tiny"}),
            ):
                greedy = {**body, "stream": False, "temperature": 0, "prompt": prompt}
                for attempt in range(3):
                    answer = await client.post("/v1/completions", json=greedy)
                    assert answer.status_code == 200, answer.text
                    if attempt == 1:
                        stored = functools.partial(admin.zcard, KEYS.answer_index(pool))
                        await wait_until(stored, timeout_s=5, what="the repeat's reply stored")
                assert answer.json().get("tailcut") == marker, answer.json()

            headers = {"Idempotency-Key": "acl-1"}
            first = await client.post("/v1/completions", json={**body, "stream": False}, headers=headers)
            assert first.status_code == 200, first.text
            repeated = await client.post("/v1/completions", json={**body, "stream": False}, headers=headers)
            assert repeated.headers.get("idempotent-replayed") == "true", repeated.headers
            request_id = first.headers["x-tailcut-request-id"]
            resumed = await client.get(f"/v1/requests/{request_id}", params={"stream": "false"})
            assert resumed.status_code == 200, resumed.text

            # A client that leaves cancels its request: tombstone and broadcast, the worker aborts it.
            async with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 1500}) as response:
                cancelled_id = response.headers["x-tailcut-request-id"]
                async for line in sse_lines(response):
                    if line.startswith("data: "):
                        break

            async def tombstoned() -> bool:
                return bool(await admin.exists(KEYS.cancelled(cancelled_id)))

            await wait_until(tombstoned, timeout_s=10, what="the cancel of a stream its client left")

            lines = [f"10:00:{index:02d} ERROR db timeout on node {index}" for index in range(6)]
            submitted = await client.post(
                "/v1/jobs", json={"lines": lines, "instruction": "List the errors", "chunk_lines": 3, "max_tokens": 4}
            )
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]

            async def complete() -> bool:
                view = (await client.get(f"/v1/jobs/{job_id}")).json()
                assert view["status"] not in ("failed", "aborted"), view
                return bool(view["status"] == "complete")

            await wait_until(complete, timeout_s=60, what="the batch job")
            assert (await client.delete(f"/v1/jobs/{job_id}")).json()["status"] == "complete"
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200 and "tailcut_queue_depth_requests" in metrics.text
            # The status page reads the live workers' descriptions (written by their heartbeats).
            status = (await client.get("/status/data")).json()
            assert not status["problems"] and [worker["id"] for worker in status["workers"]] == ["w-acl"], status
            # The take-over scans run every few seconds (the idle one every TAILCUT_RECLAIM_AFTER_MS):
            # once more now, then let the other loops go round (breaker evaluation, the probes).
            assert await workers[0].take_over_dead() == 0 and await workers[0].reclaim_once() == 0
            await asyncio.sleep(1.5)
    finally:
        await engine.shutdown()
    assert not await denials(admin)
