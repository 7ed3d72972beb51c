"""The staged cold start on the real vLLM engine (CPU, tiny model): a worker with a backlog waiting runs
no more requests than its ramp has open at each stage, opens up step by step, and says which stage it
is in on /readyz, the status data and its metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tailcut.exposition import serve_metrics
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine
from workers.metrics import worker_registry

pytestmark = pytest.mark.engine

MAX_RUNNING = 20
REQUESTS = 24


async def test_a_starting_worker_runs_no_more_than_its_ramp_allows(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    # Stage 1 for 2 s at 10% (2 requests); stage 2 in four 1 s steps (6, 10, 14, 18); then all 20.
    warmup = {"stage1_s": 2.0, "stage2_s": 4.0}
    worker = {"max_running": MAX_RUNNING, "warmup": warmup}
    body = {"model": "tiny", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "tier": "normal"}
    async with running_stack(redis_url, tiny_model, engine, worker=worker) as stack:
        (serving,) = stack.workers
        server = serve_metrics(worker_registry(serving), host="127.0.0.1", port=0)
        assert server is not None
        try:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                async with asyncio.timeout(10):  # until the worker's first beat describes it
                    while serving.worker_id not in (ready := (await client.get("/readyz")).json())["warmup"]:
                        await asyncio.sleep(0.05)
                assert ready["warmup"][serving.worker_id]["stage"] == 1, ready
                metrics = (await client.get(f"http://127.0.0.1:{server.server_port}/metrics")).text
                assert 'tailcut_worker_warmup_stage{worker="' in metrics
                assert "tailcut_worker_capacity_ratio" in metrics
                requests = [
                    asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": list(range(5, 25 + i))}))
                    for i in range(REQUESTS)
                ]
                most: dict[int, int] = {1: 0, 2: 0, 3: 0}
                over: list[tuple[int, int, float]] = []
                while not all(task.done() for task in requests):
                    running, capacity = len(serving.running_ids), serving.running_capacity
                    if running > capacity:
                        over.append((running, capacity, serving.capacity_fraction))
                    stage = serving.warmup_stage
                    most[stage] = max(most[stage], running)
                    await asyncio.sleep(0.01)
                answers = [task.result() for task in requests]
                async with asyncio.timeout(10):
                    while serving.warmup_stage < 3:
                        await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)  # a heartbeat rewrites the worker's description
                status = (await client.get("/status/data")).json()
                ready = (await client.get("/readyz")).json()
        finally:
            server.shutdown()
            server.server_close()
    assert all(answer.status_code == 200 for answer in answers)
    assert not over, f"more running than the ramp allowed: {over[:5]}"
    assert most[1] <= 2, most
    assert max(most[2], most[3]) >= 6, f"the ramp never opened up: {most}"
    assert ready["warmup"][serving.worker_id] == {"stage": 3, "capacity": 1.0, "prefix_warmup": "0/0"}
    (shown,) = status["workers"]
    assert shown["warmup_stage"] == 3 and shown["capacity"] == 1.0
