"""Stop strings on the real engine (vLLM on CPU) across the engine calls a long reply is sliced into:
the reply ends where the stop string begins even when it spans a slice boundary, and text held back at
a boundary in case it begins one reaches the client once it does not."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from queues.messages import SamplingSpec
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

PROMPT = list(range(300, 340))
MAX_TOKENS = 300


async def unsliced(engine: VllmEngine) -> tuple[str, list[int]]:
    """The engine's own greedy text in one call, and where in it each token's text ends."""
    text, ends = "", []
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async for delta in engine.generate("stop-reference", PROMPT, spec, priority=0):
        text += delta.text
        ends += [len(text)] * len(delta.token_ids)
    return text, ends


def spanning(text: str, at: int) -> str | None:
    """The shortest piece of ``text`` that crosses position ``at`` and occurs nowhere before it."""
    for width in range(2, 24):
        for start in range(max(0, at - width + 1), at):
            piece = text[start : start + width]
            if len(piece) == width and text.find(piece) == start:
                return piece
    return None


async def test_a_stop_string_across_a_slice_boundary_ends_the_reply_and_held_text_is_not_lost(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    text, ends = await unsliced(engine)
    # The tiny model repeats itself: slice the reply where its text first crosses into something new, so a
    # stop string can span the first boundary and occur nowhere before it.
    slice_tokens, stop = next(
        (tokens, piece) for tokens in range(4, MAX_TOKENS // 2) if (piece := spanning(text, ends[tokens - 1]))
    )
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    worker = {"scheduler": {"slice_tokens": slice_tokens}}
    async with running_stack(redis_url, tiny_model, engine, worker=worker) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            stopped = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()
            # A stop string that never occurs: the text held at every boundary is all sent, in order.
            whole = (await client.post("/v1/completions", json={**body, "stop": ["\x07" * 8]})).json()
    assert stopped["choices"][0]["finish_reason"] == "stop", (slice_tokens, stop, stopped)
    assert stopped["choices"][0]["text"] == text[: text.find(stop)]
    assert slice_tokens < stopped["usage"]["completion_tokens"] < MAX_TOKENS
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["text"] == text
