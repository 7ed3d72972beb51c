"""Graceful shutdown: SIGTERM stops intake, finishes or hands back in-flight work, and loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.settings import ApiSettings
from tailcut.processes import Child, free_port, redis_answers, start_child, stop_child
from tests.conftest import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN
from tests.e2e.test_streaming import reference_ids
from tests.sse import DONE, frames, positions_grow
from tests.stack import running_api, running_stack, running_workers
from workers.engines.vllm_engine import VllmEngine
from workers.settings import WorkerSettings

pytestmark = pytest.mark.engine

REQUEST_ID = "x-tailcut-request-id"
POSITIONS = {"X-Tailcut-Event-Ids": "true"}  # each frame's position as its SSE id


@dataclass
class Reply:
    """What one client read of a streamed reply: token ids and SSE ids per event, and how it ended."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    event_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False

    @property
    def last_id(self) -> int:
        return self.event_ids[-1] if self.event_ids else 0


def body(prompt_ids: list[int], max_tokens: int, tier: str = "normal") -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "tier": tier,
    }


async def read_reply(response: httpx.Response, reply: Reply, *, on_event: Any = None) -> None:
    """Read SSE frames into ``reply`` until the stream ends (normally, with an error, or cut)."""
    reply.request_id = reply.request_id or response.headers[REQUEST_ID]
    with contextlib.suppress(httpx.HTTPError):
        async for event_id, data in frames(response):
            if data == DONE:
                reply.done = True
                continue
            if "error" in data:
                reply.error = data["error"]
            elif data.get("choices"):
                choice = data["choices"][0]
                reply.token_ids += choice.get("token_ids") or []
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
            if event_id is not None:
                reply.event_ids.append(event_id)
            if on_event is not None:
                on_event(reply)


async def resume(client: httpx.AsyncClient, reply: Reply) -> None:
    """The rest of ``reply`` after its last SSE id, from whichever API ``client`` talks to."""
    headers = {"Last-Event-ID": str(reply.last_id)} if reply.last_id else {}
    async with client.stream("GET", f"/v1/requests/{reply.request_id}", headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        reply.error = None
        await read_reply(response, reply)


async def test_a_draining_api_refuses_new_requests_and_hands_open_replies_to_their_clients(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    """The API drains (what SIGTERM starts): /readyz and new requests get 503, an open stream and a
    waiting non-streamed request end after the grace time with an error saying where to resume, their
    requests run on (not cancelled), and another API instance serves the rest: the same greedy tokens
    as an uninterrupted run, each position once."""
    prompt = list(range(20, 52))
    expected = await reference_ids(engine, prompt, 1200, "reference-drain")
    async with running_stack(redis_url, tiny_model, engine, shutdown_grace_s=0.5) as stack:
        second = ApiSettings(redis_url=redis_url, key_prefix=stack.keys.prefix, model=str(tiny_model))
        async with (
            running_api(second, tiny_model) as other,
            httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client,
            httpx.AsyncClient(base_url=other.base_url, timeout=60) as other_client,
        ):
            streamed = Reply()
            started = asyncio.Event()

            def on_event(reply: Reply) -> None:
                if len(reply.token_ids) >= 20:
                    started.set()

            async def stream() -> None:
                async with client.stream(
                    "POST", "/v1/completions", json=body(prompt, 1200), headers=POSITIONS
                ) as response:
                    assert response.status_code == 200
                    await read_reply(response, streamed, on_event=on_event)

            streaming = asyncio.create_task(stream())
            whole = asyncio.create_task(client.post("/v1/completions", json={**body(prompt, 1200), "stream": False}))
            async with asyncio.timeout(60):
                await started.wait()
            stack.api.state.drain.begin()
            drained_at = time.monotonic()
            ready = await client.get("/readyz")
            refused = await client.post("/v1/completions", json=body(prompt, 4))
            await streaming
            cut = await whole
            ended_after_s = time.monotonic() - drained_at

            assert ready.status_code == 503 and "shutting down" in ready.json()["problems"]
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert ended_after_s < 3, f"the open replies ended {ended_after_s:.1f} s after the drain began"
            # The stream: an error that says where to resume, then [DONE]; the request was not cancelled.
            assert streamed.error is not None and streamed.error["code"] == "server_shutting_down"
            assert f"/v1/requests/{streamed.request_id}" in streamed.error["message"]
            assert streamed.done and streamed.finish_reason is None
            assert 0 < len(streamed.token_ids) < 1200
            assert positions_grow(streamed.event_ids)
            await resume(other_client, streamed)
            # The non-streamed one: 503 naming its id; its whole body from the other instance.
            assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutting_down"
            whole_id = cut.headers[REQUEST_ID]
            finished = await other_client.get(f"/v1/requests/{whole_id}", params={"stream": "false"})
    assert positions_grow(streamed.event_ids), "a position twice or out of order"
    assert streamed.token_ids == expected
    assert streamed.finish_reason == "length" and streamed.error is None
    assert finished.status_code == 200, finished.text
    assert finished.json()["choices"][0]["token_ids"] == expected


async def test_a_stopping_worker_hands_back_what_waits_and_what_outlasts_its_drain(
    redis_url: str, tiny_model: Path, engine: VllmEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker running one request (max_running 1) with two more waiting in its local queue is
    stopped while a second worker runs: the waiting two go back to the intake stream at once, the
    running one goes on while the drain lasts (its worker keeps beating, so nobody takes it over) and
    is handed back as a continuation when the drain time is up. The second worker finishes all three:
    every client gets the greedy tokens, each position once."""
    caplog.set_level(logging.INFO, logger="tailcut.worker")
    prompts = [list(range(30 + index, 62 + index)) for index in range(3)]
    # The first outlasts the 1.5 s drain wherever it stands at stop(): with 800 tokens it finished inside
    # the drain on a fast run (it had advanced while the others queued and the second worker started).
    # 2,000 is near the test engine's context (2,048 with the 32-token prompt): 3.3 s even at 600 tokens/s.
    lengths = [2000, 200, 200]
    expected = await asyncio.gather(
        *(
            reference_ids(engine, prompt, length, f"reference-stop-{index}")
            for index, (prompt, length) in enumerate(zip(prompts, lengths, strict=True))
        )
    )
    # The drain (1.5 s) outlasts the heartbeat's word (2 beats of 0.5 s): a worker that stopped beating
    # at stop() would be taken over before its drain ended. Faster beats made a loaded test process's
    # scheduling delays (a few hundred ms) look like a death.
    fast = {"max_running": 1, "heartbeat_s": 0.5, "reclaim_interval_s": 0.1, "drain_timeout_s": 1.5}
    replies = [Reply() for _ in prompts]
    async with running_stack(redis_url, tiny_model, None) as stack, contextlib.AsyncExitStack() as workers:

        def settings(worker_id: str) -> WorkerSettings:
            return WorkerSettings(
                redis_url=redis_url, key_prefix=stack.keys.prefix, model=str(tiny_model), worker_id=worker_id, **fast
            )

        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:

            async def stream(index: int) -> None:
                request = body(prompts[index], lengths[index])
                async with client.stream("POST", "/v1/completions", json=request, headers=POSITIONS) as response:
                    assert response.status_code == 200
                    await read_reply(response, replies[index])

            first_worker = running_workers([settings("first")], engine, redis_url)
            (stopping,) = await workers.enter_async_context(first_worker)
            tasks = [asyncio.create_task(stream(0))]
            await until(lambda: len(replies[0].token_ids) >= 10, "the first request did not start")
            tasks += [asyncio.create_task(stream(index)) for index in (1, 2)]
            await until(lambda: stopping.scheduler.num_waiting == 2, "the other two did not wait on the first worker")
            (survivor,) = await workers.enter_async_context(running_workers([settings("second")], engine, redis_url))
            stopped_at = time.monotonic()
            stopping.stop()
            await until(lambda: not stopping.running_ids and not stopping.scheduler.num_waiting, "the stop hung", 10)
            stop_took_s = time.monotonic() - stopped_at
            async with asyncio.timeout(120):
                await asyncio.gather(*tasks)
    reclaimed = [record for record in caplog.records if "request_reclaimed" in record.getMessage()]
    assert stop_took_s < fast["drain_timeout_s"] + 3.0, f"the stop took {stop_took_s:.1f} s"
    assert stopping.num_preempted == 1, "the request that outlasted the drain was not handed back"
    assert not reclaimed, "a draining worker's request was taken over as if it had died"
    assert set(survivor.served_ids) == {reply.request_id for reply in replies}
    for index, reply in enumerate(replies):
        assert positions_grow(reply.event_ids), f"reply {index}: a position twice or out of order"
        assert reply.token_ids == expected[index], f"reply {index} differs from the greedy reference"
        assert reply.finish_reason == "length" and reply.error is None


async def until(condition: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


# --- SIGTERM to every process of a real stack -------------------------------------------------------


@dataclass
class ProcessStack:
    """Redis (AOF, appendfsync always, in ``folder``), a worker, the jobs process and the API, each a
    real process started as ``tailcut up`` starts them; ``start`` and ``terminate`` may run again."""

    folder: Path
    model: Path
    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}:")
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    jobs_metrics_port: int = field(default_factory=free_port)
    children: list[Child] = field(default_factory=list)
    life: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start(self) -> None:
        self.life += 1
        redis_server = shutil.which("redis-server")
        assert redis_server is not None
        redis_argv = [
            redis_server, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        self.children = [self._start("redis", redis_argv)]
        deadline = time.monotonic() + 10
        while not redis_answers(self.redis_url):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        command = [sys.executable, "-m", "tailcut"]
        self.children += [
            self._start("worker", [*command, "worker"]),
            self._start("jobs", [*command, "jobs"]),
            self._start("api", [*command, "api"]),
        ]

    def _start(self, name: str, argv: list[str]) -> Child:
        env = {
            **os.environ,
            "TAILCUT_REDIS_URL": self.redis_url,
            "TAILCUT_KEY_PREFIX": self.prefix,
            "TAILCUT_MODEL": str(self.model),
            "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
            "TAILCUT_PORT": str(self.api_port),
            "TAILCUT_METRICS_PORT": str(self.metrics_port),
            "TAILCUT_JOBS_METRICS_PORT": str(self.jobs_metrics_port),
            "TAILCUT_HOST": "127.0.0.1",
            "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(TEST_KV_CACHE_BYTES),
            "TAILCUT_ENGINE__MAX_NUM_SEQS": "8",
            "TAILCUT_SHUTDOWN_GRACE_S": "1",
            "TAILCUT_DRAIN_TIMEOUT_S": "1",
            # Compared with greedy references: no summary fallback (see tests.stack.running_workers).
            "TAILCUT_DEGRADE__REALTIME_HEARTBEAT_MS": "0",
            "TAILCUT_DEGRADE__NORMAL_HEARTBEAT_MS": "0",
        }
        return start_child(name, argv, env, log_path=self.folder / f"{name}-{self.life}.log")

    async def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2) as client:
            while True:
                for child in self.children:
                    assert child.process.poll() is None, f"{child.name} exited while starting: {child.failure()}"
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/readyz")).status_code == 200:
                        return
                assert time.monotonic() < deadline, f"the stack was not ready after {timeout_s:.0f} s"
                await asyncio.sleep(0.25)

    def terminate(self) -> None:
        """SIGTERM to every process at once, Redis included."""
        for child in self.children:
            child.process.send_signal(signal.SIGTERM)

    def running(self) -> list[Child]:
        return [child for child in self.children if child.process.poll() is None]

    async def exit_codes(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {child.name: child.process.poll() for child in self.children}

    def stop(self) -> None:
        for child in reversed(self.children):
            stop_child(child, timeout_s=10)


@contextlib.contextmanager
def process_stack(folder: Path, model: Path) -> Iterator[ProcessStack]:
    stack = ProcessStack(folder, model)
    try:
        yield stack
    finally:
        stack.stop()


JOB_COMPLETE = 'tailcut_jobs_total{status="complete"} 1.0'


# Two whole stacks (Redis, a worker with its vLLM engine, the jobs process, the API) one after the other:
# 134-190 s on a quiet machine, 289 s with both cores loaded, and past 240 s in a CI run.
@pytest.mark.timeout(480)
async def test_sigterm_to_every_process_of_the_stack_loses_nothing(
    tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    """Redis (AOF, appendfsync always), a worker, the jobs process and the API run as real processes;
    mid-load (four greedy streams of three tiers, a batch job) every one of them gets SIGTERM at the
    same moment. Each exits by itself within its grace time; the streams end with an error that says
    where to resume. The stack starts again on the same Redis files: every client resumes after its
    last SSE id and gets the rest — altogether the greedy reference, each position once — and the job
    completes with every chunk answered."""
    prompts = [list(range(40 + index, 72 + index)) for index in range(4)]
    tiers = ["realtime", "normal", "normal", "background"]
    # The streams are cut after about 80 tokens, the job after its start; 1,200 tokens, so that a stream
    # cannot end before the stop (a CI run's 400-token streams had, 0.95 s after they began).
    length, job_tokens = 1200, 100
    expected = await asyncio.gather(
        *(reference_ids(engine, prompt, length, f"reference-term-{i}") for i, prompt in enumerate(prompts))
    )
    job = {"lines": [f"10:00:0{i} worker-{i} WARN queue depth {i}" for i in range(8)], "instruction": "Which queue?",
           "chunk_lines": 2, "max_tokens": job_tokens, "ignore_eos": True}  # fmt: skip
    replies = [Reply() for _ in prompts]
    with process_stack(tmp_path, tiny_model) as stack:
        stack.start()
        await stack.wait_ready()
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:

            async def stream(index: int) -> None:
                request = body(prompts[index], length, tiers[index])
                async with client.stream("POST", "/v1/completions", json=request, headers=POSITIONS) as response:
                    assert response.status_code == 200
                    await read_reply(response, replies[index])

            # The worker process serves its own /metrics, vLLM's families included; with no GPU it says
            # so in one line and runs.
            metrics = (await client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics")).text
            assert "tailcut_worker_running_requests{" in metrics and "vllm:kv_cache_usage_perc" in metrics
            assert 'tailcut_event_loop_lag_seconds_count{process="worker"}' in metrics
            assert (tmp_path / "worker-1.log").read_text().count("gpu_memory_unavailable") == 1
            worker = next(child for child in stack.children if child.name == "worker")
            worker.process.send_signal(signal.SIGUSR1)  # its stacks, into its log
            await until(lambda: "worker-reader" in (tmp_path / "worker-1.log").read_text(), "no stack dump", 10)
            created = await client.post("/v1/jobs", json=job)
            assert created.status_code == 202, created.text
            tasks = [asyncio.create_task(stream(index)) for index in range(4)]
            await until(lambda: all(len(reply.token_ids) >= 10 for reply in replies), "the streams did not start")
            # The job is running too: the stop catches it mid-run, as it catches the streams.
            job_url = f"/v1/jobs/{created.json()['id']}"
            for _ in range(300):
                # An answer may be a 503 on these two busy cores: ask again.
                if (view := (await client.get(job_url)).json()).get("status") == "running":
                    break
                await asyncio.sleep(0.05)
            assert view.get("status") == "running", view
            stack.terminate()
            terminated_at = time.monotonic()
            async with asyncio.timeout(30):
                await asyncio.gather(*tasks)
        codes = await stack.exit_codes(timeout_s=40)
        stopped_after_s = time.monotonic() - terminated_at
        cut = [(len(reply.token_ids), reply.error and reply.error["code"]) for reply in replies]
        # uvicorn, once it has shut down, re-raises the signal it caught: the API ends "killed by SIGTERM".
        assert codes == {"redis": 0, "worker": 0, "jobs": 0, "api": -signal.SIGTERM}, (
            f"not every process stopped cleanly after SIGTERM: {codes}; "
            + "; ".join(f"{child.name}: {child.log_errors()}" for child in stack.children)
            + "".join(f"\n--- {child.name}, still running:\n{child.log_tail(400)}" for child in stack.running())
        )
        assert "api_stopped" in (tmp_path / "api-1.log").read_text(), "the API did not shut down in order"
        stack.start()
        await stack.wait_ready()
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            for reply in replies:
                await resume(client, reply)
            view = await wait_for_job(client, created.json()["id"], timeout_s=180)
            # The jobs process counts the job once Redis has answered its "complete", which the API
            # may have read first: ask its metrics until the count is there (or 10 s have passed).
            metrics_url = f"http://127.0.0.1:{stack.jobs_metrics_port}/metrics"
            for _ in range(50):
                jobs_metrics = (await client.get(metrics_url)).text
                if JOB_COMPLETE in jobs_metrics:
                    break
                await asyncio.sleep(0.2)
    print(f"\nSIGTERM → every process gone: {stopped_after_s:.1f} s; (tokens, error) when cut: {cut}")
    assert all(tokens < length for tokens, _error in cut), "a stream had ended before the SIGTERM"
    for index, reply in enumerate(replies):
        assert positions_grow(reply.event_ids), f"reply {index}: a position twice or out of order"
        assert reply.token_ids == expected[index], f"reply {index} differs from the greedy reference"
        assert reply.finish_reason == "length" and reply.error is None
    assert view["status"] == "complete", view
    assert view["progress"] == {"done": 4, "failed": 0, "total": 4}
    assert all(chunk["completion_tokens"] == job_tokens for chunk in view["result"]["chunks"])
    # The restarted jobs process ran the job to its end: the first one handed it back when stopped, or,
    # when Redis was gone before it could, its lease lapsed and the new one took the job at once.
    assert JOB_COMPLETE in jobs_metrics, jobs_metrics


async def wait_for_job(client: httpx.AsyncClient, job_id: str, *, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        view = (await client.get(f"/v1/jobs/{job_id}")).json()
        if view["status"] in ("complete", "failed", "aborted"):
            return view
        assert time.monotonic() < deadline, f"job still {view['status']} after {timeout_s:.0f} s: {view['progress']}"
        await asyncio.sleep(0.2)
