"""Admin-only diagnosis: ``GET /debug/stacks``, every asyncio task's and thread's stack of this process.

The route exists only when ``TAILCUT_ADMIN_KEY`` is set, and answers only that bearer token (compared in
constant time); without the key it is a 404 like any unknown path.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse

from api.auth import get_state
from tailcut.errors import AuthenticationError
from tailcut.loopwatch import dump_stacks

router = APIRouter()


@router.get("/debug/stacks")
async def stacks(request: Request) -> PlainTextResponse:
    admin_key = get_state(request).settings.admin_key
    if not admin_key:
        raise HTTPException(status_code=404)  # as any unknown path
    token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(token.encode(), admin_key.encode()):
        raise AuthenticationError("this route needs the admin key: send `Authorization: Bearer <TAILCUT_ADMIN_KEY>`")
    return PlainTextResponse(dump_stacks())
