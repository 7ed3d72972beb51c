"""Redis Sentinel failover under a streaming load, with the real engine: a primary, one replica and three
``redis-sentinel`` processes (``tests.sentinel``), the API and two workers connected through the
Sentinels, and clients streaming completions while the primary changes — by ``SENTINEL FAILOVER``, and
by SIGKILL of the primary, which a supervisor then starts again (empty; the Sentinels make it the new
primary's replica) — once per intake durability level.

Each scenario counts, for every request a client sent: refused (503/429 before it was accepted: the
client knows to send it again), completed (every token, then the final chunk), failed explicitly (an
error event), lost (accepted, then an end that is not its own: ``request_lost``, or no terminal event
at all). The table is printed; BENCHMARKS.md quotes a run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.sentinel import SentinelGroup, sentinel_group
from tests.sse import DONE, frames, streamed_token_ids
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

CLIENTS = 8
MAX_TOKENS = 24
# The load runs this long before the primary changes, and goes on at least this long once a new one is
# known: until every client has completed a request sent after that, or AFTER_MAX_S have passed (the
# requests in flight through the change finish first: a take-over, a lost request noticed, a few seconds
# on a busy machine).
BEFORE_S = 2.0
AFTER_S = 3.0
AFTER_MAX_S = 30.0
# An accepted stream that has not ended this long after the load stopped counts as lost.
STREAM_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    refused: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    bad_streams: list[str] = field(default_factory=list)  # accepted streams without exactly one terminal
    completed_after: int = 0  # of the requests sent once the new primary was known

    @property
    def accepted(self) -> int:
        return self.completed + self.failed + self.lost

    def row(self, durability: str, event: str) -> str:
        return (
            f"| {durability} | {event} | {self.refused + self.accepted} | {self.accepted} | {self.completed} | "
            f"{self.failed} | {self.lost} | {self.refused} |"
        )


async def one_request(client: httpx.AsyncClient, index: int, outcome: Outcome, *, after: bool) -> bool:
    """Send one streaming completion and count how it ended; False when it was refused."""
    body = {
        "model": "tiny",
        "prompt": [10 + index % 50, 11, 12, 13, 14, 15, 16, 17],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    events: list[Any] = []
    try:
        async with asyncio.timeout(STREAM_TIMEOUT_S):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    outcome.refused += 1
                    return False
                events = [payload async for _id, payload in frames(response)]
    except (TimeoutError, httpx.HTTPError) as exc:
        outcome.lost += 1
        outcome.bad_streams.append(f"request {index}: no terminal event ({exc!r}, {len(events)} events)")
        return True
    errors = [event["error"] for event in events if isinstance(event, dict) and "error" in event]
    finals = [
        event
        for event in events
        if isinstance(event, dict) and event.get("choices") and event["choices"][0].get("finish_reason")
    ]
    if len(errors) + len(finals) != 1 or not events or events[-1] != DONE:
        outcome.bad_streams.append(f"request {index}: {len(errors)} errors, {len(finals)} finals")
    if errors:
        code = str(errors[0].get("code"))
        outcome.errors[code] = outcome.errors.get(code, 0) + 1
        if code == "request_lost":
            outcome.lost += 1
        else:
            outcome.failed += 1
    elif len(streamed_token_ids(events)) == MAX_TOKENS:
        outcome.completed += 1
        outcome.completed_after += after
    else:
        outcome.lost += 1
        outcome.bad_streams.append(f"request {index}: {len(streamed_token_ids(events))} of {MAX_TOKENS} tokens")
    return True


async def scenario(group: SentinelGroup, tiny_model: Path, engine: VllmEngine, durability: str, event: str) -> Outcome:
    """Streaming load through the API and two workers; the primary changes by ``event`` after
    ``BEFORE_S``; the load goes on ``AFTER_S`` after a new primary is known, and on until ``CLIENTS``
    requests sent since then have completed (at most ``AFTER_MAX_S``); every stream is awaited."""
    outcome = Outcome()
    stop, recovered = asyncio.Event(), asyncio.Event()
    async with running_stack(
        group.endpoint,
        tiny_model,
        engine,
        num_workers=2,
        intake_durability=durability,
        intake_replica_wait_ms=200,
        redis_timeout_s=2.0,
    ) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=STREAM_TIMEOUT_S) as client:
            counter = iter(range(1_000_000))

            async def client_loop() -> None:
                while not stop.is_set():
                    accepted = await one_request(client, next(counter), outcome, after=recovered.is_set())
                    if not accepted and not stop.is_set():
                        await asyncio.sleep(0.2)  # a refused client backs off a little

            loops = [asyncio.create_task(client_loop()) for _ in range(CLIENTS)]
            try:
                await asyncio.sleep(BEFORE_S)
                primary = await group.primary()
                if event == "failover":
                    group.failover()
                    await group.primary(other_than=primary)
                else:
                    group.kill(primary)
                    promoted = await group.primary(other_than=primary, replicated=False)
                    group.restart(primary, replica_of=promoted)  # back, empty, as the new primary's replica
                    await group.primary(other_than=primary)
                recovered.set()
                await asyncio.sleep(AFTER_S)
                deadline = time.monotonic() + AFTER_MAX_S - AFTER_S
                while outcome.completed_after < CLIENTS and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            finally:
                stop.set()
                await asyncio.gather(*loops)
    return outcome


async def test_streams_through_a_sentinel_failover_and_a_killed_primary_at_each_durability(
    tiny_model: Path, engine: VllmEngine
) -> None:
    """Four scenarios (durability ``primary`` and ``replica`` × forced failover and SIGKILL of the
    primary), each on a fresh Sentinel deployment. Every accepted stream ends with exactly one
    terminal event; with ``replica``, no accepted request is lost in the forced failover; the
    pipeline serves again after each change without a restart."""
    results: dict[tuple[str, str], Outcome] = {}
    for durability in ("primary", "replica"):
        for event in ("failover", "kill"):
            started = time.monotonic()
            with sentinel_group() as group:
                outcome = await scenario(group, tiny_model, engine, durability, event)
            results[durability, event] = outcome
            print(f"\n{durability}/{event}: {time.monotonic() - started:.0f} s, errors {outcome.errors}")
    print("\n| durability | primary change | sent | accepted | completed | failed explicitly | lost | refused (503) |")
    print("|---|---|---|---|---|---|---|---|")
    for (durability, event), outcome in results.items():
        print(outcome.row(durability, event))
    for (durability, event), outcome in results.items():
        assert not outcome.bad_streams, f"{durability}/{event}: {outcome.bad_streams}"
        # The load went on: requests sent once the new primary was known completed, same processes.
        assert outcome.completed_after >= CLIENTS, f"{durability}/{event}: {outcome.completed_after} after"
    assert results["replica", "failover"].lost == 0
