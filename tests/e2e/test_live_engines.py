"""The model-free engines in the whole pipeline: HTTP → Redis → worker → engine → Redis → HTTP.

Workers run the ``null`` engine and the ``sim`` engine (the SIMULATOR in real time), built by the
same factory ``tailcut worker`` uses, on a real Redis; clients stream through the real API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from admission.tokenizer import PromptTokenizer
from tests.sse import DONE, finish_reasons, stream_events, streamed_token_ids
from tests.stack import running_stack
from workers.engines.factory import start_engine
from workers.engines.filler import filler_token
from workers.engines.sim_live import RealtimeSimEngine
from workers.settings import EngineSettings


def chat_body(index: int, max_tokens: int, tier: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"question {index}: how long is the queue?"}],
        "max_tokens": max_tokens,
        "stream": True,
        "tier": tier,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }


async def stream_through(
    redis_url: str, model_dir: Path, settings: EngineSettings, max_tokens: list[int]
) -> tuple[list[list[Any]], object]:
    engine = start_engine(settings, model_dir, None)
    tiers = ["realtime", "normal", "background"]
    try:
        # Slices of 8 tokens: longer replies go through continuations (prompt + generated so far).
        async with running_stack(redis_url, model_dir, engine, worker={"scheduler": {"slice_tokens": 8}}) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                streams = await asyncio.gather(
                    *(
                        stream_events(client, "/v1/chat/completions", chat_body(index, limit, tiers[index % 3]))
                        for index, limit in enumerate(max_tokens)
                    )
                )
    finally:
        await engine.shutdown()
    return streams, engine


@pytest.mark.parametrize("kind", ["null", "sim"])
async def test_model_free_engine_streams_every_token_with_usage_end_to_end(
    redis_url: str, tiny_model: Path, kind: str
) -> None:
    settings = EngineSettings(kind=kind, sim_time_scale=0.25)
    max_tokens = [5, 12, 20, 1, 9, 17]
    streams, engine = await stream_through(redis_url, tiny_model, settings, max_tokens)
    filler = filler_token(tiny_model)
    tokenizer = PromptTokenizer(tiny_model, num_threads=1)
    for index, (limit, events) in enumerate(zip(max_tokens, streams, strict=True)):
        assert streamed_token_ids(events) == [filler.token_id] * limit
        text = "".join(event["choices"][0]["delta"].get("content", "") for event in events[:-2])
        assert text == filler.text * limit == tokenizer._tokenizer.decode([filler.token_id] * limit)
        assert finish_reasons(events) == ["length"]
        assert events[-1] == DONE and events.count(DONE) == 1
        prompt_ids = await tokenizer.encode_chat(
            [{"role": "user", "content": f"question {index}: how long is the queue?"}]
        )
        assert events[-2]["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": limit,
            "total_tokens": len(prompt_ids) + limit,
        }
    tokenizer.close()
    if isinstance(engine, RealtimeSimEngine):
        # Sliced replies: the 20-token one took three engine calls of at most 8 tokens.
        calls = {request_id for step in engine.steps for request_id in step.result.scheduled_tokens}
        assert len(calls) >= len(max_tokens) + 2
