"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from admission.request import ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokenPrompt
from api import limits
from api.answers import AnswerCache, Recorder, cached_batches, is_tiny
from api.auth import api_key_of, check_auth, get_state, tier_for
from api.errors import error_response
from api.limits import Lease
from api.render import renderer_for
from api.replay import replay
from api.responses import EventStreamResponse, OrjsonResponse
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from api.shutdown import resume_hint
from api.state import ApiState
from api.streaming import ClientGone, collect, event_stream, leave, reply_batches, until_disconnect, wants_event_ids
from queues import requests
from queues.intake import NotReplicatedError
from queues.messages import DEFAULT_TENANT, OutputEvent, RequestMessage, SamplingOptions
from queues.replies import ReplyStream
from queues.requests import RequestRecord, Route
from tailcut.errors import InvalidRequestError, OverloadedError, ServiceUnavailableError, TailcutError

TIER_HEADER = "x-tailcut-tier"
TENANT_HEADER = "x-tailcut-tenant"
REQUEST_ID_HEADER = "X-Tailcut-Request-Id"
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_IDEMPOTENCY_KEY = 255
# Status logged for a request whose client left before the response (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


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
    context = get_state(request).model.max_model_len
    for name, value in (("max_tokens", body.max_tokens), ("max_completion_tokens", body.max_completion_tokens)):
        if value is not None and value > context:  # also the one the other overrides
            raise InvalidRequestError(f"`{name}` is {value}, over this model's context of {context} tokens", param=name)
    generation = generation_request(body, ChatPrompt(messages), request, max_tokens=max_tokens)
    # Only the user's own words (no system prompt, no earlier turns): a tiny one may use the shared pool.
    own_words_only = len(messages) == 1 and messages[0]["role"] == "user"
    return await respond(get_state(request), request, body, generation, "chat", own_words_only=own_words_only)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    get_state(request).admitter.check_model(body.model)
    if body.echo or body.suffix:
        raise InvalidRequestError("`echo` and `suffix` are not supported", param="echo" if body.echo else "suffix")
    generation = generation_request(body, completion_prompt(body), request, max_tokens=body.max_tokens)
    return await respond(get_state(request), request, body, generation, "completion", own_words_only=True)


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


# vLLM's constrained-output fields: any value asks for output tailcut does not constrain.
CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def refuse_unsupported(body: GenerationFields) -> None:
    """A 400 for a field whose effect tailcut would otherwise drop without a word (what the schema
    admits of them means "none"): the client learns it must ask differently, not from a wrong reply."""
    if body.best_of not in (None, 1):
        raise InvalidRequestError(
            "`best_of` must be 1: tailcut returns one completion per request; send several and pick", param="best_of"
        )
    if body.use_beam_search:
        raise InvalidRequestError("beam search is not supported by tailcut", param="use_beam_search")
    if body.logit_bias:
        raise InvalidRequestError("`logit_bias` is not supported by tailcut yet", param="logit_bias")
    if body.response_format is not None and body.response_format.get("type") != "text":
        kind = body.response_format.get("type")
        raise InvalidRequestError(
            f"`response_format` {kind!r} is not supported: tailcut does not constrain its output yet "
            "(only {'type': 'text'})",
            param="response_format",
        )
    for name in CONSTRAINTS:
        if getattr(body, name) is not None:
            raise InvalidRequestError(
                f"`{name}` is not supported: tailcut does not constrain its output yet", param=name
            )
    if body.prompt_logprobs is not None:
        raise InvalidRequestError("prompt logprobs are not supported by tailcut yet", param="prompt_logprobs")
    if isinstance(body, ChatCompletionRequest):
        for name in ("tools", "functions"):
            if getattr(body, name):
                raise InvalidRequestError(f"tool calling (`{name}`) is not supported by tailcut yet", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(body, name) not in (None, "none", "auto"):
                raise InvalidRequestError(
                    f"tool calling (`{name}`) is not supported by tailcut yet; send 'none' or leave it out", param=name
                )


def generation_request(
    body: GenerationFields, prompt: Prompt, request: Request, *, max_tokens: int | None
) -> GenerationRequest:
    """The OpenAI body as admission's neutral request; refuses what tailcut does not support."""
    if body.n != 1:
        raise InvalidRequestError("n > 1 is not supported; send n requests instead", param="n")
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported by tailcut yet", param="logprobs")
    refuse_unsupported(body)
    header_tier = request.headers.get(TIER_HEADER)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    tier, tenant = body.tier or header_tier, request.headers.get(TENANT_HEADER) or body.user
    key = api_key_of(request)
    if key is not None:  # the key decides: its tenant, and a tier it may use
        tier, tenant = tier_for(key, tier), key.tenant
    return GenerationRequest(
        prompt=prompt,
        reply_to=get_state(request).settings.api_id,
        tier=tier,
        tier_source="tier" if body.tier else "X-Tailcut-Tier header",
        tenant=tenant,
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


async def admit(state: ApiState, generation: GenerationRequest, record: RequestRecord) -> RequestMessage:
    """Admit the request or refuse it (400, 404, 429)."""
    try:
        return await state.admitter.admit(generation, request_id=record.id)
    except OverloadedError as exc:
        state.metrics.shed.labels(exc.tier).inc()
        raise


async def enqueue(state: ApiState, message: RequestMessage, record: RequestRecord) -> ReplyStream:
    """Register the reply stream, then store the request's record and enqueue it: accepted once the
    XADD returns."""

    async def alive() -> bool:  # its record is stored with its intake entry, in one step
        return bool(await state.redis.exists(state.keys.request(message.id)))

    stream = state.router.open(message.id, alive=alive)
    settings = state.settings
    try:
        entry_id = await requests.enqueue(
            state.redis,
            state.keys,
            message,
            record,
            ttl_s=settings.idempotency_ttl_s,
            replicas=settings.intake_replicas,
            wait_ms=settings.intake_replica_wait_ms,
        )
    except NotReplicatedError as exc:
        stream.close()
        state.metrics.not_replicated.inc()
        raise ServiceUnavailableError(str(exc)) from exc
    except RedisError as exc:
        stream.close()
        raise ServiceUnavailableError(f"the request queue (Redis) does not answer: {exc}") from exc
    state.backlog.admitted(message.tier, message.bucket, entry_id)
    return stream


async def recorded(batches: AsyncIterator[list[OutputEvent]], recorder: Recorder) -> AsyncIterator[list[OutputEvent]]:
    """``batches``, each shown to ``recorder`` first (the answer cache keeps a reply it admitted)."""
    async for batch in batches:
        recorder.on_batch(batch)
        yield batch


def answer_pool(state: ApiState, message: RequestMessage, route: Route, *, own_words_only: bool) -> AnswerCache | None:
    """The answer cache a request looks in: the shared tiny-request pool or its tenant's (``api.answers``)."""
    tokenizer = state.admitter.tokenizer
    template_tokens = tokenizer.template_tokens if route == "chat" and tokenizer is not None else 0
    if state.tiny_answers is not None and is_tiny(
        message, own_words_only=own_words_only, template_tokens=template_tokens
    ):
        return state.tiny_answers
    return state.answers


async def respond(
    state: ApiState,
    request: Request,
    body: GenerationFields,
    generation: GenerationRequest,
    route: Route,
    *,
    own_words_only: bool,
) -> Response:
    state.drain.refuse_if_draining()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    event_ids = wants_event_ids(request)
    record = RequestRecord(
        id=uuid.uuid4().hex,
        tenant=generation.tenant or DEFAULT_TENANT,
        route=route,
        model=state.model.name,
        return_token_ids=body.return_token_ids,
        include_usage=include_usage,
        created_s=int(time.time()),
    )
    idempotency_key = idempotency_key_of(request)
    if idempotency_key is not None:
        record.resumable = True
        record.fingerprint = fingerprint(route, body)
        holder = await claim_key(state, record, idempotency_key)
        if holder is not None:
            return await replay(state, request, holder, stream=body.stream, fingerprint=record.fingerprint)
    cached: bytes | None = None
    marker: dict[str, str] = {}
    lease: Lease | None = None
    try:
        message = await admit(state, generation, record)
        message.idempotency_key = idempotency_key
        lease = await limits.acquire(state, api_key_of(request), message)
        pool = answer_pool(state, message, route, own_words_only=own_words_only)
        seeded = state.seeded.reply_for(message) if state.seeded is not None else None
        found = await pool.lookup(message) if pool is not None and seeded is None else None
        if seeded is not None:
            cached, marker = seeded, {"cache": "seeded"}
        elif found is not None and found[1].result == "hit":
            cached = found[1].reply
            marker = {"cache": "hit", "pool": "tiny"} if pool is not None and pool.shared else {"cache": "hit"}
        else:
            stream = await enqueue(state, message, record)
    except TailcutError:
        limits.release(state, lease)
        if idempotency_key is not None:
            with contextlib.suppress(RedisError):
                await requests.release(state.redis, state.keys, record, idempotency_key)
        raise
    renderer = renderer_for(record)
    tracker = state.metrics.track(message, state.admitter)
    headers = {REQUEST_ID_HEADER: message.id}
    if cached is not None:
        # Answered from the cache: nothing was enqueued, so nothing is cancelled if the client leaves.
        renderer.marker = marker
        batches = cached_batches(message.id, cached)
        if lease is not None:
            batches = limits.limited(batches, state, lease)
        if body.stream:
            frames = event_stream(
                state,
                message.id,
                batches,
                renderer,
                tracker=tracker,
                opening=True,
                resumable=False,
                event_ids=event_ids,
                enqueued=False,
            )
            return EventStreamResponse(frames, headers=headers)
        return OrjsonResponse(await collect(batches, renderer, tracker), headers=headers)
    batches = reply_batches(stream)
    if lease is not None:
        batches = limits.limited(batches, state, lease)
    if found is not None and found[1].result == "admit" and pool is not None:
        batches = recorded(batches, pool.recorder(found[0], found[1].score, state.spawn))
    if body.stream:
        frames = event_stream(
            state,
            message.id,
            batches,
            renderer,
            tracker=tracker,
            opening=True,
            resumable=record.resumable,
            event_ids=event_ids or record.resumable,
        )
        return EventStreamResponse(frames, headers=headers)
    try:
        async with state.drain.bounded():
            whole = await until_disconnect(request, collect(batches, renderer, tracker))
    except TimeoutError:
        # This process is stopping and its grace time is up: the request runs on, readable elsewhere.
        return error_response(resume_hint(message.id, stream=False), headers=headers)
    except ClientGone:
        state.spawn(leave(state, message.id, resumable=record.resumable))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except TailcutError as exc:
        # Accepted, then failed (deadline passed, worker error): the id still names it.
        return error_response(exc, headers=headers)
    return OrjsonResponse(whole, headers=headers)


def idempotency_key_of(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise InvalidRequestError(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters", param="Idempotency-Key"
        )
    return key


def fingerprint(route: Route, body: GenerationFields) -> str:
    """What makes two requests the same request: the route and every field as parsed, except
    ``stream`` (a repeat may read the same execution as a stream or as one body)."""
    fields = body.model_dump(mode="json", exclude={"stream"})
    return hashlib.sha256(orjson.dumps([route, fields], option=orjson.OPT_SORT_KEYS)).hexdigest()


async def claim_key(state: ApiState, record: RequestRecord, key: str) -> RequestRecord | None:
    try:
        return await requests.claim(state.redis, state.keys, record, key, ttl_s=state.settings.idempotency_ttl_s)
    except RedisError as exc:
        raise ServiceUnavailableError(f"the request store (Redis) does not answer: {exc}") from exc
