"""API keys in Redis: each key names its tenant, the tiers it may use, its default tier and whether it
is an admin key. Every API process reads them there, so a key created or revoked anywhere is seen
everywhere (``api.auth`` caches a lookup for at most a second).

A key is ``tck_<id>_<secret>``: the id (12 hex digits) is public and finds the record
(``tc:apikey:{id}``, a hash; ``tc:apikeys`` is the set of ids); the secret is 32 random bytes. The record
holds the key's HMAC-SHA256 under the deployment's secret (``TAILCUT_AUTH_SECRET``) — never the key
itself — and a presented key is accepted only if its HMAC equals the stored one, compared in constant
time. Without the deployment's secret a copy of Redis proves no key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from queues.connection import reply
from queues.keys import TIERS, Keys, Tier

KEY_PATTERN = re.compile(r"^tck_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """What a key grants (the record without its digest)."""

    key_id: str
    tenant: str
    tiers: tuple[Tier, ...]
    default_tier: Tier
    admin: bool = False
    # A request for a tier the key may not use runs at the key's default tier instead of a 403.
    downgrade: bool = False
    created_ms: int = 0
    # This key's own limits (``queues.limits``); None: the deployment's default for that limit.
    limits: dict[str, int] | None = None

    def fields(self, digest: str) -> dict[str, str]:
        return {
            "digest": digest,
            "tenant": self.tenant,
            "tiers": ",".join(self.tiers),
            "default_tier": self.default_tier,
            "admin": "1" if self.admin else "0",
            "downgrade": "1" if self.downgrade else "0",
            "created_ms": str(self.created_ms),
            **{f"limit:{name}": str(value) for name, value in (self.limits or {}).items()},
        }

    @classmethod
    def of(cls, key_id: str, fields: dict[str, str]) -> ApiKey:
        return cls(
            key_id=key_id,
            tenant=fields["tenant"],
            tiers=tuple(tier for tier in fields["tiers"].split(",") if tier in TIERS),
            default_tier=fields["default_tier"],  # type: ignore[arg-type]
            admin=fields.get("admin") == "1",
            downgrade=fields.get("downgrade") == "1",
            created_ms=int(fields.get("created_ms") or 0),
            limits={
                name.removeprefix("limit:"): int(value) for name, value in fields.items() if name.startswith("limit:")
            }
            or None,
        )


def digest_of(key: str, secret: str) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def parse(key: str) -> str | None:
    """The key's id, or None when it is not a tailcut key."""
    match = KEY_PATTERN.match(key)
    return match.group(1) if match else None


class KeyStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, secret: str) -> None:
        if not secret:
            raise ValueError("API keys need the deployment's secret (TAILCUT_AUTH_SECRET)")
        self._redis = redis
        self._keys = keys
        self._secret = secret

    async def create(
        self,
        tenant: str,
        *,
        tiers: Sequence[Tier] = TIERS,
        default_tier: Tier | None = None,
        admin: bool = False,
        downgrade: bool = False,
        limits: dict[str, int] | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key (returned once, never stored) and its record."""
        if not tenant:
            raise ValueError("a key needs a tenant")
        if not tiers or any(tier not in TIERS for tier in tiers):
            raise ValueError(f"tiers must be some of {', '.join(TIERS)}")
        # Unless told: normal if the key may use it (admission's own default), else its least urgent tier.
        default: Tier = "normal" if "normal" in tiers else max(tiers, key=TIERS.index)
        if default_tier is not None:
            default = default_tier
        if default not in tiers:
            raise ValueError(f"the default tier {default!r} is not among the key's tiers")
        key_id = secrets.token_hex(6)
        key = f"tck_{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, tenant, tuple(tiers), default, admin, downgrade, int(time.time() * 1000), limits)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.api_key(key_id), mapping=record.fields(digest_of(key, self._secret)))
            pipe.sadd(self._keys.api_key_ids, key_id)
            await pipe.execute()
        return key, record

    async def verify(self, key: str) -> ApiKey | None:
        """The record of a presented key, or None (unknown, revoked, or not this deployment's)."""
        key_id = parse(key)
        if key_id is None:
            return None
        raw = await reply(self._redis.hgetall(self._keys.api_key(key_id)))
        if not raw:
            return None
        fields = {name.decode(): value.decode() for name, value in raw.items()}
        if not hmac.compare_digest(fields.get("digest", ""), digest_of(key, self._secret)):
            return None
        return ApiKey.of(key_id, fields)

    async def list(self) -> list[ApiKey]:
        ids = sorted(member.decode() for member in await reply(self._redis.smembers(self._keys.api_key_ids)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hgetall(self._keys.api_key(key_id))
            records = await pipe.execute()
        return [
            ApiKey.of(key_id, {name.decode(): value.decode() for name, value in raw.items()})
            for key_id, raw in zip(ids, records, strict=True)
            if raw
        ]

    async def revoke(self, key_id: str) -> bool:
        """Forget a key by its id; False when there was none."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.api_key(key_id))
            pipe.srem(self._keys.api_key_ids, key_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)
