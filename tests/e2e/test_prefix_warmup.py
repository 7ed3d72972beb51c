"""Prefix warmup on the real vLLM engine (CPU, tiny model): a starting worker serves at once while it
warms, gives the engine back as soon as a request arrives, and afterwards a warmed question finds its
prompt in vLLM's prefix cache where a question nobody warmed does not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from queues.messages import SamplingSpec
from tailcut.models import encode_chat
from tests.stack import running_stack
from warmup.prefixes import POLL_S, QaEntry, conversation, load_qa, plan
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

SAMPLE = Path(__file__).resolve().parents[2] / "warmup" / "qa" / "customer-service.jsonl"
TOP_N = 60
BLOCK = 32  # vLLM's CPU block size: only full blocks are cached


async def cached_tokens(engine: VllmEngine, request_id: str, prompt_ids: list[int]) -> int:
    async for delta in engine.generate(request_id, prompt_ids, SamplingSpec(temperature=0, max_tokens=1), priority=0):
        return delta.num_cached_tokens
    raise AssertionError("no output")


async def test_a_worker_serves_while_it_warms_and_warmed_questions_hit_the_prefix_cache(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    entries = load_qa(SAMPLE)
    warm = plan(entries, tokenizer, top_n=TOP_N, kv_tokens=engine.kv_capacity_tokens // 2, max_prompt_tokens=2000)
    assert warm.questions == TOP_N, warm.questions  # the test's KV share holds them all
    question = {"role": "user", "content": entries[0].question}
    body = {"model": "tiny", "messages": [question], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    async with running_stack(redis_url, tiny_model, engine, prefixes=warm.prompts) as stack:
        (worker,) = stack.workers
        warmer = worker.prefix_warmer
        assert warmer is not None and warmer.total == len(warm.prompts)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            async with asyncio.timeout(10):  # warmup is under way: readiness does not wait for it
                while not (warmer.in_flight and (await client.get("/readyz")).json()["ready"]):
                    await asyncio.sleep(0.01)
            request = asyncio.create_task(client.post("/v1/chat/completions", json={**body, "tier": "realtime"}))
            async with asyncio.timeout(10):
                while not worker.accepted:
                    await asyncio.sleep(0.005)
            arrived = asyncio.get_running_loop().time()
            warming_alongside: list[tuple[float, int]] = []
            while not request.done():
                since = asyncio.get_running_loop().time() - arrived
                if since > POLL_S + 0.2 and warmer.in_flight:
                    warming_alongside.append((since, warmer.in_flight))
                await asyncio.sleep(0.005)
            answer = request.result()
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 40
            assert not warming_alongside, f"warmup kept the engine while a request ran: {warming_alongside[:5]}"
            # The warmer gave way: it aborted the prompts it had in the engine, or (when they finished
            # before its next look) it waited before starting more; or it had nothing left to run.
            assert warmer.yielded + warmer.paused > 0 or warmer.finished
            async with asyncio.timeout(120):
                while not warmer.finished:
                    await asyncio.sleep(0.1)
            assert warmer.done == warmer.total and warmer.failed == 0
            await asyncio.sleep(1.5)  # a heartbeat rewrites the worker's description
            ready = (await client.get("/readyz")).json()
            assert ready["warmup"][worker.worker_id]["prefix_warmup"] == f"{warmer.total}/{warmer.total}"
    # The last warmed question (never asked through the API) finds every full block of its prompt
    # cached; a question of the same length that nobody warmed finds only the template's prefix.
    warmed = warm.prompts[-1]
    assert await cached_tokens(engine, "check-warmed", warmed) == (len(warmed) - 1) // BLOCK * BLOCK
    words = "zebra quartz violin " * 40
    cold = encode_chat(tokenizer, conversation(QaEntry(words)))[: len(warmed)]
    assert await cached_tokens(engine, "check-cold", cold) < (len(warmed) - 1) // BLOCK * BLOCK
