"""The jobs API on a real Redis, without an engine: input checks, JSON payloads in arq, status, abort
of a queued job and of one whose chunks wait for a worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from arq.constants import job_key_prefix, result_key_prefix

from queues.keys import BUCKETS
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import running_jobs, running_stack

JOBS = "/v1/jobs"
LINES = [f"2024-05-01T10:00:{index:02d} ERROR db timeout after 30 s on node {index}" for index in range(10)]

CASES: list[tuple[str, dict[str, Any] | bytes, int, str, str | None]] = [
    # (name, body, status, words in the message, param)
    ("malformed json", b'{"lines": [', 400, "not valid JSON", None),
    ("no log", {"instruction": "find errors"}, 400, "exactly one of `logs`", "logs"),
    ("two logs", {"instruction": "x", "logs": "a", "lines": ["a"]}, 400, "exactly one of `logs`", "logs"),
    ("blank log", {"instruction": "x", "logs": " \n \n"}, 400, "`logs` is blank", "logs"),
    ("empty lines", {"instruction": "x", "lines": []}, 400, "`lines` holds no text", "lines"),
    ("missing instruction", {"lines": LINES}, 400, "missing required field `instruction`", "instruction"),
    ("blank instruction", {"lines": LINES, "instruction": "  "}, 400, "`instruction` is blank", "instruction"),
    ("chunk_lines zero", {"lines": LINES, "instruction": "x", "chunk_lines": 0}, 400, "greater than", "chunk_lines"),
    ("max_tokens zero", {"lines": LINES, "instruction": "x", "max_tokens": 0}, 400, "greater than", "max_tokens"),
    ("lines not text", {"lines": [1, 2], "instruction": "x"}, 400, "valid string", "lines.0"),
    ("unknown model", {"lines": LINES, "instruction": "x", "model": "gpt-9"}, 404, "'gpt-9' does not exist", "model"),
    ("too many chunks", {"lines": LINES, "instruction": "x", "chunk_lines": 1}, 400, "at most 5", "chunk_lines"),
    (
        "chunk over context",
        {"lines": LINES * 4, "instruction": "x", "chunk_lines": 40, "max_tokens": TEST_MAX_MODEL_LEN - 100},
        400,
        "lower `chunk_lines` (now 40) or `max_tokens`",
        "chunk_lines",
    ),
    (
        "line over context",
        {"lines": [" ".join(LINES * 10)], "instruction": "x", "chunk_lines": 1},
        400,
        "shorten that line",
        "chunk_lines",
    ),
]


async def test_bad_job_inputs_get_clear_errors(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(
        redis_url, tiny_model, None, jobs={"jobs_max_chunks": 5}, max_model_len=TEST_MAX_MODEL_LEN
    ) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            for name, body, status, words, param in CASES:
                if isinstance(body, bytes):
                    response = await client.post(JOBS, content=body, headers={"Content-Type": "application/json"})
                else:
                    response = await client.post(JOBS, json=body)
                assert response.status_code == status, (name, response.text)
                error = response.json()["error"]
                assert words in error["message"], (name, error)
                assert error["param"] == param, (name, error)
            for method in ("GET", "DELETE"):
                response = await client.request(method, f"{JOBS}/no-such-job")
                assert response.status_code == 404, response.text
                assert response.json()["error"]["code"] == "job_not_found"
            over = await client.post(JOBS, json=CASES[-2][1])
            assert over.json()["error"]["code"] == "context_length_exceeded"
            assert "chunk 1 of 1 (log lines 1-40)" in over.json()["error"]["message"]
        # Nothing refused reached arq's queue.
        assert await stack.redis.zcard(stack.keys.arq_queue) == 0


async def test_a_job_travels_through_arq_as_json_and_aborts_while_queued(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(
        redis_url, tiny_model, None, jobs={"jobs_abort_wait_s": 0.2}, max_model_len=TEST_MAX_MODEL_LEN
    ) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
            created = await client.post(
                JOBS,
                json={"logs": "\n".join(LINES), "instruction": "find errors", "chunk_lines": 4},
                headers={"X-Tailcut-Tenant": "ops"},
            )
            assert created.status_code == 202, created.text
            job = created.json()
            assert job == {"id": job["id"], "object": "job", "status": "queued", "num_chunks": 3}
            job_id = job["id"]

            # The stored arq job is JSON, not a pickle, and carries the lines and options.
            raw = await stack.redis.get(job_key_prefix + job_id)
            assert raw is not None and not raw.startswith(b"\x80")
            stored = orjson.loads(raw)
            assert stored["f"] == "analyze_logs"
            payload = stored["a"][0]
            assert payload["lines"] == LINES and payload["chunk_lines"] == 4 and payload["tenant"] == "ops"
            assert payload["max_tokens"] == 256  # the default of TAILCUT_JOBS_MAX_TOKENS
            assert await stack.redis.zscore(stack.keys.arq_queue, job_id) is not None

            view = (await client.get(f"{JOBS}/{job_id}")).json()
            assert view["status"] == "queued"
            assert view["progress"] == {"done": 0, "failed": 0, "total": 3}
            assert view["result"] is None and view["error"] is None

            # No jobs process runs: the abort is recorded, the job stays queued (202) ...
            deleted = await client.delete(f"{JOBS}/{job_id}")
            assert deleted.status_code == 202, deleted.text
            assert deleted.json()["status"] == "queued"
            # ... and is aborted, without running, as soon as a jobs process picks it up.
            async with running_jobs(stack, tiny_model):
                view = await wait_for_status(client, job_id, {"aborted", "complete", "failed"})
                # arq's stored result is JSON too: the abort as an encoded CancelledError.
                result = await stack.redis.get(result_key_prefix + job_id)
            assert view["status"] == "aborted", view
            assert view["error"]["code"] == "aborted"
            assert view["progress"]["done"] == 0
            assert result is not None and orjson.loads(result)["r"]["exc_type"] == "CancelledError"
            # Nothing was enqueued for the aborted job.
            assert all([await stack.redis.xlen(stream) == 0 for stream in stack.keys.intake_all()])
            again = await client.delete(f"{JOBS}/{job_id}")
            assert again.status_code == 200 and again.json()["status"] == "aborted"


async def test_abort_of_a_running_job_cancels_its_waiting_requests(redis_url: str, tiny_model: Path) -> None:
    """No GPU worker: the chunk requests wait in the intake stream; the abort tombstones each one."""
    async with running_stack(redis_url, tiny_model, None, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        async with running_jobs(stack, tiny_model, jobs_max_in_flight=3):
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                created = await client.post(JOBS, json={"lines": LINES, "instruction": "x", "chunk_lines": 1})
                job_id = created.json()["id"]
                await wait_for_status(client, job_id, {"running"})
                entries = await wait_for_entries(stack.redis, stack.keys.intake_all(), 3)
                deleted = await client.delete(f"{JOBS}/{job_id}")
                assert deleted.status_code == 200, deleted.text
                assert deleted.json()["status"] == "aborted"
                assert deleted.json()["progress"] == {"done": 0, "failed": 0, "total": 10}
                await asyncio.sleep(0.3)
                # Exactly the three in flight were enqueued, background tier, and each has its tombstone.
                assert len(await all_entries(stack.redis, stack.keys.intake_all())) == 3
                background = [await stack.redis.xlen(stack.keys.intake("background", b)) for b in BUCKETS]
                assert sum(background) == 3, "chunks go to the background tier"
                for request_id in entries:
                    assert await stack.redis.exists(stack.keys.cancelled(request_id)), request_id


async def wait_for_status(client: httpx.AsyncClient, job_id: str, wanted: set[str], limit_s: float = 60) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        view = (await client.get(f"{JOBS}/{job_id}")).json()
        if view["status"] in wanted:
            return view
        assert time.monotonic() < deadline, f"job still {view['status']} after {limit_s} s: {view}"
        await asyncio.sleep(0.05)


async def all_entries(redis: Any, streams: list[str]) -> list[str]:
    ids: list[str] = []
    for stream in streams:
        for _entry_id, fields in await redis.xrange(stream):
            ids.append(orjson.loads(fields[b"d"])["id"])
    return ids


async def wait_for_entries(redis: Any, streams: list[str], count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(ids := await all_entries(redis, streams)) < count:
        assert time.monotonic() < deadline, f"only {len(ids)} of {count} chunk requests enqueued"
        await asyncio.sleep(0.05)
    return ids
