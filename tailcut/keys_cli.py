"""``tailcut keys create|list|revoke``: the API keys in Redis (``queues.apikeys``).

They read the same settings as the API (``TAILCUT_REDIS_URL``, ``TAILCUT_KEY_PREFIX``,
``TAILCUT_AUTH_SECRET``). ``create`` prints what the key grants on standard error and the key alone on
the last line of standard output (``KEY=$(tailcut keys create --tenant acme | tail -1)``): it is shown
once and stored only as its HMAC.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from api.settings import ApiSettings
from queues.apikeys import KeyStore, parse
from queues.connection import check_redis, connect
from queues.keys import TIERS, Keys, Tier
from tailcut.errors import ConfigError

console = Console(stderr=True, highlight=False)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys (TAILCUT_AUTH_REQUIRED)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="a new key for a tenant; the key is printed on the last line")
    create.add_argument("--tenant", required=True)
    create.add_argument("--tiers", default=",".join(TIERS), help="tiers the key may use (comma-separated)")
    create.add_argument("--default-tier", dest="default_tier", help="tier of a request that names none")
    create.add_argument("--admin", action="store_true", help="the key may also use the admin routes")
    create.add_argument(
        "--downgrade", action="store_true", help="a request for another tier runs at the default tier (else 403)"
    )
    for flag, name, text in (
        ("--rpm", "requests_per_minute", "requests per minute"),
        ("--tpm", "tokens_per_minute", "tokens (prompt + max_tokens) per minute"),
        ("--concurrent", "concurrent_requests", "requests being answered at once"),
        ("--queued", "queued_per_tier", "accepted requests of one tier not started yet"),
    ):
        create.add_argument(
            flag, dest=name, type=int, help=f"this key's own limit of {text} (default: TAILCUT_LIMIT_*)"
        )
    create.set_defaults(func=cmd_create)
    listing = keys_sub.add_parser("list", help="every key: id, tenant, tiers (never the key)")
    listing.set_defaults(func=cmd_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id (or the key itself)")
    revoke.add_argument("key")
    revoke.set_defaults(func=cmd_revoke)


def _store() -> tuple[KeyStore, Any]:
    settings = ApiSettings()
    if not settings.auth_secret:
        raise ConfigError("set TAILCUT_AUTH_SECRET to the API's secret: keys are stored as their HMAC under it")
    redis = connect(settings.redis, timeout_s=settings.redis_timeout_s)
    return KeyStore(redis, Keys(settings.key_prefix), settings.auth_secret), redis


def _tiers(text: str) -> list[Tier]:
    tiers = [tier.strip() for tier in text.split(",") if tier.strip()]
    unknown = [tier for tier in tiers if tier not in TIERS]
    if unknown or not tiers:
        raise ConfigError(f"--tiers takes some of {', '.join(TIERS)}, not {text!r}")
    return tiers  # type: ignore[return-value]


def cmd_create(args: argparse.Namespace) -> None:
    tiers = _tiers(args.tiers)
    if args.default_tier is not None and args.default_tier not in tiers:
        raise ConfigError(f"--default-tier {args.default_tier!r} is not among --tiers {args.tiers!r}")
    names = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "queued_per_tier")
    limits = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if any(value < 0 for value in limits.values()):
        raise ConfigError("limits are counts >= 0 (0: no limit)")

    async def run() -> tuple[str, Any]:
        store, redis = _store()
        try:
            await check_redis(redis)
            return await store.create(
                args.tenant,
                tiers=tiers,
                default_tier=args.default_tier,
                admin=args.admin,
                downgrade=args.downgrade,
                limits=limits or None,
            )
        finally:
            await redis.aclose()

    key, record = asyncio.run(run())
    flags = (" admin" if record.admin else "") + (" downgrade" if record.downgrade else "")
    console.print(
        f"key {record.key_id} for tenant {record.tenant!r}: tiers {','.join(record.tiers)}, "
        f"default {record.default_tier}{flags}. It is shown once; store it now."
    )
    sys.stdout.write(key + "\n")


def cmd_list(args: argparse.Namespace) -> None:
    async def run() -> list[Any]:
        store, redis = _store()
        try:
            await check_redis(redis)
            return await store.list()
        finally:
            await redis.aclose()

    table = Table("id", "tenant", "tiers", "default", "admin", "downgrade", "created (UTC)")
    for key in asyncio.run(run()):
        created = datetime.datetime.fromtimestamp(key.created_ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            key.key_id,
            key.tenant,
            ",".join(key.tiers),
            key.default_tier,
            "yes" if key.admin else "",
            "yes" if key.downgrade else "",
            created,
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def cmd_revoke(args: argparse.Namespace) -> None:
    key_id = parse(args.key) or args.key

    async def run() -> bool:
        store, redis = _store()
        try:
            await check_redis(redis)
            return await store.revoke(key_id)
        finally:
            await redis.aclose()

    if not asyncio.run(run()):
        raise ConfigError(f"no key with id {key_id!r} (see `tailcut keys list`)")
    console.print(f"key {key_id} revoked: every API process refuses it within a second")
