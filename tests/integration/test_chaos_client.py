"""``tailcut chaos``'s client against a real API, Redis and a worker (the zero-cost ``null`` engine):
its undisturbed reference run and a load request both read every position of the reply."""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from bench.chaos import reference
from bench.chaos_client import Spec, run_request
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import running_stack
from workers.engines.factory import start_engine
from workers.settings import EngineSettings


async def test_the_reference_run_and_a_load_request_read_every_position(redis_url: str, tiny_model: Path) -> None:
    """A plain stream carries no SSE ids, which the trace counts positions by: the reference run must
    ask for them (without, ``tailcut chaos`` stopped before its load: "no undisturbed reference run")."""
    engine = start_engine(EngineSettings(kind="null"), tiny_model, TEST_MAX_MODEL_LEN)
    spec = Spec(0, "realtime", [11, 12, 13, 14, 15, 16, 17, 18], 24)
    try:
        async with running_stack(redis_url, tiny_model, engine) as stack:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                expected = await reference(client, spec)
                trace = await run_request(
                    client, spec, random.Random(0), tenant="chaos", key="chaos-0", drop=False, repeat=False
                )
    finally:
        await engine.shutdown()
    assert len(expected) == spec.max_tokens
    assert trace.terminal == "final" and trace.error is None
    assert trace.missing() == 0 and trace.duplicates == 0
    assert trace.token_ids() == expected
