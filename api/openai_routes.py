"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from admission.request import ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokenPrompt
from api.errors import error_body_of, error_response
from api.metrics import RequestTracker
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.responses import EventStreamResponse, OrjsonResponse
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from api.state import ApiState
from queues import intake, output
from queues.messages import OutputEvent, RequestMessage, SamplingOptions
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
TIER_HEADER = "x-tailcut-tier"
TENANT_HEADER = "x-tailcut-tenant"
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
    get_state(request).admitter.check_model(body.model)
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    max_tokens = body.max_completion_tokens or body.max_tokens
    generation = generation_request(body, ChatPrompt(messages), request, max_tokens=max_tokens)
    return await respond(get_state(request), request, body, generation, ChatRenderer)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    get_state(request).admitter.check_model(body.model)
    if body.echo or body.suffix:
        raise InvalidRequestError("`echo` and `suffix` are not supported", param="echo" if body.echo else "suffix")
    generation = generation_request(body, completion_prompt(body), request, max_tokens=body.max_tokens)
    return await respond(get_state(request), request, body, generation, CompletionRenderer)


def completion_prompt(body: CompletionRequest) -> Prompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidRequestError(
                "only one prompt per request is supported; send one request per prompt", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    return TokenPrompt([int(token) for token in prompt])  # type: ignore[arg-type]


def generation_request(
    body: GenerationFields, prompt: Prompt, request: Request, *, max_tokens: int | None
) -> GenerationRequest:
    """The OpenAI body as admission's neutral request; refuses what tailcut does not support."""
    if body.n != 1:
        raise InvalidRequestError("n > 1 is not supported; send n requests instead", param="n")
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported by tailcut yet", param="logprobs")
    header_tier = request.headers.get(TIER_HEADER)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationRequest(
        prompt=prompt,
        reply_to=get_state(request).settings.api_id,
        tier=body.tier or header_tier,
        tier_source="tier" if body.tier else "X-Tailcut-Tier header",
        tenant=request.headers.get(TENANT_HEADER) or body.user,
        max_tokens=max_tokens,
        sampling=SamplingOptions(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
        ),
    )


async def submit(state: ApiState, generation: GenerationRequest) -> tuple[RequestMessage, ReplyStream]:
    """Admit (or refuse: 400, 404, 429), register the reply stream, then enqueue: accepted once the
    XADD returns."""
    try:
        message = await state.admitter.admit(generation)
    except OverloadedError as exc:
        state.metrics.shed.labels(exc.tier).inc()
        raise
    stream = state.router.open(message.id)
    try:
        await intake.enqueue(state.redis, state.keys, message)
    except RedisError as exc:
        stream.close()
        raise ServiceUnavailableError(f"the request queue (Redis) does not answer: {exc}") from exc
    state.backlog.admitted(message.tier)
    return message, stream


async def respond(
    state: ApiState,
    request: Request,
    body: GenerationFields,
    generation: GenerationRequest,
    renderer_type: type[Renderer],
) -> Response:
    message, stream = await submit(state, generation)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    renderer = renderer_type(
        message.id, state.model.name, return_token_ids=body.return_token_ids, include_usage=include_usage
    )
    tracker = state.metrics.track(message, state.admitter)
    headers = {REQUEST_ID_HEADER: message.id}
    if body.stream:
        return EventStreamResponse(event_stream(state, stream, renderer, tracker), headers=headers)
    try:
        whole = await until_disconnect(request, collect(stream, renderer, tracker))
    except ClientGone:
        state.spawn(send_cancel(state, message.id))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except TailcutError as exc:
        # Accepted, then failed (deadline passed, worker error): the id still names it.
        return error_response(exc, headers=headers)
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
                    frames.append(sse(error_body_of(error)))
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
