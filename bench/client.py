"""A streaming OpenAI client (``/v1/completions`` or ``/v1/chat/completions``) that times each request as
WORKLOADS.md defines the metrics.

It sends what vLLM's benchmark client sends: for a synthetic request the prompt as token ids (so its
length is exact) with ``ignore_eos`` (so the reply has exactly ``max_tokens`` tokens); for a dataset's
request (``TextArrival``) the prompt text, or one user message on the chat route, with ``ignore_eos`` only
when asked; usage in the last chunk. The tier and tenant go as ``X-Tailcut-*`` headers, which vLLM's own
server ignores: one client measures tailcut and the bare engine server alike. A request never raises:
every outcome, including a timeout, becomes a record.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson

from admission.config import BucketEdges
from bench.sse import sse_lines
from bench.stats import RequestRecord, Status, tpot_ms
from bench.workloads import Arrival, session_token_ids
from queues.keys import Bucket
from tailcut.errors import FatalError

TIER_HEADER = "X-Tailcut-Tier"
TENANT_HEADER = "X-Tailcut-Tenant"
# Prompt token ids come from this range: inside every benchmarked model's vocabulary (the tiny test model
# has 2,048 ids) and clear of the special tokens at its start.
PROMPT_ID_LOW, PROMPT_ID_HIGH = 100, 1000


def client_bucket(prompt_tokens: int, output_tokens: int) -> Bucket:
    """The client's approximation of admission's bucket (default edges): the server buckets prompt +
    *predicted* output, which a client cannot see; it uses the requested output (the real one, with
    ``ignore_eos``)."""
    return BucketEdges().of(prompt_tokens + output_tokens)


def prompt_token_ids(index: int, num_tokens: int, *, salt: int = 0) -> list[int]:
    """Token ids distinct per request (and per ``salt``): a repeated prompt would let the engine's prefix
    cache skip prefill and flatter whatever runs second on a warm server."""
    rng = np.random.default_rng([salt, index])
    return [int(token) for token in rng.integers(PROMPT_ID_LOW, PROMPT_ID_HIGH, size=num_tokens)]


COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class TextArrival(Arrival):
    """A request whose prompt is text (a dataset's): ``prompt_tokens`` is its length as the sampling
    tokenizer counted it, ``output_tokens`` the ``max_tokens`` asked for."""

    text: str = ""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How every request of a run is sent. The default is what the synthetic benchmarks always sent:
    the completions route, ``ignore_eos``, greedy."""

    endpoint: str = COMPLETIONS
    ignore_eos: bool = True
    temperature: float | None = 0.0  # None: not sent (the server's default)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


DEFAULT_OPTIONS = RequestOptions()


def completion_body(model: str, arrival: Arrival, *, salt: int = 0) -> dict[str, Any]:
    """The body of a synthetic (token-id) request on the completions route, with the default options."""
    return request_body(model, arrival, salt=salt)


def request_body(
    model: str, arrival: Arrival, *, salt: int = 0, options: RequestOptions = DEFAULT_OPTIONS
) -> dict[str, Any]:
    """The streamed request body of ``arrival``: its text (``TextArrival``) or its token ids as the prompt,
    or its text as one user message on the chat route."""
    prompt: str | list[int]
    if isinstance(arrival, TextArrival):
        prompt = arrival.text
    elif arrival.prompt_ids is not None:
        prompt = list(arrival.prompt_ids)
    elif arrival.session is not None:
        # A session's turns share their leading ids: turn k's prompt starts with turn k-1's, so the
        # engine's prefix cache can serve that part (the reply it holds is the model's own, not the
        # trace's, so only the previous prompt is a hit).
        prompt = session_token_ids(
            arrival.session, arrival.prompt_tokens, low=PROMPT_ID_LOW, high=PROMPT_ID_HIGH, salt=salt
        )
    else:
        prompt = prompt_token_ids(
            arrival.index if arrival.prompt_of is None else arrival.prompt_of, arrival.prompt_tokens, salt=salt
        )
    body: dict[str, Any] = {"model": model}
    if options.chat:
        if not isinstance(prompt, str):
            raise ValueError("the chat route takes text prompts; send token ids to /v1/completions")
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = arrival.output_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = arrival.output_tokens
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.temperature is not None:
        body["temperature"] = options.temperature
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


class Timeline:
    """When one request's events arrived → its record. Pure (times are passed in, ``perf_counter``
    seconds), so the metric definitions are tested without a network.

    ``on_chunk`` is called for content chunks only (non-empty text): role, finish and usage chunks carry
    no tokens and do not count for TTFT or gaps.
    """

    def __init__(self, sent_s: float) -> None:
        self.sent_s = sent_s
        self.content_s: list[float] = []
        self.final_s: float | None = None

    def on_chunk(self, at_s: float) -> None:
        self.content_s.append(at_s)

    def on_final(self, at_s: float) -> None:
        self.final_s = at_s

    def record(
        self,
        arrival: Arrival,
        *,
        origin_s: float,
        output_tokens: int | None = None,
        prompt_tokens: int | None = None,
        status: Status = "ok",
        error: str | None = None,
    ) -> RequestRecord:
        """``output_tokens`` and ``prompt_tokens`` from the usage chunk; without one, the number of content
        chunks and the arrival's prompt length."""
        num_tokens = len(self.content_s) if output_tokens is None else output_tokens
        ttft_ms = (self.content_s[0] - self.sent_s) * 1000 if self.content_s else None
        e2e_ms = (self.final_s - self.sent_s) * 1000 if self.final_s is not None else None
        return RequestRecord(
            index=arrival.index,
            tier=arrival.tier,
            bucket=client_bucket(arrival.prompt_tokens, arrival.output_tokens),
            tenant=arrival.tenant,
            prompt_tokens=arrival.prompt_tokens if prompt_tokens is None else prompt_tokens,
            output_tokens=num_tokens,
            sent_s=self.sent_s - origin_s,
            ttft_ms=ttft_ms,
            e2e_ms=e2e_ms,
            tpot_ms=None
            if ttft_ms is None or e2e_ms is None
            else tpot_ms(ttft_ms=ttft_ms, e2e_ms=e2e_ms, output_tokens=num_tokens),
            gaps_ms=[(later - earlier) * 1000 for earlier, later in itertools.pairwise(self.content_s)],
            status=status,
            error=error,
        )


def open_http(base_url: str) -> httpx.AsyncClient:
    """An HTTP client for load: no connection cap (httpx's default of 100 would queue requests inside the
    client and hide the server's queueing) and no read timeout (the load generator bounds the run)."""
    return httpx.AsyncClient(
        base_url=base_url,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(None, connect=10.0),
    )


async def fetch_model(base_url: str) -> str:
    """The first model the server lists (``GET /v1/models``)."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as http:
            response = await http.get("/v1/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise FatalError(f"cannot read the model from {base_url}/v1/models ({exc}); pass --model") from exc


async def send(
    http: httpx.AsyncClient,
    model: str,
    arrival: Arrival,
    *,
    origin_s: float,
    deadline_s: float | None = None,
    salt: int = 0,
    options: RequestOptions = DEFAULT_OPTIONS,
) -> RequestRecord:
    """Send one streamed completion and record it. ``origin_s`` (``perf_counter``) is the run's start, the
    zero of ``sent_s``; past ``deadline_s`` (``perf_counter``) the request is abandoned as a ``timeout``."""
    body = orjson.dumps(request_body(model, arrival, salt=salt, options=options))
    headers = {TIER_HEADER: arrival.tier, TENANT_HEADER: arrival.tenant, "content-type": "application/json"}
    timeline = Timeline(time.perf_counter())
    status: Status = "ok"
    error: str | None = None
    usage = _Usage()
    try:
        async with asyncio.timeout(None if deadline_s is None else deadline_s - time.perf_counter()):
            async with http.stream("POST", options.endpoint, content=body, headers=headers) as response:
                if response.status_code == 200:
                    error = await _read_events(response, timeline, usage, chat=options.chat)
                    status = "ok" if error is None else "error"
                else:
                    status = "rejected" if response.status_code == 429 else "error"
                    error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
    except TimeoutError:
        status, error = "error", "timeout"
    except Exception as exc:  # a benchmark records every failure instead of stopping the run
        status, error = "error", f"{type(exc).__name__}: {exc}"
    return timeline.record(
        arrival,
        origin_s=origin_s,
        output_tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
        status=status,
        error=error,
    )


@dataclass(slots=True)
class _Usage:
    """The usage chunk's counts, when the stream had one."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


async def _read_events(response: httpx.Response, timeline: Timeline, usage: _Usage, *, chat: bool) -> str | None:
    """Time the content chunks (a chat delta's ``content``, a completion's ``text``) and the final event,
    note the usage chunk's counts; returns the in-stream error if any."""
    error: str | None = None
    done_s: float | None = None
    async for line in sse_lines(response):
        at_s = time.perf_counter()
        if not line.startswith("data:"):
            continue
        payload = line.removeprefix("data:").strip()
        if payload == "[DONE]":
            done_s = at_s  # read on to the end, so that the connection can be reused
            continue
        event = orjson.loads(payload)
        if event.get("error"):
            error = _error_message(payload)
        elif choices := event.get("choices"):
            choice = choices[0]
            if (choice.get("delta") or {}).get("content") if chat else choice.get("text"):
                timeline.on_chunk(at_s)
        if counts := event.get("usage"):
            usage.completion_tokens = int(counts["completion_tokens"])
            if counts.get("prompt_tokens") is not None:
                usage.prompt_tokens = int(counts["prompt_tokens"])
    # Without a [DONE] line, the end of the stream is the final event.
    timeline.on_final(time.perf_counter() if done_s is None else done_s)
    return error


def _error_message(body: bytes | str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        return text[:200]
