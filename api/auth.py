"""What every route needs first: the process's state, and the API key check."""

from __future__ import annotations

from fastapi import Request

from api.state import ApiState
from tailcut.errors import AuthenticationError


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
