"""Resumable requests: ``GET /v1/requests/{id}`` replays a request's reply from its durable output,
and a repeated ``Idempotency-Key`` is answered the same way — never a second execution.

The reply comes from ``tc:out:{id}`` on whichever API process serves the call: the positions after
``Last-Event-ID`` (all of them without it), then each new one as the worker writes it, until the
terminal event. Only the request's own tenant reads it (its API key's with TAILCUT_AUTH_REQUIRED, else the
``X-Tailcut-Tenant`` the client sends); anyone else, like an unknown or expired id, gets 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api.auth import api_key_of, check_auth, get_state
from api.errors import error_response
from api.render import renderer_for
from api.responses import EventStreamResponse, OrjsonResponse
from api.shutdown import resume_hint
from api.state import ApiState
from api.streaming import ClientGone, collect, event_stream, until_disconnect
from queues import output, requests
from queues.messages import DEFAULT_TENANT
from queues.requests import RequestRecord
from tailcut.errors import InvalidRequestError, RequestNotFoundError, ServiceUnavailableError, TailcutError

TENANT_HEADER = "x-tailcut-tenant"
LAST_EVENT_ID_HEADER = "last-event-id"
REQUEST_ID_HEADER = "X-Tailcut-Request-Id"
REPLAYED_HEADER = "Idempotent-Replayed"

router = APIRouter(dependencies=[Depends(check_auth)])


@router.get("/v1/requests/{request_id}")
async def resume(request_id: str, request: Request, stream: bool = True) -> Response:
    """The reply of an accepted request, from the position after ``Last-Event-ID``: SSE by default,
    the whole body with ``?stream=false`` (once it is complete)."""
    state = get_state(request)
    key = api_key_of(request)
    tenant = key.tenant if key is not None else request.headers.get(TENANT_HEADER) or DEFAULT_TENANT
    try:
        record = await requests.load(state.redis, state.keys, request_id)
    except RedisError as exc:
        raise ServiceUnavailableError(f"the request store (Redis) does not answer: {exc}") from exc
    if record is None or record.tenant != tenant:
        raise RequestNotFoundError(
            f"no request {request_id!r} for this tenant (never accepted, another tenant's, or expired)",
            param="request_id",
        )
    return await send_reply(state, request, record, stream=stream, after_seq=last_event_id(request))


async def replay(
    state: ApiState, request: Request, holder: RequestRecord, *, stream: bool, fingerprint: str
) -> Response:
    """Answer a repeated Idempotency-Key with the request that holds it, from its first position."""
    if holder.fingerprint != fingerprint:
        raise InvalidRequestError(
            "this Idempotency-Key was used for a different request; use a new key for a new request",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    response = await send_reply(state, request, holder, stream=stream, after_seq=0)
    response.headers[REPLAYED_HEADER] = "true"
    return response


async def send_reply(
    state: ApiState, request: Request, record: RequestRecord, *, stream: bool, after_seq: int
) -> Response:
    try:
        await requests.attach(state.redis, state.keys, record.id, ttl_s=state.settings.idempotency_ttl_s)
    except RedisError as exc:
        raise ServiceUnavailableError(f"the request store (Redis) does not answer: {exc}") from exc

    async def alive() -> bool:
        return await requests.load(state.redis, state.keys, record.id) is not None

    batches = output.follow_output(state.pubsub_redis, state.keys, record.id, after_seq=after_seq, alive=alive)
    renderer = renderer_for(record)
    headers = {REQUEST_ID_HEADER: record.id}
    if stream:
        frames = event_stream(  # a replay is what a resume reads: its frames carry their positions
            state,
            record.id,
            batches,
            renderer,
            tracker=None,
            opening=after_seq == 0,
            resumable=record.resumable,
            event_ids=True,
        )
        return EventStreamResponse(frames, headers=headers)
    try:
        async with state.drain.bounded():
            whole = await until_disconnect(request, collect(batches, renderer, None))
    except TimeoutError:
        return error_response(resume_hint(record.id, stream=False), headers=headers)
    except ClientGone:
        return Response(status_code=499)
    except TailcutError as exc:
        return error_response(exc, headers=headers)
    except RedisError as exc:
        return error_response(ServiceUnavailableError(f"the output store does not answer: {exc}"), headers=headers)
    return OrjsonResponse(whole, headers=headers)


def last_event_id(request: Request) -> int:
    value = request.headers.get(LAST_EVENT_ID_HEADER)
    if value is None or value == "":
        return 0
    if not value.isdigit():
        raise InvalidRequestError(
            f"Last-Event-ID must be the id of an event of this stream (a position), got {value[:40]!r}",
            param="Last-Event-ID",
        )
    return int(value)
