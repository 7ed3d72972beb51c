"""The operators' routes: drain a worker, list and replay the dead-letter stream, reset a breaker.

Each needs an admin key (``api.auth.require_admin_route``: an admin API key with TAILCUT_AUTH_REQUIRED, or
TAILCUT_ADMIN_KEY); where no admin exists they do not exist (404). What each does in Redis is the
``queues`` module it calls; what a client of a replayed request sees is ``queues.dlq``'s docstring.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from redis.exceptions import RedisError

from api.auth import get_state, require_admin_route
from api.responses import OrjsonResponse
from api.state import ApiState
from api.status import live_workers
from queues import dlq, events
from queues.breakers import reset_breaker
from queues.drain import request_drain
from queues.keys import Tier
from tailcut.errors import (
    DeadLetterNotFoundError,
    NotReplayableError,
    ServiceUnavailableError,
    WorkerNotFoundError,
)
from tailcut.logs import log_event

log = logging.getLogger("tailcut.api")

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin_route)])

# A dead-letter entry's id as Redis writes it: milliseconds, a dash, a sequence (ASCII digits only, and
# few enough of them to fit Redis's 64-bit parts).
ENTRY_ID_PATTERN = r"^[0-9]{1,19}-[0-9]{1,19}$"
DLQ_LIST_MAX = 1000


def now_ms() -> int:
    return int(time.time() * 1000)


def _unavailable(exc: RedisError) -> ServiceUnavailableError:
    return ServiceUnavailableError(f"Redis does not answer: {exc}")


@router.get("/workers")
async def workers(request: Request) -> OrjsonResponse:
    """Every live worker, with what its last heartbeat said of it (as the status page shows them)."""
    state = get_state(request)
    try:
        found = await live_workers(state.redis, state.keys)
    except RedisError as exc:
        raise _unavailable(exc) from exc
    return OrjsonResponse({"object": "list", "data": found})


@router.post("/workers/{worker_id}/drain", status_code=202)
async def drain_worker(request: Request, worker_id: Annotated[str, Path(max_length=200)]) -> OrjsonResponse:
    """Drain a live worker: within a heartbeat (TAILCUT_HEARTBEAT_S, 1 s) it stops reading, hands back what
    waits there, lets what runs finish for TAILCUT_DRAIN_TIMEOUT_S and hands back the rest, then exits (as
    on SIGTERM). 202: asked; 404: no live worker with that id."""
    state = get_state(request)
    try:
        asked = await request_drain(state.redis, state.keys, worker_id)
    except RedisError as exc:
        raise _unavailable(exc) from exc
    if not asked:
        raise WorkerNotFoundError(f"no live worker {worker_id!r} (see GET /admin/workers)", param="worker_id")
    log_event(log, "worker_drain_asked", worker=worker_id)
    await events.publish(
        state.redis, state.keys, {"type": "drain_requested", "worker": worker_id}, source=_source(state)
    )
    return OrjsonResponse({"id": worker_id, "drain": "requested"}, status_code=202)


@router.get("/dlq")
async def dead_letters(request: Request, limit: Annotated[int, Query(ge=1, le=DLQ_LIST_MAX)] = 100) -> OrjsonResponse:
    """The dead-letter stream's newest ``limit`` entries, newest first: the request id, why it is there
    (``expired``, ``max_deliveries``), its tenant, tier and sizes (never its prompt); ``total``: how many
    entries the stream holds."""
    state = get_state(request)
    try:
        total, entries = await dlq.dead_letters(state.redis, state.keys, limit=limit)
    except RedisError as exc:
        raise _unavailable(exc) from exc
    return OrjsonResponse({"object": "list", "total": total, "data": [entry.summary() for entry in entries]})


@router.post("/dlq/{entry_id}/replay", status_code=202)
async def replay(request: Request, entry_id: Annotated[str, Path(pattern=ENTRY_ID_PATTERN)]) -> OrjsonResponse:
    """Put a dead-lettered request back on its intake stream, once (a second replay of the entry is a 404),
    as a new attempt with a fresh deadline. Its client reads the replay with ``GET /v1/requests/{id}``
    (``Last-Event-ID``: the position it had). 409: no client could read it any more (its record expired, or
    a batch job's chunk)."""
    state = get_state(request)
    try:
        done = await dlq.replay(
            state.redis, state.keys, entry_id, now_ms=now_ms(), ttl_s=state.settings.idempotency_ttl_s
        )
    except RedisError as exc:
        raise _unavailable(exc) from exc
    if done == "unknown":
        raise DeadLetterNotFoundError(
            f"no dead-letter entry {entry_id!r} (replayed already, or never there; see GET /admin/dlq)",
            param="entry_id",
        )
    if done == "unreadable":
        raise NotReplayableError(
            f"dead-letter entry {entry_id!r}: no client can read its request any more (its record expired, or it "
            "was a batch job's chunk); it stays in the dead-letter stream",
            param="entry_id",
        )
    log_event(log, "dead_letter_replayed", rid=done.request_id, entry=entry_id)
    await events.publish(
        state.redis, state.keys, {"type": "dead_letter_replayed", "rid": done.request_id}, source=_source(state)
    )
    body: dict[str, Any] = {
        "id": entry_id,
        "request_id": done.request_id,
        "stream": done.stream,
        "intake_entry_id": done.intake_entry_id,
        "resume": {"path": f"/v1/requests/{done.request_id}", "last_event_id": done.last_seq},
    }
    return OrjsonResponse(body, status_code=202)


@router.post("/breakers/{tier}/reset")
async def reset(request: Request, tier: Tier) -> OrjsonResponse:
    """Close a tier's circuit breaker for every worker (each reads it within a second) and clear the latencies
    its rule judged, so it judges afresh; ``previous``: its state before."""
    state = get_state(request)
    try:
        before = await reset_breaker(state.redis, state.keys, tier, now_ms=now_ms(), reason="reset by an operator")
    except RedisError as exc:
        raise _unavailable(exc) from exc
    log_event(log, "breaker_reset", logging.WARNING, tier=tier, was=before.state)
    await events.publish(state.redis, state.keys, {"type": "breaker_reset", "tier": tier}, source=_source(state))
    return OrjsonResponse({"tier": tier, "state": "closed", "previous": before.as_dict()})


def _source(state: ApiState) -> dict[str, str]:
    return {"api": state.settings.api_id}
