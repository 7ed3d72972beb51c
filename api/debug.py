"""Admin-only diagnosis: ``GET /debug/stacks``, every asyncio task's and thread's stack of this process.

The route exists only where an admin exists (``TAILCUT_ADMIN_KEY``, or API keys), and answers only an
admin key (``api.auth.require_admin_route``); without one it is a 404 like any unknown path.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.responses import PlainTextResponse

from api.auth import require_admin_route
from tailcut.loopwatch import dump_stacks

router = APIRouter()


@router.get("/debug/stacks", dependencies=[Depends(require_admin_route)])
async def stacks() -> PlainTextResponse:
    """Admin only: TAILCUT_ADMIN_KEY, or (TAILCUT_AUTH_REQUIRED) an admin API key. Without either kind of
    admin the route does not exist (404, as any unknown path)."""
    return PlainTextResponse(dump_stacks())
