"""The chaos run's client: streams a request, may drop it and resume it after its last event id, may
repeat its Idempotency-Key, and keeps what it saw of every position (``StreamTrace``)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from bench.sse import sse_lines

RESUME_ATTEMPTS = 40
RESUME_BACKOFF_S = 0.5


@dataclass(frozen=True, slots=True)
class Spec:
    """One of the distinct greedy requests the run repeats (each has one uninterrupted reference)."""

    index: int
    tier: str
    prompt: list[int]
    max_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "tier": self.tier,
        }


@dataclass
class StreamTrace:
    """What the client saw of one accepted request, over however many connections."""

    spec: Spec
    request_id: str = ""
    accepted: bool = False
    rejected_status: int | None = None  # refused before acceptance (429, 503)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # position → token ids
    times: dict[int, float] = field(default_factory=dict)  # position → time.monotonic() received
    duplicates: int = 0
    terminal: str | None = None  # "final" | "error"
    degraded: dict[str, Any] | None = None
    error: str | None = None
    resumes: int = 0
    replayed_as: str | None = None  # a repeated Idempotency-Key answered with this request id
    replay_tokens: list[int] | None = None

    @property
    def last_id(self) -> int:
        return max(self.tokens, default=0)

    def token_ids(self) -> list[int]:
        return [token for position in sorted(self.tokens) for token in self.tokens[position]]

    def missing(self) -> int:
        """Tokens a completed reply lacks: it asked for exactly ``max_tokens`` (``ignore_eos``). Counted
        in tokens, not positions: a frame carries the tokens of every position up to its id (the API
        joins a stream's pending chunks into one frame at the last one's position), so skipped ids are
        no gap; a lost position shows here, and in the comparison with the reference."""
        if self.terminal != "final" or self.degraded is not None:
            return 0
        return max(0, self.spec.max_tokens - len(self.token_ids()))

    def see(self, event_id: int | None, payload: Any, now: float) -> None:
        if not isinstance(payload, dict):
            return
        if "error" in payload:
            error = payload["error"]
            self.terminal, self.error = "error", f"{error.get('code')}: {error.get('message')}"
            return
        if payload.get("tailcut"):
            self.degraded = payload["tailcut"]
        if event_id is None:
            return
        if event_id <= self.last_id:  # positions only grow: a repeat, or one out of order
            self.duplicates += 1
            return
        choice = payload["choices"][0] if payload.get("choices") else {}
        self.tokens[event_id] = list(choice.get("token_ids") or [])
        self.times[event_id] = now
        if choice.get("finish_reason"):
            self.terminal = "final"


async def read_events(response: httpx.Response, trace: StreamTrace, *, stop_after: int | None = None) -> bool:
    """Feed the SSE events of ``response`` to ``trace``; True when the stream ended with [DONE]. With
    ``stop_after``, drop the connection after that many new positions."""
    event_id: int | None = None
    seen = 0
    async for line in sse_lines(response):
        if line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                return True
            trace.see(event_id, orjson.loads(payload), time.monotonic())
            event_id = None
            seen += 1
            if stop_after is not None and seen >= stop_after:
                return False
    return False


async def run_request(
    client: httpx.AsyncClient,
    spec: Spec,
    rng: random.Random,
    *,
    tenant: str,
    key: str,
    drop: bool,
    repeat: bool,
    trace: StreamTrace | None = None,
) -> StreamTrace:
    """Send ``spec`` as a resumable stream; on a drop (chosen, or the connection failed) resume after
    the last event id until the request ends, or it is declared lost. ``trace``: where to record (so a
    caller that gives up on the request still has what it saw)."""
    trace = trace or StreamTrace(spec)
    repeats: list[asyncio.Task[None]] = []
    try:
        await _send(client, spec, rng, tenant=tenant, key=key, drop=drop, repeat=repeat, trace=trace, repeats=repeats)
        for task in repeats:
            await task
    finally:
        for task in repeats:
            task.cancel()
    return trace


async def _send(
    client: httpx.AsyncClient,
    spec: Spec,
    rng: random.Random,
    *,
    tenant: str,
    key: str,
    drop: bool,
    repeat: bool,
    trace: StreamTrace,
    repeats: list[asyncio.Task[None]],
) -> None:
    headers = {"Idempotency-Key": key, "X-Tailcut-Tenant": tenant}
    try:
        async with client.stream("POST", "/v1/completions", json=spec.body(), headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                trace.rejected_status = response.status_code
                return
            trace.accepted = True
            trace.request_id = response.headers["x-tailcut-request-id"]
            if repeat:
                repeats.append(asyncio.create_task(_repeat(client, spec, headers, trace)))
            stop_after = rng.randint(3, max(4, spec.max_tokens // 2)) if drop else None
            if await read_events(response, trace, stop_after=stop_after):
                return
    except httpx.HTTPError as exc:
        if not trace.accepted:
            trace.rejected_status = -1
            trace.error = f"{type(exc).__name__}: {exc}"
            return
    if drop:
        await asyncio.sleep(rng.uniform(0.0, 2.0))
    await resume(client, trace, tenant)


async def _repeat(client: httpx.AsyncClient, spec: Spec, headers: dict[str, str], trace: StreamTrace) -> None:
    """The same Idempotency-Key again, while the first one runs: it must name the same request."""
    await asyncio.sleep(0.2)
    shadow = StreamTrace(spec)
    for _ in range(RESUME_ATTEMPTS):
        try:
            async with client.stream("POST", "/v1/completions", json=spec.body(), headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    await asyncio.sleep(RESUME_BACKOFF_S)
                    continue
                trace.replayed_as = response.headers["x-tailcut-request-id"]
                if await read_events(response, shadow):
                    trace.replay_tokens = shadow.token_ids()
                    return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(RESUME_BACKOFF_S)


async def resume(client: httpx.AsyncClient, trace: StreamTrace, tenant: str) -> None:
    """Read the rest of the request after the last event id, as often as it takes."""
    for _ in range(RESUME_ATTEMPTS):
        if trace.terminal is not None:
            return
        trace.resumes += 1
        headers = {"X-Tailcut-Tenant": tenant, "Last-Event-ID": str(trace.last_id)}
        try:
            async with client.stream("GET", f"/v1/requests/{trace.request_id}", headers=headers) as response:
                if response.status_code == 404:
                    await response.aread()
                    trace.error = "resume: 404"
                    return
                if response.status_code != 200:
                    await response.aread()
                elif await read_events(response, trace):
                    return
        except httpx.HTTPError:
            pass
        if trace.terminal == "error" and trace.error and "does not answer" in trace.error:
            trace.terminal, trace.error = None, None  # Redis was away: an interruption, not the end
        await asyncio.sleep(RESUME_BACKOFF_S)


POISON: list[tuple[str, bytes | dict[str, Any]]] = [
    ("not JSON", b'{"prompt": '),
    ("unknown tier", {"prompt": "hello", "tier": "gold"}),
    ("over the context", {"prompt": list(range(1, 4001))}),
    ("negative max_tokens", {"prompt": "hello", "max_tokens": -1}),
    ("token outside the vocabulary", {"prompt": [999_999_999]}),
    ("wrong type", {"prompt": "hello", "temperature": "hot"}),
    ("a megabyte of text", {"prompt": "word " * 200_000, "max_tokens": 4}),
    ("empty chat", {"messages": []}),
]


async def send_poison(client: httpx.AsyncClient) -> list[tuple[str, int, bool]]:
    """Inputs no service should take: (what, status, answered with an OpenAI-shaped 4xx)."""
    answers = []
    for what, body in POISON:
        try:
            if isinstance(body, bytes):
                response = await client.post(
                    "/v1/completions", content=body, headers={"Content-Type": "application/json"}
                )
            else:
                response = await client.post("/v1/completions", json=body)
            shaped = 400 <= response.status_code < 500 and "error" in response.json()
            answers.append((what, response.status_code, shaped))
        except (httpx.HTTPError, ValueError) as exc:
            answers.append((f"{what} ({type(exc).__name__})", -1, False))
    unknown = await client.get("/v1/requests/0000000000000000", headers={"X-Tailcut-Tenant": "chaos"})
    answers.append(("resume of an unknown id", unknown.status_code, unknown.status_code == 404))
    return answers
