"""A request's output events as an HTTP response: SSE frames or one whole body; and what happens
when the client leaves.

A frame carries its event's position as the SSE ``id:`` (for ``Last-Event-ID``) only where a client
can resume with it: streams of resumable requests, ``GET /v1/requests/{id}`` streams, and any stream
whose client asked with ``X-Tailcut-Event-Ids: true``. Other streams are framed exactly as OpenAI's
and vLLM's servers frame them (``data: <json>`` and a blank line), which clients that parse SSE by
hand, ``vllm bench serve`` among them, rely on.

A client that leaves cancels its request at once (the worker aborts it in the engine), unless the
request is resumable (it was sent with an ``Idempotency-Key``): then the cancel waits
``resume_grace_s`` and is sent only if no client attached again meanwhile (``GET /v1/requests/{id}``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request

from api.errors import error_body_of
from api.metrics import RequestTracker
from api.render import Renderer
from api.responses import DONE, PING
from api.shutdown import resume_hint, resume_where
from api.state import ApiState
from queues import output, requests
from queues.messages import OutputEvent
from queues.replies import ReplyStream
from tailcut.errors import DeadlineExceededError, InvalidRequestError, ServiceUnavailableError, TailcutError

T = TypeVar("T")
EVENT_IDS_HEADER = "x-tailcut-event-ids"


def sse(data: dict[str, Any], event_id: int | None = None) -> bytes:
    return sse_json(orjson.dumps(data), event_id)


def sse_json(body: bytes, event_id: int | None = None) -> bytes:
    """One SSE frame of the JSON ``body`` (with ``event_id`` as its ``id:``)."""
    frame = b"data: " + body + b"\n\n"
    return frame if event_id is None else b"id: %d\n" % event_id + frame


def wants_event_ids(request: Request) -> bool:
    """Whether the client asked for SSE ids on a stream that would have none (``X-Tailcut-Event-Ids``)."""
    value = request.headers.get(EVENT_IDS_HEADER)
    if value is None:
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise InvalidRequestError(
        f"X-Tailcut-Event-Ids must be true or false, got {value[:40]!r}", param="X-Tailcut-Event-Ids"
    )


def event_frames(event: OutputEvent, renderer: Renderer, *, ids: bool = True) -> list[bytes]:
    """The SSE frames of one event; with ``ids``, the last one carries its position as the SSE id."""
    seq = event.seq if ids else None
    if event.type == "chunk":
        return [sse_json(renderer.content_json(event), seq)]
    if event.type == "final":
        if renderer.include_usage:
            return [sse(renderer.finish(event)), sse(renderer.usage_chunk(event), seq)]
        return [sse(renderer.finish(event), seq)]
    if event.type == "error":
        return [sse(error_body_of(event_error(event)), seq)]
    if event.type == "degraded":
        return [sse(renderer.notice(event), seq)]
    return []


def coalesced(batch: list[OutputEvent]) -> list[OutputEvent]:
    """``batch`` with each run of consecutive chunks joined into one chunk at the run's last position
    (texts and token ids in order): a client whose stream fell behind gets one frame for what it
    missed rather than one per position. The batch's own events are left as they are."""
    if len(batch) < 2:
        return batch
    joined: list[OutputEvent] = []
    copied = False  # whether joined[-1] is a chunk made here (safe to extend)
    for event in batch:
        last = joined[-1] if joined else None
        if last is None or event.type != "chunk" or last.type != "chunk":
            joined.append(event)
            copied = False
            continue
        if not copied:
            last = joined[-1] = OutputEvent(
                rid=last.rid, seq=last.seq, type="chunk", text=last.text, token_ids=list(last.token_ids)
            )
            copied = True
        last.seq = event.seq
        last.text += event.text
        last.token_ids += event.token_ids
    return joined


async def reply_batches(stream: ReplyStream) -> AsyncIterator[list[OutputEvent]]:
    """A live request's batches, each run of chunks joined (``coalesced``): what the client gets, and
    what the answer cache stores and a hit replays as it is; the stream is closed however the reading
    ends."""
    try:
        async for batch in stream.batches():
            yield coalesced(batch)
    finally:
        stream.close()


async def event_stream(
    state: ApiState,
    request_id: str,
    batches: AsyncIterator[list[OutputEvent]],
    renderer: Renderer,
    *,
    tracker: RequestTracker | None,
    opening: bool,
    resumable: bool,
    event_ids: bool,
    enqueued: bool = True,
) -> AsyncIterator[bytes]:
    finished = handed_off = False
    last_seq: int | None = None
    state.metrics.open_streams.inc()
    try:
        # The chat stream's role chunk leaves with the first event, as vLLM's server sends it with the
        # first token: clients that time the first token from the first chunk with ``choices`` (vLLM's
        # ``bench serve``) would otherwise time the queue's acceptance. The headers leave at once.
        first = renderer.opening() if opening else None
        frames: list[bytes] = [sse(first)] if first is not None else []
        # Since when the source has said "nothing yet" (an empty batch) without an event between: no
        # clock is read for a batch that is written.
        silent_s: float | None = None
        async with state.drain.bounded():
            async for batch in batches:
                if not batch:  # still waiting: a comment now and then keeps proxies from cutting the stream
                    now_s = time.monotonic()
                    if silent_s is None:
                        silent_s = now_s
                    elif now_s - silent_s >= state.settings.sse_ping_s:
                        silent_s = now_s
                        yield PING
                    continue
                silent_s = None
                # Events that arrived together leave together: one ASGI message and one socket write for
                # the batch instead of one per chunk (a lagging API thereby writes less per chunk, not more).
                if tracker is not None:
                    tracker.on_batch(batch)
                for event in batch:
                    frames += event_frames(event, renderer, ids=event_ids)
                    finished = finished or event.terminal
                    last_seq = event.seq
                if finished:
                    frames.append(DONE)
                if frames:
                    yield b"".join(frames)
                    frames = []
    except TimeoutError:
        # This process is stopping and its grace time is up: the request runs on; tell the client
        # where to read the rest, after which position. The frame has no id, so Last-Event-ID stays
        # the last position sent.
        handed_off = True
        yield sse(error_body_of(resume_hint(request_id, last_seq=last_seq))) + DONE
    except RedisError as exc:
        # A resume reads Redis itself: say why the stream ends, and where to pick it up again.
        where = resume_where(request_id, last_seq=last_seq)
        yield sse(
            error_body_of(
                ServiceUnavailableError(f"the output store does not answer ({exc}); later, read the rest with {where}")
            )
        )
    finally:
        state.metrics.open_streams.dec()
        if not finished and not handed_off and enqueued:
            # The client left. Sent from a detached task because this generator is being cancelled.
            state.spawn(leave(state, request_id, resumable=resumable))
        await aclose(batches)


async def aclose(batches: AsyncIterator[list[OutputEvent]]) -> None:
    close = getattr(batches, "aclose", None)
    if close is not None:
        await close()


async def collect(
    events: AsyncIterator[list[OutputEvent]], renderer: Renderer, tracker: RequestTracker | None
) -> dict[str, Any]:
    texts: list[str] = []
    token_ids: list[int] = []
    try:
        async for batch in events:
            if tracker is not None:
                tracker.on_batch(batch)
            for event in batch:
                if event.type == "chunk":
                    texts.append(event.text)
                    token_ids += event.token_ids
                elif event.type == "final":
                    return renderer.whole("".join(texts), token_ids, event)
                elif event.type == "error":
                    raise event_error(event)
    finally:
        await aclose(events)
    raise ServiceUnavailableError("the output stream ended without a final event")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the caller gave up (the drain deadline): so does the work
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def leave(state: ApiState, request_id: str, *, resumable: bool) -> None:
    """The client of ``request_id`` left before its end: cancel it, at once or, for a resumable
    request, after the grace time unless another client attached meanwhile."""
    try:
        if resumable and state.settings.resume_grace_s > 0:
            before = await requests.attachments(state.redis, state.keys, request_id)
            await asyncio.sleep(state.settings.resume_grace_s)
            if await requests.attachments(state.redis, state.keys, request_id) != before:
                return
        await output.cancel(state.redis, state.keys, request_id, ttl_s=state.settings.cancel_ttl_s)
    except RedisError:
        # The worker still finishes the request; its output expires unread.
        pass


def event_error(event: OutputEvent) -> TailcutError:
    """The error a worker reported, as the exception the HTTP edge renders."""
    message = event.error_message or "the request failed"
    code = event.error_code
    if code == "invalid_request":
        return InvalidRequestError(message, code=code)
    if code == "expired":
        return DeadlineExceededError(message)
    return ServiceUnavailableError(message, code=code)
