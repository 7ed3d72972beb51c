"""Routes of the live status page (``api.status`` says what it shows and how it is computed).

With TAILCUT_AUTH_REQUIRED both need an admin key (``api.auth.require_operator``): the page shows the
whole deployment (every queue, worker and breaker), which is an operator's view, not a tenant's. A
browser asks for the key as a password (HTTP Basic, any user name) and sends it with the page's requests.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from redis.exceptions import RedisError
from starlette.responses import HTMLResponse

from api.auth import get_state, require_operator
from api.responses import OrjsonResponse
from api.status import live_workers, tier_figures
from queues.breakers import read_breakers
from queues.keys import BUCKETS, TIERS

router = APIRouter(dependencies=[Depends(require_operator)])


@router.get("/status", include_in_schema=False)
async def status_page() -> HTMLResponse:
    return HTMLResponse(resources.files("api").joinpath("status.html").read_text(encoding="utf-8"))


@router.get("/status/data")
async def status_data(request: Request) -> OrjsonResponse:
    """What the status page shows, as JSON."""
    state = get_state(request)
    window, covered_s = state.status.figures()
    slo = state.metrics.slo
    targets = {
        "realtime": {"ttft_ms": slo.realtime_ttft_s * 1000, "e2e_ms": slo.realtime_e2e_s * 1000},
        "normal": {"ttft_ms": slo.normal_ttft_s * 1000, "tpot_ms": slo.normal_tpot_s * 1000},
        "background": {"e2e_ms": slo.background_e2e_s * 1000},
    }
    backlog = state.backlog
    body: dict[str, Any] = {
        "at_ms": int(time.time() * 1000),
        "model": state.model.name,
        "api_id": state.settings.api_id,
        "api_processes": state.settings.api_processes,
        "window_s": state.status.window_s,
        "covered_s": round(covered_s, 1),
        "open_streams": int(window.open_streams),
        "tiers": {tier: {**tier_figures(window, tier), "targets": targets[tier]} for tier in TIERS},
        "queues": {
            tier: {
                bucket: {"requests": backlog.depth[tier, bucket], "tokens": backlog.tokens[tier, bucket]}
                for bucket in BUCKETS
            }
            for tier in TIERS
        },
        "breakers": {},
        "workers": [],
        "problems": [],
    }
    try:
        breakers = await read_breakers(state.redis, state.keys)
        body["breakers"] = {tier: view.as_dict() for tier, view in breakers.items()}
        body["workers"] = await live_workers(state.redis, state.keys)
    except RedisError as exc:
        body["problems"].append(f"redis: {exc}")
    return OrjsonResponse(body)
