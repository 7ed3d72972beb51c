"""The benchmark client and load generator: metric definitions on a pure timeline, then the real SSE
client against a tiny local server that streams OpenAI-shaped chunks with known sleeps.

The server here is a fixture for the client only (it checks what the client sends and how it times
what comes back); it does not stand in for tailcut.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench import loadgen
from bench.client import (
    CHAT_COMPLETIONS,
    RequestOptions,
    TextArrival,
    Timeline,
    client_bucket,
    fetch_model,
    open_http,
    prompt_token_ids,
    request_body,
    send,
)
from bench.records import read_records
from bench.sse import sse_lines
from bench.workloads import Arrival, Workload, poisson_trace
from queues.keys import Tier
from tailcut.cli import main
from tests.unit.test_bench_serve_result import VLLM_MEASURED

FIRST_SLEEP_S = 0.05  # the fake server's wait before the first token
GAP_S = 0.01  # and between tokens
MODEL = "fake-model"

TINY_WORKLOAD = {
    "name": "tiny",
    "tenants": ["acme"],
    "tiers": [
        {"tier": "realtime", "share": 0.7, "prompt_tokens": [5, 20], "output_tokens": [2, 5], "slo": {"ttft_ms": 5000}},
        {"tier": "background", "share": 0.3, "prompt_tokens": [100, 200], "output_tokens": [3, 6]},
    ],
}


async def sleep_at_least(seconds: float) -> None:
    """``asyncio.sleep`` may wake up to a clock tick early; the fixture's delays are lower bounds the
    tests rely on."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(left)


def arrival(
    index: int, *, tenant: str = "acme", tier: Tier = "realtime", output: int = 4, at_s: float = 0.0
) -> Arrival:
    return Arrival(index=index, at_s=at_s, tier=tier, tenant=tenant, prompt_tokens=30, output_tokens=output)


# --- metric definitions (pure) ---


def test_timeline_follows_the_metric_definitions() -> None:
    timeline = Timeline(sent_s=10.0)
    for at_s in (10.1, 10.15, 10.3):
        timeline.on_chunk(at_s)
    timeline.on_final(10.35)
    record = timeline.record(arrival(7, output=3), origin_s=9.0, output_tokens=3)

    assert record.index == 7 and record.status == "ok" and record.output_tokens == 3
    assert record.sent_s == pytest.approx(1.0)
    assert record.ttft_ms == pytest.approx(100.0)  # send → first content chunk
    assert record.e2e_ms == pytest.approx(350.0)  # send → final event
    assert record.tpot_ms == pytest.approx((350.0 - 100.0) / (3 - 1))
    assert record.gaps_ms == pytest.approx([50.0, 150.0])


def test_one_token_has_no_tpot_and_chunks_count_without_usage() -> None:
    one = Timeline(sent_s=0.0)
    one.on_chunk(0.2)
    one.on_final(0.25)
    record = one.record(arrival(0, output=1), origin_s=0.0)
    assert (record.output_tokens, record.tpot_ms, record.gaps_ms) == (1, None, [])
    assert record.e2e_ms == pytest.approx(250.0)

    no_usage = Timeline(sent_s=0.0)
    for at_s in (0.1, 0.2, 0.3, 0.4):
        no_usage.on_chunk(at_s)
    no_usage.on_final(0.4)
    record = no_usage.record(arrival(1), origin_s=0.0)
    assert record.output_tokens == 4 and record.tpot_ms == pytest.approx(100.0)


def test_client_bucket_and_prompt_ids() -> None:
    assert [client_bucket(100, 27), client_bucket(100, 28), client_bucket(500, 12), client_bucket(500, 13)] == [
        "short",
        "medium",
        "medium",
        "long",
    ]
    ids = prompt_token_ids(3, 500)
    assert len(ids) == 500 and all(100 <= token < 1000 for token in ids)
    assert ids == prompt_token_ids(3, 500)
    assert ids[:16] != prompt_token_ids(4, 500)[:16] and ids[:16] != prompt_token_ids(3, 500, salt=1)[:16]


def test_a_sessions_later_turn_sends_the_earlier_turns_prompt_as_its_prefix() -> None:
    def turn(index: int, session: int, turn: int, prompt: int) -> Arrival:
        return Arrival(index, 0.0, "realtime", "default", prompt, 8, session=session, turn=turn)

    first, second = (request_body("m", turn(i, 7, i, length))["prompt"] for i, length in ((0, 120), (1, 300)))
    other = request_body("m", turn(2, 8, 0, 120))["prompt"]
    assert len(first) == 120 and len(second) == 300 and second[:120] == first
    assert other[:16] != first[:16]  # another session shares nothing
    assert request_body("m", turn(0, 7, 0, 120), salt=1)["prompt"][:16] != first[:16]


# --- the real client against a local SSE server ---


# What ``str.splitlines`` (and so httpx's ``aiter_lines``) splits at besides CR and LF; JSON leaves them as
# they are inside strings, and a model's tokens hold them now and then.
SEPARATORS = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def error_body(message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": None}}


@dataclass
class InFlight:
    """Requests the fake server is streaming now, and the most at once."""

    now: int = 0
    most: int = 0

    def __enter__(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


def fake_openai_app(received: list[tuple[dict[str, str], dict[str, Any]]], in_flight: InFlight) -> FastAPI:
    """Tenant ``shed`` gets a 429, ``broken`` a 500, ``slow`` waits 30 s, ``midway`` an error event after
    one token, ``separators`` texts holding the characters ``str.splitlines`` also splits at (each frame
    sent in two writes, cut inside its JSON); everyone else gets ``max_tokens`` text chunks (the first after FIRST_SLEEP_S, then every GAP_S),
    a finish chunk, usage and [DONE]. The chat route opens with a role-only chunk, as vLLM's server does."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        received.append((dict(request.headers), body))

        def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]})

        async def chunks() -> AsyncIterator[bytes]:
            with in_flight:
                yield chunk({"role": "assistant", "content": ""})  # no content: not the first token
                await sleep_at_least(FIRST_SLEEP_S)
                for position in range(body["max_completion_tokens"]):
                    if position:
                        await sleep_at_least(GAP_S)
                    yield chunk({"content": f" w{position}"})
                yield chunk({}, "length")
                usage = {"prompt_tokens": 17, "completion_tokens": body["max_completion_tokens"]}
                yield sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        received.append((dict(request.headers), body))
        tenant = request.headers.get("x-tailcut-tenant")
        if tenant == "shed":
            return JSONResponse(error_body("background queue is full", "rate_limit_error"), status_code=429)
        if tenant == "broken":
            return JSONResponse(error_body("internal error", "internal_error"), status_code=500)

        async def chunks() -> AsyncIterator[bytes]:
            def chunk(text: str, finish: str | None = None) -> bytes:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                return sse({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice]})

            with in_flight:
                yield chunk("")  # no content: must not count as the first token
                await sleep_at_least(30 if tenant == "slow" else FIRST_SLEEP_S)
                for position in range(body["max_tokens"]):
                    if position:
                        await sleep_at_least(GAP_S)
                    if tenant == "separators":
                        frame = chunk(f" w{position}{SEPARATORS}")
                        middle = frame.index(SEPARATORS[0].encode()) + 1
                        yield frame[:middle]
                        await asyncio.sleep(0.005)
                        yield frame[middle:]
                        continue
                    yield chunk(f" w{position}")
                    if tenant == "midway":  # the engine failed after one token
                        yield sse(error_body("the engine stopped", "service_unavailable"))
                        yield b"data: [DONE]\n\n"
                        return
                yield chunk("", "length")
                # A text prompt counts one token per word here (the client's own count may differ).
                prompt = body["prompt"]
                prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
                yield sse({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@dataclass
class FakeServer:
    url: str
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    in_flight: InFlight = field(default_factory=InFlight)


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    """uvicorn on a free loopback port, in its own thread and event loop (as a real server would be)."""
    received: list[tuple[dict[str, str], dict[str, Any]]] = []
    in_flight = InFlight()
    config = uvicorn.Config(
        fake_openai_app(received, in_flight),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        ws="none",
        timeout_graceful_shutdown=1,
    )
    uvicorn_server = uvicorn.Server(config)
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uvicorn_server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    port = uvicorn_server.servers[0].sockets[0].getsockname()[1]
    yield FakeServer(f"http://127.0.0.1:{port}", received, in_flight)
    uvicorn_server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.received.clear()
    server.in_flight.most = 0
    return server


async def test_one_request_sends_the_benchmark_body(fake: FakeServer) -> None:
    async with open_http(fake.url) as http:
        record = await send(http, MODEL, arrival(0, output=5), origin_s=time.perf_counter(), salt=9)
    ((headers, body),) = fake.received
    assert headers["x-tailcut-tier"] == "realtime" and headers["x-tailcut-tenant"] == "acme"
    assert body["prompt"] == prompt_token_ids(0, 30, salt=9)
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}

    assert record.status == "ok" and record.error is None and record.output_tokens == 5
    assert record.ttft_ms is not None and record.ttft_ms >= FIRST_SLEEP_S * 1000
    assert record.e2e_ms is not None and record.e2e_ms >= record.ttft_ms + 4 * GAP_S * 1000
    assert len(record.gaps_ms) == 4
    assert record.tpot_ms == pytest.approx((record.e2e_ms - record.ttft_ms) / 4)


async def test_a_text_with_unicode_line_separators_is_one_sse_line(fake: FakeServer) -> None:
    async with open_http(fake.url) as http:
        record = await send(http, MODEL, arrival(0, output=4, tenant="separators"), origin_s=time.perf_counter())
    assert record.status == "ok" and record.error is None, record.error
    assert record.output_tokens == 4 and len(record.gaps_ms) == 3


async def test_sse_lines_split_at_cr_lf_and_crlf_only_across_reads() -> None:
    body = f"data: a{SEPARATORS}b\r\ndata: c\r\rdata: d\n\nid: 7\r".encode()
    for cut in range(1, len(body)):  # every place a read may end, the middle of a CRLF included
        response = httpx.Response(200, stream=Reads([body[:cut], body[cut:]]))
        lines = [line async for line in sse_lines(response)]
        assert lines == [f"data: a{SEPARATORS}b", "data: c", "", "data: d", "", "id: 7"], cut


class Reads(httpx.AsyncByteStream):
    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read


async def test_closed_loop_records_every_outcome(fake: FakeServer) -> None:
    requests = [
        arrival(0, output=3),
        arrival(1, tenant="shed", tier="background"),
        arrival(2, output=2),
        arrival(3, tenant="broken"),
        arrival(4, output=4),
        arrival(5, output=1),
        arrival(6, tenant="midway"),
    ]
    result = await loadgen.run_closed_loop(fake.url, MODEL, requests, concurrency=2, timeout_s=10)

    assert [record.index for record in result.records] == list(range(7))
    assert [record.status for record in result.records] == ["ok", "rejected", "ok", "error", "ok", "ok", "error"]
    assert result.records[1].error == "HTTP 429: background queue is full"
    assert result.records[3].error == "HTTP 500: internal error"
    assert result.records[6].error == "the engine stopped" and result.records[6].output_tokens == 1
    for record in (result.records[i] for i in (0, 2, 4, 5)):
        assert record.output_tokens == requests[record.index].output_tokens
        assert record.ttft_ms is not None and record.ttft_ms >= FIRST_SLEEP_S * 1000
    assert result.records[5].tpot_ms is None
    assert 0 < result.duration_s < 5


async def test_open_loop_sends_on_schedule(fake: FakeServer) -> None:
    trace = poisson_trace(Workload.model_validate(TINY_WORKLOAD), 40.0, seed=3, count=8)
    result = await loadgen.run_open_loop(fake.url, MODEL, trace, timeout_s=10)

    assert [record.status for record in result.records] == ["ok"] * 8
    assert len(fake.received) == 8
    for planned, record in zip(trace, result.records, strict=True):
        assert record.tier == planned.tier and record.output_tokens == planned.output_tokens
        assert planned.at_s <= record.sent_s < planned.at_s + 0.2  # sent at its offset
        assert record.bucket == client_bucket(planned.prompt_tokens, planned.output_tokens)
    # Open loop: requests go out while earlier ones are still streaming (each takes ≥ 50 ms; gaps ~25 ms).
    finished_s = [record.sent_s + (record.e2e_ms or 0) / 1000 for record in result.records]
    assert any(later.sent_s < finished_s[i] for i, later in enumerate(result.records[1:]))


async def test_time_limit_and_connection_errors_become_records(fake: FakeServer, free_port: int) -> None:
    slow = [arrival(0, tenant="slow"), arrival(1), arrival(2, at_s=5.0)]
    started = time.perf_counter()
    result = await loadgen.run_open_loop(fake.url, MODEL, slow, timeout_s=0.3)
    assert time.perf_counter() - started < 2
    assert [(record.status, record.error) for record in result.records] == [
        ("error", "timeout"),
        ("ok", None),
        ("error", "timeout (not sent)"),
    ]
    closed = await loadgen.run_closed_loop(fake.url, MODEL, slow, concurrency=1, timeout_s=0.3)
    assert [record.error for record in closed.records] == ["timeout", "timeout (not sent)", "timeout (not sent)"]

    unreachable = await loadgen.run_closed_loop(f"http://127.0.0.1:{free_port}", MODEL, slow[1:2], concurrency=1)
    ((record),) = unreachable.records
    assert record.status == "error" and record.error is not None and record.error.startswith("ConnectError")


async def test_model_is_read_from_the_server(fake: FakeServer) -> None:
    assert await fetch_model(fake.url) == MODEL


def test_cli_writes_report_and_plots(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "tiny.json"
    workload.write_bytes(orjson.dumps(TINY_WORKLOAD))
    out = tmp_path / "out"
    main(["bench", "load", "--url", server.url, "--workload", str(workload), "-c", "3", "-n", "6", "--out", str(out)])

    report = orjson.loads((out / "load.json").read_bytes())
    assert report["workload"] == "tiny" and report["model"] == MODEL and report["command"]
    assert "records" not in report  # the summary only: every request's record goes beside it
    records = read_records(out / "load-records.jsonl")
    assert len(records) == 6 and {record["status"] for record in records} == {"ok"}
    assert sum(row["num_requests"] for row in report["tiers"]) == 6
    for name in ("load_cdf_e2e.png", "load_cdf_ttft.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "realtime" in capsys.readouterr().out


# --- vllm bench serve's language: text prompts, the chat route, a concurrency cap, the result JSON ---


def text_arrival(index: int, text: str, *, output: int = 4, at_s: float = 0.0) -> TextArrival:
    return TextArrival(index, at_s, "normal", "default", len(text.split()), output, text=text)


async def test_a_text_prompt_goes_as_one_user_message_on_the_chat_route(fake: FakeServer) -> None:
    options = RequestOptions(endpoint=CHAT_COMPLETIONS, ignore_eos=False, temperature=0.5)
    async with open_http(fake.url) as http:
        record = await send(
            http, MODEL, text_arrival(0, "what is a queue"), origin_s=time.perf_counter(), options=options
        )
    ((headers, body),) = fake.received
    assert body["messages"] == [{"role": "user", "content": "what is a queue"}]
    assert body["max_completion_tokens"] == 4 and "max_tokens" not in body and "prompt" not in body
    assert "ignore_eos" not in body and body["temperature"] == 0.5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert headers["x-tailcut-tier"] == "normal"
    assert record.status == "ok" and record.output_tokens == 4 and len(record.gaps_ms) == 3
    # The role-only opening chunk arrives at once; the first token only after FIRST_SLEEP_S.
    assert record.ttft_ms is not None and record.ttft_ms >= FIRST_SLEEP_S * 1000
    assert record.prompt_tokens == 17  # the server's count (usage), as vLLM's client takes it

    with pytest.raises(ValueError, match="text prompts"):
        request_body(MODEL, arrival(1), options=options)


async def test_a_text_prompt_on_the_completions_route_is_the_prompt_string(fake: FakeServer) -> None:
    async with open_http(fake.url) as http:
        options = RequestOptions(ignore_eos=True, temperature=None)
        record = await send(http, MODEL, text_arrival(0, "one two three four five"), origin_s=0.0, options=options)
    ((_, body),) = fake.received
    assert body["prompt"] == "one two three four five" and body["max_tokens"] == 4
    assert body["ignore_eos"] is True and "temperature" not in body
    assert record.status == "ok" and record.prompt_tokens == 5


async def test_max_concurrency_holds_due_requests_in_the_client(fake: FakeServer) -> None:
    trace = [arrival(index, output=5) for index in range(6)]  # all due at once
    capped = await loadgen.run_open_loop(fake.url, MODEL, trace, timeout_s=10, max_concurrency=2)
    assert [record.status for record in capped.records] == ["ok"] * 6
    assert fake.in_flight.most == 2
    # The third waited for a slot: it was sent after the first two finished, and its TTFT starts there.
    first_done_s = min(record.sent_s + (record.e2e_ms or 0) / 1000 for record in capped.records[:2])
    assert capped.records[2].sent_s >= first_done_s - 0.01
    assert all((record.ttft_ms or 0) < 2 * FIRST_SLEEP_S * 1000 + 200 for record in capped.records)

    fake.in_flight.most = 0
    uncapped = await loadgen.run_open_loop(fake.url, MODEL, trace, timeout_s=10)
    assert fake.in_flight.most == 6 and all(record.sent_s < 0.1 for record in uncapped.records)


def sharegpt_file(path: Path, count: int) -> Path:
    """``count`` complete conversations of known word counts, then one cut mid-string (as the packaged file)."""
    words = "hello world question answer please thanks what why how when where which who".split()
    entries = [
        {
            "id": f"c{number}",
            "conversations": [
                {"from": "human", "value": " ".join(words[: 5 + number % 8])},
                {"from": "gpt", "value": " ".join(reversed(words))},
            ],
        }
        for number in range(count)
    ]
    whole = orjson.dumps([*entries, {"id": "cut", "conversations": [{"from": "human", "value": "x" * 50}]}])
    path.write_bytes(whole[: len(whole) - 30])
    return path


def test_cli_sharegpt_run_writes_vllms_result_fields(
    server: FakeServer, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.received.clear()
    server.in_flight.most = 0
    dataset = sharegpt_file(tmp_path / "sharegpt.json", 12)
    out = tmp_path / "out"
    main(
        [
            "bench", "load", "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--tokenizer", str(tiny_model), "--num-prompts", "6", "--request-rate", "40", "--burstiness", "0.5",
            "--max-concurrency", "3", "--sharegpt-output-len", "4", "--goodput", "ttft:5000", "e2el:10000",
            "--seed", "3", "--out", str(out),
        ]
    )  # fmt: skip
    report = orjson.loads((out / "load.json").read_bytes())
    header = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts"]
    header += ["request_rate", "burstiness", "max_concurrency"]
    assert list(report)[: len(header) + len(VLLM_MEASURED)] == header + VLLM_MEASURED
    assert (report["backend"], report["model_id"], report["num_prompts"]) == ("openai", MODEL, 6)
    assert (report["request_rate"], report["burstiness"], report["max_concurrency"]) == (40.0, 0.5, 3)
    assert report["completed"] == 6 and report["failed"] == 0 and report["total_output_tokens"] == 24
    assert report["request_goodput"] == pytest.approx(6 / report["duration"])
    assert report["dataset_conversations_complete"] == 12 and report["dataset_truncated"] is True
    assert report["tokenizer_id"] == str(tiny_model) and server.in_flight.most <= 3
    bodies = [body for _, body in server.received]
    assert len(bodies) == 6 and all(isinstance(body["prompt"], str) and body["max_tokens"] == 4 for body in bodies)
    assert all("ignore_eos" not in body for body in bodies)  # a dataset's requests end at EOS unless asked
    # The server counted a text prompt's words: total_input_tokens is the server's count, as in vLLM.
    assert report["total_input_tokens"] == sum(len(body["prompt"].split()) for body in bodies)
    assert len(read_records(out / "load-records.jsonl")) == 6
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s):" in printed
    assert "12 complete conversations" in printed


def test_cli_random_dataset_open_loops_keep_todays_options(server: FakeServer, tmp_path: Path) -> None:
    workload = tmp_path / "tiny.json"
    workload.write_bytes(orjson.dumps(TINY_WORKLOAD))
    common = ["bench", "load", "--url", server.url, "--workload", str(workload)]
    # Today's Poisson trace for a duration: the workload's own trace (bench.workloads.poisson_trace).
    main([*common, "--rate", "40", "--duration", "0.3", "--seed", "2", "--out", str(tmp_path / "poisson")])
    report = orjson.loads((tmp_path / "poisson" / "load.json").read_bytes())
    trace = poisson_trace(Workload.model_validate(TINY_WORKLOAD), 40.0, seed=2, duration_s=0.3)
    assert report["num_prompts"] == report["completed"] == len(trace) and report["request_rate"] == 40.0
    # vLLM's language on the random dataset: all at once (the default rate), token-id prompts, ignore_eos.
    server.received.clear()
    main([*common, "--num-prompts", "5", "--out", str(tmp_path / "burst")])
    report = orjson.loads((tmp_path / "burst" / "load.json").read_bytes())
    assert report["request_rate"] == "inf" and report["completed"] == 5 and report["workload"] == "tiny"
    assert all(isinstance(body["prompt"], list) and body["ignore_eos"] is True for _, body in server.received)


def test_cli_sharegpt_on_the_chat_route_and_bad_combinations(
    server: FakeServer, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.received.clear()
    dataset = sharegpt_file(tmp_path / "sharegpt.json", 5)
    common = ["bench", "load", "--url", server.url, "--tokenizer", str(tiny_model), "--num-prompts", "3"]
    main([*common, "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--backend", "openai-chat"])
    assert [len(body["messages"]) for _, body in server.received] == [1, 1, 1]
    capsys.readouterr()
    for extra, words in (
        (["--backend", "openai-chat"], "only /v1/completions"),  # the random dataset sends token ids
        (["--dataset-path", str(dataset)], "--dataset-path is for"),
        (["--request-rate", "0"], "must be positive"),
        (["-c", "2", "--request-rate", "4"], "closed loop"),
        (["--duration", "5"], "give --num-prompts N"),
        (["--goodput", "itl:5"], "unknown metric"),
    ):
        with pytest.raises(SystemExit) as exited:
            main([*common, *extra])
        assert exited.value.code == 2
        assert words in capsys.readouterr().err, extra


def test_without_the_bench_extra_tailcut_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the `bench` extra were not installed
    with pytest.raises(SystemExit) as exited:
        main(["bench", "load", "--url", "http://127.0.0.1:9"])
    assert exited.value.code == 2
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
