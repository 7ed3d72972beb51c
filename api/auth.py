"""What every route needs first: the process's state, and the API key check.

With ``TAILCUT_AUTH_REQUIRED`` a request needs a key of ``queues.apikeys`` (``Authorization: Bearer``):
the key decides the tenant (whatever the body or ``X-Tailcut-Tenant`` says) and the tiers the request
may use. A lookup is cached in the process for at most ``KEY_CACHE_S`` (a second), so a key created or
revoked by ``tailcut keys`` on any machine is seen by every API process within it. Without it,
``TAILCUT_API_KEYS`` (plain tokens, no tenant) is checked as before, or nothing when empty.
"""

from __future__ import annotations

import hmac
import time

from fastapi import Request
from redis.exceptions import RedisError

from api.state import ApiState
from queues.apikeys import ApiKey, KeyStore, digest_of
from queues.keys import Tier
from tailcut.errors import AuthenticationError, PermissionDeniedError, ServiceUnavailableError

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


def require_admin(request: Request) -> None:
    """Admin routes: an admin API key, or TAILCUT_ADMIN_KEY."""
    admin_key = get_state(request).settings.admin_key
    token = bearer(request)
    if admin_key and hmac.compare_digest(token.encode(), admin_key.encode()):
        return
    key = api_key_of(request)
    if key is not None and key.admin:
        return
    raise PermissionDeniedError("this route needs an admin key")
