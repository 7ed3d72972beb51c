"""Admin-only diagnosis: ``GET /debug/stacks``, every asyncio task's and thread's stack of this process.

The route exists only when ``TAILCUT_ADMIN_KEY`` is set, and answers only that bearer token (compared in
constant time); without the key it is a 404 like any unknown path.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse

from api.auth import bearer, check_auth, get_state, require_admin
from tailcut.errors import AuthenticationError
from tailcut.loopwatch import dump_stacks

router = APIRouter()


@router.get("/debug/stacks")
async def stacks(request: Request) -> PlainTextResponse:
    """Admin only: TAILCUT_ADMIN_KEY, or (TAILCUT_AUTH_REQUIRED) an admin API key. Without either kind of
    admin the route does not exist (404, as any unknown path)."""
    state = get_state(request)
    admin_key = state.settings.admin_key
    if not admin_key and state.key_cache is None:
        raise HTTPException(status_code=404)
    token = bearer(request)
    if not (admin_key and hmac.compare_digest(token.encode(), admin_key.encode())):
        if state.key_cache is None:
            raise AuthenticationError(
                "this route needs the admin key: send `Authorization: Bearer <TAILCUT_ADMIN_KEY>`"
            )
        await check_auth(request)
        require_admin(request)
    return PlainTextResponse(dump_stacks())
