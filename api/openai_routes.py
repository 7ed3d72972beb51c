"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api.admission import TENANT_HEADER, TIER_HEADER
from api.errors import error_body
from api.metrics import RequestTracker
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.responses import EventStreamResponse, OrjsonResponse
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from api.state import ApiState
from queues import intake, output
from queues.messages import OutputEvent, RequestMessage
from queues.replies import ReplyStream
from tailcut.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
    TailcutError,
)

T = TypeVar("T")
REQUEST_ID_HEADER = "X-Tailcut-Request-Id"
DONE = b"data: [DONE]\n\n"
# Status logged for a request whose client left before the response (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.tailcut
    return state


async def check_auth(request: Request) -> None:
    keys = get_state(request).settings.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    token = header.removeprefix("Bearer ").strip()
    if token not in keys:
        raise AuthenticationError("missing or unknown API key; send `Authorization: Bearer <key>`")


router = APIRouter(dependencies=[Depends(check_auth)])


@router.get("/v1/models")
async def list_models(request: Request) -> OrjsonResponse:
    state = get_state(request)
    model = {
        "id": state.model.name,
        "object": "model",
        "created": 0,
        "owned_by": "tailcut",
        "max_model_len": state.model.max_model_len,
    }
    return OrjsonResponse({"object": "list", "data": [model]})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.admission.check_model(body.model)
    tier = state.admission.resolve_tier(body, request.headers.get(TIER_HEADER))
    prompt = await state.admission.chat_prompt(body)
    message = state.admission.build(
        body,
        prompt,
        tier=tier,
        tenant_header=request.headers.get(TENANT_HEADER),
        requested_max_tokens=body.max_completion_tokens or body.max_tokens,
        reply_to=state.settings.api_id,
    )
    return await respond(state, request, body, message, ChatRenderer)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.admission.check_model(body.model)
    if body.echo or body.suffix:
        raise InvalidRequestError("`echo` and `suffix` are not supported", param="echo" if body.echo else "suffix")
    tier = state.admission.resolve_tier(body, request.headers.get(TIER_HEADER))
    prompt = await state.admission.completion_prompt(body)
    message = state.admission.build(
        body,
        prompt,
        tier=tier,
        tenant_header=request.headers.get(TENANT_HEADER),
        requested_max_tokens=body.max_tokens,
        reply_to=state.settings.api_id,
    )
    return await respond(state, request, body, message, CompletionRenderer)


async def submit(state: ApiState, message: RequestMessage) -> ReplyStream:
    """Shed if the tier's queue is full; else register the reply stream, then enqueue: accepted once
    the XADD returns."""
    limits = state.settings.shed_limits()
    waiting = state.backlog.waiting(message.tier)
    if limits.sheds(message.tier, waiting):
        state.metrics.shed.labels(message.tier).inc()
        limit = limits.limit(message.tier)
        raise OverloadedError(
            f"the {message.tier} queue is full ({waiting} requests waiting, limit {limit}); retry later",
            retry_after_s=state.backlog.retry_after_s(message.tier, limit),
        )
    stream = state.router.open(message.id)
    try:
        await intake.enqueue(state.redis, state.keys, message)
    except RedisError as exc:
        stream.close()
        raise ServiceUnavailableError(f"the request queue (Redis) does not answer: {exc}") from exc
    state.backlog.admitted(message.tier)
    return stream


async def respond(
    state: ApiState,
    request: Request,
    body: GenerationFields,
    message: RequestMessage,
    renderer_type: type[Renderer],
) -> Response:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    renderer = renderer_type(
        message.id, state.model.name, return_token_ids=body.return_token_ids, include_usage=include_usage
    )
    stream = await submit(state, message)
    tracker = state.metrics.track(message, state.admission.predictor)
    headers = {REQUEST_ID_HEADER: message.id}
    if body.stream:
        return EventStreamResponse(event_stream(state, stream, renderer, tracker), headers=headers)
    try:
        whole = await until_disconnect(request, collect(stream, renderer, tracker))
    except ClientGone:
        state.spawn(send_cancel(state, message.id))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        stream.close()
    return OrjsonResponse(whole, headers=headers)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def event_stream(
    state: ApiState, stream: ReplyStream, renderer: Renderer, tracker: RequestTracker
) -> AsyncIterator[bytes]:
    finished = False
    state.metrics.open_streams.inc()
    try:
        opening = renderer.opening()
        if opening is not None:
            yield sse(opening)
        async for batch in stream.batches():
            # Events that arrived together leave together: one ASGI message and one socket write for the
            # batch instead of one per chunk (a lagging API thereby writes less per chunk, not more).
            frames: list[bytes] = []
            for event in batch:
                tracker.on_event(event)
                if event.type == "chunk":
                    frames.append(sse(renderer.content(event)))
                elif event.type == "final":
                    finished = True
                    frames.append(sse(renderer.finish(event)))
                    if renderer.include_usage:
                        frames.append(sse(renderer.usage_chunk(event)))
                elif event.type == "error":
                    finished = True
                    error = event_error(event)
                    frames.append(sse(error_body(error.message, error.error_type, code=error.code)))
            if finished:
                frames.append(DONE)
            if frames:
                yield b"".join(frames)
    finally:
        stream.close()
        state.metrics.open_streams.dec()
        if not finished:
            # The client left (or the server is stopping): cancel so the worker aborts the engine
            # request. Sent from a detached task because this generator is being cancelled.
            state.spawn(send_cancel(state, stream.request_id))


async def collect(stream: ReplyStream, renderer: Renderer, tracker: RequestTracker) -> dict[str, Any]:
    texts: list[str] = []
    token_ids: list[int] = []
    async for event in stream.events():
        tracker.on_event(event)
        if event.type == "chunk":
            texts.append(event.text)
            token_ids += event.token_ids
        elif event.type == "final":
            return renderer.whole("".join(texts), token_ids, event)
        elif event.type == "error":
            raise event_error(event)
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
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def send_cancel(state: ApiState, request_id: str) -> None:
    try:
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
