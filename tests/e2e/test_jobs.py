"""Batch jobs end to end: HTTP → arq → background-tier requests → real vLLM worker → aggregated result."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from admission.tokenizer import PromptTokenizer
from jobs.prompts import chunk_messages
from queues.jobs import split_chunks
from queues.messages import SamplingSpec
from queues.output import read_output
from tailcut.processes import Child, start_child, stop_child
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import Stack, running_jobs, running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

JOBS = "/v1/jobs"
INSTRUCTION = "Which workers report a deep queue?"
LINES = [f"10:00:{index % 60:02d} worker-{index % 4} WARN queue depth {index}" for index in range(100)]


async def wait_for_status(client: httpx.AsyncClient, job_id: str, wanted: set[str], limit_s: float) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        view = (await client.get(f"{JOBS}/{job_id}")).json()
        if view["status"] in wanted:
            return view
        assert time.monotonic() < deadline, f"job still {view['status']} after {limit_s} s: {view['progress']}"
        await asyncio.sleep(0.1)


async def stops_on_sigterm(child: Child, within_s: float) -> bool:
    """SIGTERM ``child`` and wait (off the event loop, which serves the test's stack) up to ``within_s``
    for it to exit; a child still running then is killed, with its helpers."""
    child.process.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(child.process.wait, within_s)
    except subprocess.TimeoutExpired:
        stop_child(child, timeout_s=0)
        return False
    return True


async def greedy_text(engine: VllmEngine, tokenizer: PromptTokenizer, messages: list[dict[str, str]], n: int) -> str:
    """What the engine itself answers, greedy, for a chunk's prompt (outside tailcut)."""
    ids: list[int] = []
    prompt = await tokenizer.encode_chat(messages)
    spec = SamplingSpec(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for delta in engine.generate(f"reference-{time.monotonic_ns()}", prompt, spec, priority=0):
        ids += delta.token_ids
    text: str = tokenizer._tokenizer.decode(ids)
    return text


async def output_request_ids(stack: Stack) -> set[str]:
    pattern = stack.keys.output("*")
    return {key.decode().removeprefix(stack.keys.output("")) async for key in stack.redis.scan_iter(match=pattern)}


async def test_a_fifty_chunk_job_completes_through_arq_with_answers_in_order(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {"lines": LINES, "instruction": INSTRUCTION, "chunk_lines": 2, "max_tokens": 4, "ignore_eos": True}
    async with running_stack(redis_url, tiny_model, engine, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        async with running_jobs(stack, tiny_model, jobs_max_in_flight=16) as runner:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                created = await client.post(JOBS, json=body)
                assert created.status_code == 202, created.text
                assert created.json()["num_chunks"] == 50
                view = await wait_for_status(client, created.json()["id"], {"complete", "failed", "aborted"}, 240)
        served = sum(len(worker.served_ids) for worker in stack.workers)
    metrics = runner.metrics.registry
    assert metrics.get_sample_value("tailcut_jobs_total", {"status": "complete"}) == 1
    assert metrics.get_sample_value("tailcut_job_chunks_total", {"outcome": "ok"}) == 50
    assert metrics.get_sample_value("tailcut_job_chunks_total", {"outcome": "failed"}) == 0
    assert metrics.get_sample_value("tailcut_jobs_running") == 0
    assert metrics.get_sample_value("tailcut_job_requests_in_flight") == 0
    assert view["status"] == "complete", view["error"]
    assert view["progress"] == {"done": 50, "failed": 0, "total": 50}
    assert view["error"] is None
    result = view["result"]
    chunks = result["chunks"]
    assert [chunk["index"] for chunk in chunks] == list(range(50))
    assert [(chunk["first_line"], chunk["last_line"]) for chunk in chunks] == [
        (2 * i + 1, 2 * i + 2) for i in range(50)
    ]
    assert all(chunk["error"] is None and chunk["finish_reason"] == "length" for chunk in chunks)
    assert all(chunk["completion_tokens"] == 4 for chunk in chunks)
    assert result["num_failed"] == 0 and result["combined"] is None
    assert result["usage"]["completion_tokens"] == 200
    assert served == 50, "every chunk ran as one request on the tailcut worker"
    # Temperature 0 by default: each answer is the engine's own greedy answer to that chunk's prompt,
    # so an answer in the wrong place would show.
    tokenizer = PromptTokenizer(tiny_model, num_threads=2)
    parts = split_chunks(LINES, 2)
    for index in (0, 1, 25, 49):
        expected = await greedy_text(engine, tokenizer, chunk_messages(INSTRUCTION, parts[index], 50), 4)
        assert chunks[index]["text"] == expected, index
    tokenizer.close()


async def test_reduce_combines_the_chunk_answers_in_one_more_request(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {
        "logs": "\n".join(LINES[:9]),
        "instruction": INSTRUCTION,
        "chunk_lines": 3,
        "max_tokens": 6,
        "ignore_eos": True,
        "reduce": True,
    }
    async with running_stack(redis_url, tiny_model, engine, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        async with running_jobs(stack, tiny_model):
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                created = await client.post(JOBS, json=body)
                view = await wait_for_status(client, created.json()["id"], {"complete", "failed", "aborted"}, 120)
    assert view["status"] == "complete", view["error"]
    assert view["progress"] == {"done": 4, "failed": 0, "total": 4}
    combined = view["result"]["combined"]
    assert combined["error"] is None and combined["completion_tokens"] == 6
    assert combined["num_answers_shortened"] == 0
    assert view["result"]["usage"]["completion_tokens"] == 3 * 6 + 6


async def test_deleting_a_running_job_stops_its_requests(redis_url: str, tiny_model: Path, engine: VllmEngine) -> None:
    body = {"lines": LINES[:40], "instruction": INSTRUCTION, "chunk_lines": 1, "max_tokens": 1500, "ignore_eos": True}
    async with running_stack(redis_url, tiny_model, engine, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        worker = stack.workers[0]
        async with running_jobs(stack, tiny_model, jobs_max_in_flight=4):
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                created = await client.post(JOBS, json=body)
                job_id = created.json()["id"]
                await wait_for_status(client, job_id, {"running"}, 60)
                deadline = time.monotonic() + 60
                while not worker.running_ids:
                    assert time.monotonic() < deadline, "no chunk request reached the worker"
                    await asyncio.sleep(0.02)
                deleted = await client.delete(f"{JOBS}/{job_id}")
                stopped_at = time.monotonic()
                assert deleted.status_code == 200, deleted.text
                assert deleted.json()["status"] == "aborted"
                assert deleted.json()["error"]["code"] == "aborted"
                # The worker aborts the job's requests in the engine and runs nothing more for it.
                while worker.running_ids or engine.num_unfinished():
                    assert time.monotonic() - stopped_at < 5, "the job's requests were not stopped"
                    await asyncio.sleep(0.02)
                seen = await output_request_ids(stack)
                await asyncio.sleep(1.0)
                assert await output_request_ids(stack) == seen, "a chunk request was enqueued after the abort"
                assert 1 <= len(seen) <= 4, "at most jobs_max_in_flight requests were ever out"
                assert not worker.running_ids
                pending = [await stack.redis.xlen(stream) for stream in stack.keys.intake_all()]
                assert sum(pending) == 0, "an entry of the aborted job is still waiting"
                for request_id in seen:
                    events = await read_output(stack.redis, stack.keys, request_id, from_seq=1)
                    terminal = [event for event in events if event.terminal]
                    assert [(event.type, event.error_code) for event in terminal] == [("error", "cancelled")]
                view = (await client.get(f"{JOBS}/{job_id}")).json()
    assert view["status"] == "aborted"
    assert view["progress"]["done"] == 0 and view["progress"]["total"] == 40
    assert view["result"] is None


async def test_submit_cli_prints_the_answers_and_ctrl_c_deletes_the_job(
    redis_url: str, tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    log_file = tmp_path / "app.log"
    log_file.write_text("\n".join(LINES[:6]) + "\n")
    async with running_stack(redis_url, tiny_model, engine, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        async with running_jobs(stack, tiny_model, jobs_max_in_flight=4):
            cli = [sys.executable, "-m", "tailcut", "jobs", "submit", "--url", stack.base_url]
            done = await asyncio.create_subprocess_exec(
                *cli, str(log_file), "--chunk-lines", "2", "--max-tokens", "3", "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            stdout, stderr = await asyncio.wait_for(done.communicate(), timeout=120)
            assert done.returncode == 0, stderr.decode()
            view = orjson.loads(stdout)
            assert view["status"] == "complete" and view["progress"]["done"] == 3
            assert [chunk["first_line"] for chunk in view["result"]["chunks"]] == [1, 3, 5]

            long_file = tmp_path / "long.log"
            long_file.write_text("\n".join(LINES[:40]))
            interrupted = await asyncio.create_subprocess_exec(
                *cli, str(long_file), "--chunk-lines", "1", "--max-tokens", "1500",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert interrupted.stderr is not None
            first = (await asyncio.wait_for(interrupted.stderr.readline(), timeout=60)).decode()
            job_id = first.split()[1].rstrip(":")
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                await wait_for_status(client, job_id, {"running"}, 60)
                interrupted.send_signal(signal.SIGINT)
                _stdout, rest = await asyncio.wait_for(interrupted.communicate(), timeout=60)
                assert interrupted.returncode == 130, rest.decode()
                assert f"job {job_id} aborted" in rest.decode()
                view = (await client.get(f"{JOBS}/{job_id}")).json()
            assert view["status"] == "aborted"


async def test_a_job_of_a_sigkilled_jobs_process_runs_again_within_seconds(
    redis_url: str, tiny_model: Path, engine: VllmEngine, tmp_path: Path
) -> None:
    """arq holds a started job for its whole timeout (6 h by default) when its process dies; the dead
    process's lease lapses within seconds and another jobs process takes the job, resuming it."""
    body = {"lines": LINES[:40], "instruction": INSTRUCTION, "chunk_lines": 2, "max_tokens": 16, "ignore_eos": True}
    async with running_stack(redis_url, tiny_model, engine, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        env = {
            **os.environ,
            "TAILCUT_REDIS_URL": redis_url,
            "TAILCUT_KEY_PREFIX": stack.keys.prefix,
            "TAILCUT_MODEL": str(tiny_model),
            "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
            "TAILCUT_JOBS_METRICS_PORT": "0",
            "TAILCUT_JOBS_MAX_IN_FLIGHT": "2",
        }
        argv = [sys.executable, "-m", "tailcut", "jobs"]
        first = start_child("jobs-1", argv, env, log_path=tmp_path / "jobs-1.log")
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            created = await client.post(JOBS, json=body)
            assert created.status_code == 202, created.text
            job_id = created.json()["id"]
            deadline = time.monotonic() + 120
            while (view := (await client.get(f"{JOBS}/{job_id}")).json())["progress"]["done"] < 2:
                assert time.monotonic() < deadline and first.process.poll() is None, first.log_tail()
                await asyncio.sleep(0.1)
            first.process.kill()
            first.process.wait(timeout=10)
            killed_at = time.monotonic()
            second = start_child("jobs-2", argv, env, log_path=tmp_path / "jobs-2.log")
            try:
                view = await wait_for_status(client, job_id, {"complete", "failed", "aborted"}, 180)
            finally:
                stopped = await stops_on_sigterm(second, 30)
    # The process logs every task's stack when its stop takes over 15 s (jobs_stop_slow).
    assert stopped, f"the jobs process did not stop within 30 s of SIGTERM:\n{second.log_tail(200)}"
    assert view["status"] == "complete", view
    assert time.monotonic() - killed_at < 150
    log = (tmp_path / "jobs-2.log").read_text()
    assert "job_reclaimed" in log, log
    assert f"job={job_id}" in log and "attempt=2" in log, log
