"""The API's admin-only stack dump and its event-loop metrics, on a running API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.stack import running_stack


async def test_the_stack_dump_is_admin_only_and_names_the_apis_tasks(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None, admin_key="s3cret") as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            missing = await client.get("/debug/stacks")
            wrong = await client.get("/debug/stacks", headers={"Authorization": "Bearer nope"})
            dump = await client.get("/debug/stacks", headers={"Authorization": "Bearer s3cret"})
    assert missing.status_code == 401 and wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert dump.status_code == 200
    assert "reply-router" in dump.text and "loop-watch" in dump.text and "--- " in dump.text


async def test_without_an_admin_key_the_route_does_not_exist(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            answer = await client.get("/debug/stacks", headers={"Authorization": "Bearer anything"})
    assert answer.status_code == 404


async def test_the_api_reports_its_loop_lag_and_tokenizer_queue(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            await asyncio.sleep(0.6)  # two intervals of the loop watch
            text = (await client.get("/metrics")).text
    counts = [
        line for line in text.splitlines() if line.startswith('tailcut_event_loop_lag_seconds_count{process="api"}')
    ]
    assert counts and float(counts[0].split()[-1]) >= 2
    assert 'tailcut_thread_pool_queued_tasks{pool="tokenizer",process="api"} 0.0' in text
