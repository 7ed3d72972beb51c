"""What every route needs first: the process's state, and the API key check.

With ``TAILCUT_AUTH_REQUIRED`` a request needs a key of ``queues.apikeys`` (``Authorization: Bearer``):
the key decides the tenant (whatever the body or ``X-Tailcut-Tenant`` says) and the tiers the request
may use. A lookup is cached in the process for at most ``KEY_CACHE_S`` (a second), so a key created or
revoked by ``tailcut keys`` on any machine is seen by every API process within it. Without it,
``TAILCUT_API_KEYS`` (plain tokens, no tenant) is checked as before, or nothing when empty.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time

from fastapi import Request
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from api.state import ApiState
from queues.apikeys import ApiKey, KeyStore, digest_of
from queues.keys import Tier
from tailcut.errors import AuthenticationError, KeyPromptError, PermissionDeniedError, ServiceUnavailableError

KEY_CACHE_S = 1.0
KEY_CACHE_MAX = 10_000


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.tailcut
    return state


def bearer(request: Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ").strip()


class KeyCache:
    """The API process's view of the keys in Redis, each lookup (found or not) kept ``KEY_CACHE_S``."""

    def __init__(self, store: KeyStore, secret: str) -> None:
        self._store = store
        self._secret = secret
        # By the key's HMAC, not the key: nothing here holds a key but the request being served.
        self._seen: dict[str, tuple[float, ApiKey | None]] = {}

    async def verify(self, token: str) -> ApiKey | None:
        digest = digest_of(token, self._secret)
        now = time.monotonic()
        cached = self._seen.get(digest)
        if cached is not None and now - cached[0] < KEY_CACHE_S:
            return cached[1]
        try:
            found = await self._store.verify(token)
        except RedisError as exc:
            raise ServiceUnavailableError(f"the key store (Redis) does not answer: {exc}") from exc
        if len(self._seen) >= KEY_CACHE_MAX:
            self._seen.clear()
        self._seen[digest] = (now, found)
        return found


async def check_auth(request: Request) -> None:
    state = get_state(request)
    settings = state.settings
    token = bearer(request)
    if state.key_cache is not None:
        key = await state.key_cache.verify(token) if token else None
        if key is None:
            raise AuthenticationError("missing, unknown or revoked API key; send `Authorization: Bearer <key>`")
        request.state.api_key = key
        return
    if settings.api_keys and not any(
        hmac.compare_digest(token.encode(), known.encode()) for known in settings.api_keys
    ):
        raise AuthenticationError("missing or unknown API key; send `Authorization: Bearer <key>`")


def api_key_of(request: Request) -> ApiKey | None:
    """The key the request came with (TAILCUT_AUTH_REQUIRED), else None."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    return key


def tier_for(key: ApiKey, asked: str | None) -> Tier:
    """The tier a request of ``key`` runs at: the one it asked for if the key allows it, the key's default
    if it asked for none; another is refused (403), or runs at the default if the key downgrades."""
    if asked is None:
        return key.default_tier
    for tier in key.tiers:
        if tier == asked:
            return tier
    if key.downgrade:
        return key.default_tier
    raise PermissionDeniedError(
        f"this API key may not use the {asked!r} tier (it may use: {', '.join(key.tiers)})", param="tier"
    )


def is_admin_key(state: ApiState, token: str) -> bool:
    """Whether ``token`` is TAILCUT_ADMIN_KEY (compared in constant time)."""
    admin_key = state.settings.admin_key
    return bool(admin_key) and hmac.compare_digest(token.encode(), (admin_key or "").encode())


def require_admin(request: Request) -> None:
    """Admin routes: an admin API key, or TAILCUT_ADMIN_KEY."""
    if is_admin_key(get_state(request), bearer(request)):
        return
    key = api_key_of(request)
    if key is not None and key.admin:
        return
    raise PermissionDeniedError("this route needs an admin key")


async def require_admin_route(request: Request) -> None:
    """The admin routes (``api.admin``, ``/debug/stacks``): TAILCUT_ADMIN_KEY, or (TAILCUT_AUTH_REQUIRED) an
    admin API key. Without either kind of admin they do not exist (404, as any unknown path)."""
    state = get_state(request)
    if not state.settings.admin_key and state.key_cache is None:
        raise HTTPException(status_code=404)
    if is_admin_key(state, bearer(request)):
        return
    if state.key_cache is None:
        raise AuthenticationError("this route needs the admin key: send `Authorization: Bearer <TAILCUT_ADMIN_KEY>`")
    await check_auth(request)
    require_admin(request)


def on_metrics_port(request: Request) -> bool:
    """Whether the request came to TAILCUT_API_METRICS_PORT (where only /metrics is served)."""
    port = get_state(request).settings.api_metrics_port
    server = request.scope.get("server")
    return bool(port) and server is not None and server[1] == port


def basic_password(request: Request) -> str:
    """The password of ``Authorization: Basic`` (what a browser sends once its user typed it), or ""."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return ""
    try:
        credentials = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""
    return credentials.partition(":")[2]


async def require_operator(request: Request) -> None:
    """The deployment's own view, ``/metrics`` and the status page: open without TAILCUT_AUTH_REQUIRED; with
    it, an admin key (an admin API key or TAILCUT_ADMIN_KEY), sent as a bearer token or, from a browser, as
    the password of HTTP Basic. ``/metrics`` on TAILCUT_API_METRICS_PORT needs none (Prometheus's port)."""
    state = get_state(request)
    if state.key_cache is None or (on_metrics_port(request) and request.url.path == "/metrics"):
        return
    token = basic_password(request) or bearer(request)
    if is_admin_key(state, token):
        return
    key = await state.key_cache.verify(token) if token else None
    if key is None:
        raise KeyPromptError(
            "this needs an admin key: send `Authorization: Bearer <key>` (a browser asks for it as the password)"
        )
    if not key.admin:
        raise PermissionDeniedError("this needs an admin key (`tailcut keys create --admin`)")
