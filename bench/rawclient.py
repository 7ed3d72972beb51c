"""A raw HTTP client that counts SSE chunks on the wire, and a canned SSE server that measures a client's
own ceiling.

``bench.client`` (httpx, parses every event) costs about 100 µs of CPU per chunk and tops out near 8,000
chunks/s on one core; the raw client here costs a few µs per chunk, so ``tailcut bench overhead`` can
saturate the server side. The canned server answers every request at once with a reply shaped like
tailcut's stream, at far less CPU per chunk than a real server: what a client reaches against it is
the client's own ceiling.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from bench import loadgen
from bench.client import TENANT_HEADER, TIER_HEADER, Timeline, completion_body
from bench.stats import RequestRecord
from bench.workloads import Arrival
from tailcut import aio

T = TypeVar("T")

# The raw client counts content chunks by this mark instead of parsing each event: the finish chunk says
# "length", the usage chunk has no choice, so only content chunks carry it.
RAW_CONTENT_MARK = b'"finish_reason":null'
# How a streamed reply ends on the wire: the [DONE] event, then the last chunk of chunked encoding.
RAW_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"
# The usage chunk's output token count follows this, in the reply's last bytes.
RAW_USAGE_MARK = b'"completion_tokens":'
DIGITS = re.compile(rb"\d+")
# Bytes of the reply kept from one read to the next: the end mark and the usage chunk before it.
RAW_TAIL_BYTES = 512
RAW_READ_BYTES = 1 << 16
RAW_OK = b"HTTP/1.1 200"


class RawReplyError(Exception):
    """The reply was not a 200 event stream, or the connection ended early (the connection is dropped)."""


def usage_tokens(tail: bytes) -> int | None:
    """``completion_tokens`` of the usage chunk in ``tail`` (the reply's last bytes), None without one."""
    at = tail.rfind(RAW_USAGE_MARK)
    if at < 0:
        return None
    digits = DIGITS.match(tail, at + len(RAW_USAGE_MARK))
    return int(digits.group()) if digits else None


async def raw_send(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, timeline: Timeline
) -> tuple[int, int | None]:
    """Send one prepared request on a keep-alive connection and time its reply; returns its content chunks
    and its output tokens (from the usage chunk; None without one).

    Every chunk of one socket read gets that read's time (as ``bench.client`` stamps every line of a read).
    No event is parsed: chunks are counted by ``RAW_CONTENT_MARK``, the end found by ``RAW_END`` and the
    token count read from the last bytes, so the client spends a few microseconds per chunk where the
    httpx client spends about a hundred. A chunk may carry several tokens (a server that fell behind
    coalesces them, as vLLM's ``stream_interval`` does): tokens are what the usage chunk says.
    """
    writer.write(request)
    count_tail = end_tail = b""
    num_chunks = 0
    status: bytes | None = b""  # the reply's first bytes until the status is known, then None
    while True:
        data = await reader.read(RAW_READ_BYTES)
        at_s = time.perf_counter()
        if not data:
            raise RawReplyError("the server closed the connection mid-reply")
        if status is not None:
            status += data
            if len(status) >= len(RAW_OK):
                if not status.startswith(RAW_OK):
                    raise RawReplyError(status.split(b"\r\n", 1)[0].decode(errors="replace"))
                status = None
        counted = count_tail + data
        found = counted.count(RAW_CONTENT_MARK)
        for _ in range(found):
            timeline.on_chunk(at_s)
        num_chunks += found
        # Keep fewer bytes than a mark, so no mark is counted twice; enough to find one split across reads.
        count_tail = counted[-(len(RAW_CONTENT_MARK) - 1) :]
        ended = end_tail + data
        if ended.endswith(RAW_END):
            timeline.on_final(at_s)
            return num_chunks, usage_tokens(ended)
        end_tail = ended[-RAW_TAIL_BYTES:]


def raw_request(host: str, body: bytes, arrival: Arrival) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{TIER_HEADER}: {arrival.tier}\r\n{TENANT_HEADER}: {arrival.tenant}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_raw_closed_loop(
    url: str, model: str, requests: Sequence[Arrival], *, concurrency: int, timeout_s: float
) -> loadgen.LoadResult:
    """``bench.loadgen.run_closed_loop`` with the raw client: ``concurrency`` keep-alive connections, each
    sending its next request when the previous reply ended. Same requests, same records."""
    import secrets

    import orjson

    host_port = url.removeprefix("http://").rstrip("/")
    host, port = host_port.rsplit(":", 1)
    salt = secrets.randbits(32)
    pending = iter(requests)
    origin_s = time.perf_counter()
    deadline_s = origin_s + timeout_s

    async def worker() -> list[RequestRecord]:
        records: list[RequestRecord] = []
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            for arrival in pending:
                timeline = Timeline(time.perf_counter())
                if timeline.sent_s >= deadline_s:
                    records.append(timeline.record(arrival, origin_s=origin_s, status="error", error="timeout"))
                    continue
                body = orjson.dumps(completion_body(model, arrival, salt=salt))
                try:
                    async with asyncio.timeout(deadline_s - timeline.sent_s):
                        if connection is None:
                            connection = await asyncio.open_connection(host, int(port))
                        _chunks, tokens = await raw_send(*connection, raw_request(host_port, body, arrival), timeline)
                    records.append(timeline.record(arrival, origin_s=origin_s, output_tokens=tokens))
                except (RawReplyError, OSError, TimeoutError) as exc:
                    error = "timeout" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                    records.append(timeline.record(arrival, origin_s=origin_s, status="error", error=error))
                    if connection is not None:
                        connection[1].close()
                    connection = None
        finally:
            if connection is not None:
                connection[1].close()
        return records

    per_worker = await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration_s = time.perf_counter() - origin_s
    records = sorted((record for records in per_worker for record in records), key=lambda record: record.index)
    return loadgen.LoadResult(records, duration_s, salt)


CANNED_SERVER = "import sys; from bench.rawclient import serve_canned; serve_canned(int(sys.argv[1]), int(sys.argv[2]))"


def canned_frames(num_chunks: int) -> list[bytes]:
    """The SSE frames of one reply shaped like tailcut's ``/v1/completions`` stream: ``num_chunks`` content
    chunks, the finish chunk, the usage chunk and ``[DONE]``."""
    import orjson

    def chunk(text: str, finish_reason: str | None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "canned"}
        return b"data: " + orjson.dumps({**body, "choices": [choice], "usage": None}) + b"\n\n"

    usage = {"prompt_tokens": 1, "completion_tokens": num_chunks, "total_tokens": num_chunks + 1}
    usage_frame = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "canned"}
    return [
        *(chunk(" x", None) for _ in range(num_chunks)),
        chunk("", "length"),
        b"data: " + orjson.dumps({**usage_frame, "choices": [], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]


def serve_canned(port: int, num_chunks: int) -> None:
    """A stand-in server that answers every POST with a canned SSE reply at once, one frame per write,
    yielding between frames so concurrent replies interleave as tailcut's do. It costs far less CPU per
    chunk than a real server: what the client reaches against it is the client's own ceiling."""
    frames = [f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in canned_frames(num_chunks)]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in request_head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(head)
                for frame in frames:
                    writer.write(frame)
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    run_async(main())


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where installed (it comes with uvicorn[standard]): the client's ceiling is higher."""
    return aio.run(coroutine)
