"""Per-tenant limits at the API (``queues.limits``): checked once per request of an API key before it is
queued or answered from a cache, and released when its reply ends."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.exceptions import RedisError

from api.state import ApiState
from queues.apikeys import ApiKey
from queues.limits import Limits
from queues.messages import OutputEvent, RequestMessage
from tailcut.errors import InvalidRequestError, OverloadedError, ServiceUnavailableError

# A request holds its concurrent and queued slots at most this long if its API process dies mid-reply.
LEASE_S = 600
NAMES = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "concurrent_requests": "requests at once",
    "queued_requests": "queued requests in this tier",
}


@dataclass(slots=True)
class Lease:
    tenant: str
    tier: str
    request_id: str
    minute: int
    reserved_tokens: int


async def acquire(state: ApiState, key: ApiKey | None, message: RequestMessage) -> Lease | None:
    """Admit the request under its tenant's limits (429 with Retry-After when one is reached); None when
    it has no key or no limit applies."""
    if key is None or state.limits is None:
        return None
    limits: Limits = state.settings.limits(key.limits)
    if not limits.any:
        return None
    tokens = len(message.prompt_token_ids) + message.sampling.max_tokens
    try:
        admission = await state.limits.admit(
            key.tenant, message.tier, message.id, tokens=tokens, limits=limits, now_ms=int(time.time() * 1000)
        )
    except RedisError as exc:
        raise ServiceUnavailableError(f"the limits store (Redis) does not answer: {exc}") from exc
    if admission.limit == "too_large":
        raise InvalidRequestError(
            f"this request's {tokens} tokens (prompt + max_tokens) exceed the key's {limits.tokens_per_minute} "
            "tokens per minute: lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
    if admission.limit is not None:
        retry_s = max(1, -(-admission.retry_after_ms // 1000))
        state.metrics.tenant_limited.labels(admission.limit).inc()
        what = NAMES.get(admission.limit, admission.limit)
        raise OverloadedError(
            f"tenant {key.tenant!r} is at its limit of {what}; retry in {retry_s} s",
            tier=message.tier,
            retry_after_s=retry_s,
        )
    return Lease(key.tenant, message.tier, message.id, admission.minute, tokens)


def release(state: ApiState, lease: Lease | None, *, used_tokens: int | None = None) -> None:
    """The reply ended (or never began): free its slots; give back the tokens it did not use (``used_tokens``
    None: unknown, nothing given back)."""
    if lease is None or state.limits is None:
        return
    unused = 0 if used_tokens is None else lease.reserved_tokens - used_tokens
    state.spawn(
        state.limits.ended(lease.tenant, lease.tier, lease.request_id, minute=lease.minute, unused_tokens=unused)
    )


async def limited(
    batches: AsyncIterator[list[OutputEvent]], state: ApiState, lease: Lease
) -> AsyncIterator[list[OutputEvent]]:
    """``batches``, telling the limits when the request starts (its first token) and when it ends."""
    started = False
    used: int | None = None
    try:
        async for batch in batches:
            for event in batch:
                if not started and event.type == "chunk" and state.limits is not None:
                    started = True
                    state.spawn(state.limits.started(lease.tenant, lease.tier, lease.request_id))
                elif event.type == "final":
                    used = (event.prompt_tokens or 0) + (event.completion_tokens or 0)
            yield batch
    finally:
        release(state, lease, used_tokens=used)
