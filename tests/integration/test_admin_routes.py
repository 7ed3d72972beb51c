"""The operators' routes on a real Redis, with real workers (null engine) where a worker must act: who may
call them (an admin key, else 401/403, and no route at all without an admin); draining a worker through
Redis; the dead-letter stream listed and a request replayed once, read by its client; a breaker reset
for every worker. Then ``/metrics`` and the status page with keys on: an admin key, a browser's Basic
prompt, and the keyless metrics port (``TAILCUT_API_METRICS_PORT``) scraped by a real Prometheus with the
repository's scrape config, from one API process and from two."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from queues.apikeys import KeyStore
from queues.breakers import read_breakers
from queues.messages import OutputEvent
from queues.output import OutputWriter, read_output
from tailcut import __version__
from tailcut.processes import Child, free_port, start_child, stop_child
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.sse import DONE, frames
from tests.stack import Stack, running_stack, running_workers, unique_prefix
from workers.breakers import BreakerConfig, Breakers
from workers.engines.factory import start_engine
from workers.engines.null import NullEngine
from workers.settings import EngineSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SECRET = "an-admin-routes-test-secret"
ADMIN_KEY = "static-admin-key"
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "stream": False}
ADMIN_GETS = ("/admin/workers", "/admin/dlq")
ADMIN_POSTS = ("/admin/workers/w1/drain", "/admin/dlq/1-0/replay", "/admin/breakers/normal/reset")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"ops:{password}".encode()).decode()}


async def call(client: httpx.AsyncClient, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return await client.request("POST" if path in ADMIN_POSTS else "GET", path, headers=headers)


@pytest.fixture
async def null_engine(tiny_model: Path) -> AsyncIterator[NullEngine]:
    """A zero-cost engine, 20 ms a token: a reply of N tokens runs for N × 20 ms."""
    engine = start_engine(EngineSettings(kind="null", null_step_ms=20), tiny_model, TEST_MAX_MODEL_LEN)
    try:
        yield engine  # type: ignore[misc]
    finally:
        await engine.shutdown()


async def wait_for(condition: Any, *, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` (sync or async) holds."""
    start = time.monotonic()
    while True:
        held = condition()
        if asyncio.iscoroutine(held):
            held = await held
        if held:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


# --- who may call them -------------------------------------------------------------------------------


async def test_without_any_admin_the_admin_routes_do_not_exist(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for path in (*ADMIN_GETS, *ADMIN_POSTS):
                answer = await call(client, path, bearer("anything"))
                assert answer.status_code == 404, (path, answer.text)
                assert answer.json()["error"]["type"] == "not_found_error"
            # Keys off: the deployment's own view stays open, as before.
            assert (await client.get("/metrics")).status_code == 200
            assert (await client.get("/status/data")).status_code == 200


async def test_with_tailcut_admin_key_only_that_key_calls_them(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None, admin_key=ADMIN_KEY) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for path in ADMIN_GETS:
                for headers in ({}, bearer("nope"), bearer(ADMIN_KEY[:-1])):
                    refused = await call(client, path, headers)
                    assert refused.status_code == 401, (path, refused.text)
                    assert refused.json()["error"]["type"] == "authentication_error"
                assert (await call(client, path, bearer(ADMIN_KEY))).status_code == 200, path


async def test_with_keys_on_an_admin_key_is_needed_for_admin_routes_metrics_and_the_status_page(
    redis_url: str, tiny_model: Path
) -> None:
    async with running_stack(
        redis_url, tiny_model, None, auth_required=True, auth_secret=SECRET, admin_key=ADMIN_KEY
    ) as stack:
        store = KeyStore(stack.redis, stack.keys, SECRET)
        tenant, _ = await store.create("acme")
        admin, _ = await store.create("ops", admin=True)
        operator_views = ("/metrics", "/status/data", "/status")
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for path in (*ADMIN_GETS, *ADMIN_POSTS, *operator_views):
                missing = await call(client, path)
                assert missing.status_code == 401, (path, missing.text)
                assert missing.json()["error"]["type"] == "authentication_error"
                denied = await call(client, path, bearer(tenant))
                assert denied.status_code == 403, (path, denied.text)
                assert denied.json()["error"]["type"] == "permission_error"
            for path in ADMIN_GETS:
                for key in (admin, ADMIN_KEY):
                    assert (await call(client, path, bearer(key))).status_code == 200, path
            for key in (admin, ADMIN_KEY):
                metrics = await client.get("/metrics", headers=bearer(key))
                assert metrics.status_code == 200 and "tailcut_open_streams" in metrics.text
                assert (await client.get("/status/data", headers=bearer(key))).json()["problems"] == []
            # A browser opening the page is asked for the key (HTTP Basic), then sends it as the password
            # with the page's own requests.
            page = await client.get("/status")
            assert page.headers["www-authenticate"].startswith("Basic ")
            assert (await client.get("/status", headers=basic(tenant))).status_code == 403
            opened = await client.get("/status", headers=basic(admin))
            assert opened.status_code == 200 and "status/data" in opened.text
            assert (await client.get("/status/data", headers=basic(admin))).status_code == 200
            # The probes need nothing: tailcut's, and vLLM's server's paths that probes set up for it check.
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/version")).json() == {"version": __version__}


# --- draining a worker ----------------------------------------------------------------------------------


async def test_a_drained_worker_learns_it_through_redis_within_a_second_and_finishes_what_it_runs(
    redis_url: str, tiny_model: Path, null_engine: NullEngine
) -> None:
    async with running_stack(redis_url, tiny_model, null_engine, admin_key=ADMIN_KEY) as stack:
        (worker,) = stack.workers
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30, headers=bearer(ADMIN_KEY)) as client:

            async def listed() -> list[str]:
                return [entry["id"] for entry in (await client.get("/admin/workers")).json()["data"]]

            await wait_for(listed, timeout_s=5, what="the worker's first beat")
            assert await listed() == [worker.worker_id]
            assert (await client.post("/admin/workers/no-such-worker/drain")).status_code == 404
            body = {**BODY, "stream": True, "max_tokens": 60}  # 1.2 s on the engine
            async with client.stream("POST", "/v1/completions", json=body) as streamed:
                payloads = frames(streamed)
                _id, first = await anext(payloads)
                assert "choices" in first, first
                asked = await client.post(f"/admin/workers/{worker.worker_id}/drain")
                assert asked.status_code == 202, asked.text
                assert asked.json() == {"id": worker.worker_id, "drain": "requested"}
                took_s = await wait_for(
                    lambda: worker.describe()["state"] == "draining", timeout_s=5, what="the worker draining"
                )
                rest = [payload async for _id, payload in payloads]
            # Told within a heartbeat (1 s), and what ran finished: every token, one final.
            assert took_s < 1.5, f"the worker began draining {took_s:.2f} s after the request"
            assert rest[-1] == DONE
            tokens = [first, *rest[:-1]]
            assert sum(len(p["choices"][0]["text"]) > 0 for p in tokens if p["choices"]) >= 1
            assert [p["choices"][0]["finish_reason"] for p in tokens if p["choices"][0].get("finish_reason")] == [
                "length"
            ]

            async def gone() -> bool:
                return await listed() == []

            await wait_for(gone, timeout_s=10, what="the drained worker leaving the live workers")
            again = await client.post(f"/admin/workers/{worker.worker_id}/drain")
            assert again.status_code == 404 and again.json()["error"]["param"] == "worker_id"
        drained = [fields async for fields in events_of(stack, "worker_draining")]
        assert [fields[b"worker"] for fields in drained] == [worker.worker_id.encode()]


async def events_of(stack: Stack, kind: str) -> AsyncIterator[dict[bytes, bytes]]:
    for _id, fields in await stack.redis.xrange(stack.keys.events):
        if fields[b"type"] == kind.encode():
            yield fields


# --- the dead-letter stream and replays -------------------------------------------------------------------


def worker_settings(stack: Stack, tiny_model: Path, worker_id: str) -> WorkerSettings:
    return WorkerSettings(
        redis_url=stack.api_settings.redis_url,
        key_prefix=stack.keys.prefix,
        model=str(tiny_model),
        worker_id=worker_id,
        read_block_ms=100,
        drain_timeout_s=5,
    )


async def test_the_dead_letter_stream_is_listed_newest_first_and_a_replay_runs_once_for_its_client(
    redis_url: str, tiny_model: Path, null_engine: NullEngine
) -> None:
    async with running_stack(redis_url, tiny_model, None, admin_key=ADMIN_KEY, realtime_deadline_s=0.2) as stack:
        keys, redis = stack.keys, stack.redis
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            admin = bearer(ADMIN_KEY)
            # Three realtime requests wait past their 0.2 s deadline for a worker: a streamed resumable one,
            # two whole ones. The worker that comes then dead-letters each (`expired`), at no engine cost.
            body = {**BODY, "tier": "realtime", "max_tokens": 100}
            async with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers={"Idempotency-Key": "replay-me"}
            ) as streamed:
                request_id = streamed.headers["x-tailcut-request-id"]
                whole = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
                await asyncio.sleep(0.4)
                async with running_workers([worker_settings(stack, tiny_model, "late")], null_engine, redis_url):
                    seen = [(event_id, payload) async for event_id, payload in frames(streamed)]
                    assert [answer.status_code for answer in await asyncio.gather(*whole)] == [504, 504]
            # The client got one terminal error, at position 1.
            ((error_id, error),) = [(event_id, payload) for event_id, payload in seen if payload != DONE]
            assert error_id == 1 and error["error"]["type"] == "timeout_error", seen

            listed = (await client.get("/admin/dlq", headers=admin)).json()
            assert listed["object"] == "list" and listed["total"] == 3
            entries = listed["data"]
            ids = [tuple(map(int, entry["id"].split("-"))) for entry in entries]
            assert ids == sorted(ids, reverse=True), "newest first"
            assert {entry["reason"] for entry in entries} == {"expired"}
            assert request_id in {entry["request_id"] for entry in entries}
            assert all(entry["tier"] == "realtime" and entry["prompt_tokens"] == 5 for entry in entries)
            assert "prompt_token_ids" not in entries[0], "an operator sees sizes, never the prompt"
            limited = (await client.get("/admin/dlq", params={"limit": 2}, headers=admin)).json()["data"]
            assert limited == entries[:2]
            assert (await client.get("/admin/dlq", params={"limit": 0}, headers=admin)).status_code == 400

            mine = next(entry for entry in entries if entry["request_id"] == request_id)
            # Two replays of one entry at once: exactly one enqueues it.
            replays = await asyncio.gather(
                *(client.post(f"/admin/dlq/{mine['id']}/replay", headers=admin) for _ in range(2))
            )
            assert sorted(answer.status_code for answer in replays) == [202, 404], [a.text for a in replays]
            (done,) = [answer.json() for answer in replays if answer.status_code == 202]
            assert done["request_id"] == request_id
            assert done["resume"] == {"path": f"/v1/requests/{request_id}", "last_event_id": 0}
            assert request_id not in [
                e["request_id"] for e in (await client.get("/admin/dlq", headers=admin)).json()["data"]
            ]
            # The error is no longer the request's end in its durable output; nothing else was rewritten.
            assert await read_output(redis, keys, request_id, from_seq=1) == []

            # No worker yet, and longer than its tier's deadline: a replay is not expired again.
            await asyncio.sleep(0.4)
            old_owner = OutputWriter(redis, keys, ttl_s=60, on_fenced=lambda rid, fence: fenced.append(rid))
            fenced: list[str] = []
            old_owner.start()
            async with running_workers([worker_settings(stack, tiny_model, "again")], null_engine, redis_url) as (
                worker,
            ):

                async def running() -> bool:
                    return bool(await read_output(redis, keys, request_id, from_seq=2, to_seq=2))

                await wait_for(running, timeout_s=10, what="the replay running")
                # The worker that dead-lettered it held token 1: its writes stay refused.
                old_owner.emit("api-x", OutputEvent(rid=request_id, seq=900, type="chunk", text="stale"), fence=1)
                await old_owner.flush()
                assert fenced == [request_id], "a former owner's token still writes after the replay"
                # A client that got the error resumes after it and reads the replay to its one end.
                async with client.stream(
                    "GET", f"/v1/requests/{request_id}", headers={"Last-Event-ID": "1"}
                ) as resumed:
                    assert resumed.status_code == 200
                    after = [(event_id, payload) async for event_id, payload in frames(resumed)]
            await old_owner.close()
            assert worker.accepted and [rid for rid, _at in worker.accepted].count(request_id) == 1
            positions = [event_id for event_id, _payload in after if event_id is not None]
            assert positions == list(range(2, 2 + len(positions))) and after[-1][1] == DONE
            assert not any("error" in payload for _id, payload in after if isinstance(payload, dict))
            # Read from the start it is one reply: 100 tokens, no error, one terminal event.
            whole_reply = await client.get(f"/v1/requests/{request_id}", params={"stream": "false"})
            assert whole_reply.status_code == 200, whole_reply.text
            assert whole_reply.json()["usage"]["completion_tokens"] == 100
            events = await read_output(redis, keys, request_id, from_seq=1)
            assert [event.type for event in events].count("final") == 1 and 900 not in [e.seq for e in events]
            assert positions == [event.seq for event in events], "the resumed client missed a position"
            assert not [event for event in events if event.type == "error"]

            # A request no client could read any more (its record expired) stays where it is: 409.
            other = next(entry for entry in entries if entry["request_id"] != request_id)
            await redis.delete(keys.request(other["request_id"]))
            refused = await client.post(f"/admin/dlq/{other['id']}/replay", headers=admin)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_replayable", refused.text
            assert other["id"] in [e["id"] for e in (await client.get("/admin/dlq", headers=admin)).json()["data"]]
            # Unknown and malformed entry ids.
            assert (await client.post("/admin/dlq/1-1/replay", headers=admin)).status_code == 404
            assert (await client.post("/admin/dlq/nope/replay", headers=admin)).status_code == 400


# --- breakers ------------------------------------------------------------------------------------------


async def test_a_breaker_reset_closes_it_for_every_worker_and_its_rules_judge_afresh(
    redis_url: str, tiny_model: Path, null_engine: NullEngine
) -> None:
    async with running_stack(redis_url, tiny_model, null_engine, num_workers=2, admin_key=ADMIN_KEY) as stack:
        config = BreakerConfig(min_samples=5)
        breakers = Breakers(stack.redis, stack.keys, config, events=no_events)
        now = int(time.time() * 1000)
        for index in range(config.realtime_trip_count):  # three slow realtime requests in a row: open
            await breakers.record("realtime", ttft_ms=900, e2e_ms=900, request_id=f"slow{index}", now_ms=now)
        for index in range(10):  # a slow normal tier: the scale-up signal
            await breakers.record("normal", ttft_ms=5000, e2e_ms=6000, request_id=f"n{index}", now_ms=now)
        await breakers.evaluate_now(now)
        assert {tier: view.state for tier, view in (await read_breakers(stack.redis, stack.keys)).items()} == {
            "realtime": "open",
            "normal": "open",
            "background": "closed",
        }
        await wait_for(
            lambda: all(worker.breakers.degrade_mode for worker in stack.workers), timeout_s=5, what="degrade mode"
        )
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10, headers=bearer(ADMIN_KEY)) as client:
            answer = await client.post("/admin/breakers/realtime/reset")
            assert answer.status_code == 200, answer.text
            assert answer.json()["state"] == "closed" and answer.json()["previous"]["state"] == "open"
            took_s = await wait_for(
                lambda: not any(worker.breakers.degrade_mode for worker in stack.workers),
                timeout_s=5,
                what="every worker out of degrade mode",
            )
            assert took_s < 2.0
            assert (await client.post("/admin/breakers/normal/reset")).status_code == 200
            unknown = await client.post("/admin/breakers/fast/reset")
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tier", unknown.text
            ready = (await client.get("/readyz")).json()
        assert {tier: view["state"] for tier, view in ready["breakers"].items()} == {
            "realtime": "closed",
            "normal": "closed",
            "background": "closed",
        }
        # Afresh: one more slow realtime request is not "three in a row", and the normal window is empty.
        later = now + 1000
        await breakers.record("realtime", ttft_ms=900, e2e_ms=900, request_id="slow-after", now_ms=later)
        await breakers.evaluate_now(later)
        views = await read_breakers(stack.redis, stack.keys)
        assert (views["realtime"].state, views["normal"].state) == ("closed", "closed")
        resets = [fields async for fields in events_of(stack, "breaker_reset")]
        assert [fields[b"tier"] for fields in resets] == [b"realtime", b"normal"]


async def no_events(kind: str, **fields: object) -> None:
    pass


# --- the metrics port and Prometheus --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def api_process(tiny_model: Path, redis_url: str, tmp_path: Path, *, processes: int) -> AsyncIterator[Ports]:
    """``tailcut api --processes N`` with keys on and a metrics port, once it answers."""
    ports = Ports(free_port(), free_port())
    env = {
        **os.environ,
        "TAILCUT_REDIS_URL": redis_url,
        "TAILCUT_KEY_PREFIX": unique_prefix(),
        "TAILCUT_AUTH_REQUIRED": "true",
        "TAILCUT_AUTH_SECRET": SECRET,
        "TAILCUT_API_METRICS_PORT": str(ports.metrics),
        "TAILCUT_METRICS_DIR": str(tmp_path / "metrics"),
        "TAILCUT_SHUTDOWN_GRACE_S": "1",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = [sys.executable, "-m", "tailcut", "api", "--processes", str(processes), "--model", str(tiny_model)]
    log = tmp_path / "api.log"
    child = start_child("api", [*argv, "--port", str(ports.api)], env, log_path=log)
    try:
        async with httpx.AsyncClient(timeout=5) as client:

            async def healthy() -> bool:
                assert child.process.poll() is None, log.read_text()
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get(f"{ports.api_url}/healthz")).status_code == 200
                return False

            await wait_for(healthy, timeout_s=90, what="the API answering")
        yield ports
    finally:
        stop_child(child, timeout_s=30)


@dataclass(frozen=True)
class Ports:
    api: int
    metrics: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}"


async def check_ports(client: httpx.AsyncClient, ports: Ports) -> str:
    """The API's own port wants a key for /metrics; the metrics port serves it without one, and nothing
    else. Returns the metrics port's exposition."""
    assert (await client.get(f"{ports.api_url}/metrics")).status_code == 401
    scraped = await client.get(f"{ports.metrics_url}/metrics")
    assert scraped.status_code == 200 and "tailcut_open_streams" in scraped.text
    for path in ("/v1/models", "/status/data", "/admin/workers", "/healthz", "/metrics/x"):
        refused = await client.get(f"{ports.metrics_url}{path}", headers=bearer("anything"))
        assert refused.status_code == 404, (path, refused.text)
    return scraped.text


def api_only_scrape_config(target: str, storage: Path) -> Path:
    """The repository's scrape config, its `api` job pointed at ``target`` and every second (the other jobs
    scrape processes this test does not run)."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "api"]
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    path = storage / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


async def start_prometheus(config: Path, storage: Path) -> tuple[Child, str]:
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={storage / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    child = start_child("prometheus", argv, log_path=storage / "prometheus.log")
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2) as client:

        async def ready() -> bool:
            assert child.process.poll() is None, child.log_tail()
            with contextlib.suppress(httpx.HTTPError):
                return (await client.get(f"{base}/-/ready")).status_code == 200
            return False

        await wait_for(ready, timeout_s=30, what="Prometheus ready")
    return child, base


def pids_of(text: str) -> set[str]:
    """The API processes whose samples an exposition pools (the per-process gauges carry a ``pid``)."""
    return {
        sample.labels["pid"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "pid" in sample.labels
    }


async def test_with_keys_on_prometheus_scrapes_the_api_on_its_keyless_metrics_port(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    async with (
        api_process(tiny_model, redis_url, tmp_path, processes=1) as ports,
        httpx.AsyncClient(timeout=5) as client,
    ):
        await check_ports(client, ports)
        config = api_only_scrape_config(f"127.0.0.1:{ports.metrics}", tmp_path)
        prometheus, prom = await start_prometheus(config, tmp_path)
        try:

            async def up() -> bool:
                found = (await client.get(f"{prom}/api/v1/query", params={"query": 'up{job="api"}'})).json()
                return bool(found["data"]["result"]) and found["data"]["result"][0]["value"][1] == "1"

            await wait_for(up, timeout_s=30, what="Prometheus scraping the API")
            series = (await client.get(f"{prom}/api/v1/query", params={"query": "tailcut_open_streams"})).json()
            assert series["data"]["result"], series
        finally:
            stop_child(prometheus)


async def test_several_api_processes_share_the_metrics_port_and_each_answers_for_all(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    async with (
        api_process(tiny_model, redis_url, tmp_path, processes=2) as ports,
        httpx.AsyncClient(timeout=5) as client,
    ):
        await check_ports(client, ports)

        async def pooled() -> bool:
            async with httpx.AsyncClient(timeout=5) as fresh:  # a new connection: either process may answer
                return len(pids_of((await fresh.get(f"{ports.metrics_url}/metrics")).text)) == 2

        await wait_for(pooled, timeout_s=30, what="both processes' samples on the metrics port")
        for _ in range(6):
            async with httpx.AsyncClient(timeout=5) as fresh:
                assert len(pids_of((await fresh.get(f"{ports.metrics_url}/metrics")).text)) == 2
