"""Liveness, readiness and metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.responses import Response

from api.auth import require_operator
from api.responses import OrjsonResponse
from api.state import ApiState
from api.status import live_workers
from queues.breakers import STATE_VALUES, read_breakers
from tailcut import __version__

router = APIRouter()


@router.get("/healthz")
@router.get("/health")  # vLLM's server's path, which probes and load balancers set up for it check
async def healthz() -> OrjsonResponse:
    """The process is up and its event loop answers (liveness: an API process with no worker alive
    still takes requests, which wait in Redis; readiness is ``/readyz``)."""
    return OrjsonResponse({"status": "ok"})


@router.get("/version")
async def version() -> OrjsonResponse:
    """tailcut's version (the route vLLM's server answers with its own)."""
    return OrjsonResponse({"version": __version__})


@router.get("/readyz")
async def readyz(request: Request) -> OrjsonResponse:
    """Ready to take traffic: Redis answers, the reply channel is subscribed, a worker is alive."""
    state: ApiState = request.app.state.tailcut
    problems: list[str] = []
    workers = 0
    breakers: dict[str, dict[str, str | int]] = {}
    warmup: dict[str, object] = {}
    try:
        await state.redis.ping()
        breakers = {tier: view.as_dict() for tier, view in (await read_breakers(state.redis, state.keys)).items()}
        # Each worker's score is the time until which its last beat vouches for it (its own
        # heartbeat interval decides; see ``queues.keys.Keys.workers``).
        workers = int(await state.redis.zcount(state.keys.workers, time.time(), "+inf"))
        # Each live worker's cold-start stage (1, 2, 3), the share of its capacity open, and its
        # prefix warmup ("done/planned" prompts; it never holds readiness back).
        warmup = {
            worker["id"]: {
                "stage": worker.get("warmup_stage"),
                "capacity": worker.get("capacity"),
                "prefix_warmup": worker.get("prefix_warmup"),
            }
            for worker in await live_workers(state.redis, state.keys)
        }
    except RedisError as exc:
        problems.append(f"redis: {exc}")
    if state.drain.draining:
        problems.append("shutting down")
    if not state.router.ready:
        problems.append("reply channel not subscribed")
    if not workers and not problems:
        problems.append("no live worker")
    # Open breakers do not make the service unready: they say it is degraded (tier 0) or wants more
    # capacity (tier 1); an autoscaler reads them here or as tailcut_breaker_state.
    body = {
        "ready": not problems,
        "workers": workers,
        "model": state.model.name,
        "problems": problems,
        "breakers": breakers,
        "warmup": warmup,
    }
    return OrjsonResponse(body, status_code=200 if not problems else 503)


@router.get("/metrics", dependencies=[Depends(require_operator)])
async def metrics(request: Request) -> Response:
    """Prometheus exposition of this API process (with TAILCUT_AUTH_REQUIRED: an admin key, except on
    TAILCUT_API_METRICS_PORT)."""
    state: ApiState = request.app.state.tailcut
    try:
        for tier, view in (await read_breakers(state.redis, state.keys)).items():
            state.metrics.breaker_state.labels(tier).set(STATE_VALUES[view.state])
    except RedisError:
        pass  # the last values stand; Redis being down shows elsewhere
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
