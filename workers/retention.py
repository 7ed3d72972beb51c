"""Prefix keep-alive: a finished chat turn's KV stays in the engine's prefix cache until the next turn (pure).

vLLM keeps the KV blocks of finished requests in an LRU free queue and evicts from its head when a new
allocation needs blocks, so under load a freed block lives about as long as the engine takes to
allocate the free KV again (free KV tokens ÷ tokens allocated per second: a few seconds on a busy
card). A chat's next turn repeats the whole conversation so far, but comes after the user has read the
reply and typed: often later than that. Its history is then prefilled again, which costs the step time
of every request in the engine and the turn's own TTFT.

The ``PrefixKeeper`` remembers the prompt and reply of each finished request of the kept tiers for
``ttl_ms`` and has the driver *touch* them: an engine request of one output token whose prompt is the
turn's KV in whole blocks and one token more. The engine serves it from its prefix cache (one token
computed), and freeing it puts the blocks at the LRU's young end again, so they outlive the blocks
freed before. Touches come every ``period_share`` of the estimated LRU lifetime, and sooner once the
KV allocated since a prefix was last freed reaches ``period_share`` of the free KV (what the LRU
evicts it after): the rate's averages lag the onset of a surge by their window, and a turn that
finished just before one was evicted before its first touch; the count does not lag. So a kept prefix
is touched before it can be evicted; the kept KV is at most ``max_share_of_free`` of the free KV (the
oldest turns are let go first), so kept prefixes do not evict each other.

Touching pays only where turns come back. The keeper watches the arrivals of its tiers: an arrival
whose prompt starts with a kept turn's prompt is a return (that entry is dropped: the new turn now
holds the blocks, and is kept in its turn once it finishes). Touches go out only while returns are at
least ``min_return_share`` of the arrivals (a moving average), so traffic without conversations
(single questions, documents) costs nothing beyond the bookkeeping. A touch that finds most of its
prefix evicted (the engine reports how much it served from cache) ends that entry: it would only
recompute KV nobody asked for.

No clock, no engine: the worker and the simulator feed it and carry out its ``Touch`` list.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from queues.keys import Tier
from workers.budget import PrefillRate

# A touch that found less than this share of its prefix cached ends its entry.
EVICTED_SHARE = 0.5
# The engine priority of a touch (lower runs first): ahead of every request, as it is one token of work.
TOUCH_PRIORITY = 0


@dataclass(frozen=True, slots=True)
class KeepAliveConfig:
    # How long after a turn finished its prefix is kept (0: no keep-alive).
    ttl_ms: int = 30_000
    tiers: tuple[Tier, ...] = ("realtime",)
    # Kept KV at most this share of the engine's free KV.
    max_share_of_free: float = 0.5
    # A kept prefix is touched every this share of the estimated LRU lifetime, at most this often.
    period_share: float = 0.5
    min_period_ms: int = 250
    # The allocation rate the LRU lifetime is estimated from: the highest of its averages over these
    # windows, so a surge shortens the touch period at once and a lull lengthens it slowly.
    allocation_windows_ms: tuple[int, ...] = (500, 5_000)
    # Touches handed out per round at most (each takes an engine slot for one step).
    max_touches_per_round: int = 16
    # Touch only while at least this share of the kept tiers' arrivals return to a kept turn.
    min_return_share: float = 0.05
    # Weight of the newest arrival in the return share.
    return_smoothing: float = 1 / 64

    def __post_init__(self) -> None:
        if self.ttl_ms < 0 or self.min_period_ms < 1 or self.max_touches_per_round < 1:
            raise ValueError(
                "ttl_ms must not be negative, min_period_ms and max_touches_per_round at least 1: "
                f"{self.ttl_ms}, {self.min_period_ms}, {self.max_touches_per_round}"
            )
        if not self.allocation_windows_ms or min(self.allocation_windows_ms) < 1:
            raise ValueError(
                f"allocation_windows_ms needs at least one window of 1 ms or more: {self.allocation_windows_ms}"
            )
        for name in ("max_share_of_free", "period_share", "min_return_share", "return_smoothing"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be within [0, 1]: {value}")

    @property
    def enabled(self) -> bool:
        return self.ttl_ms > 0 and bool(self.tiers)


@dataclass(frozen=True, slots=True)
class Touch:
    """One engine request to make: ``token_ids`` as the prompt, one output token, the tenant's cache
    salt and the tier's engine priority."""

    id: str
    tier: Tier
    tenant: str
    token_ids: list[int]

    @property
    def num_hittable_tokens(self) -> int:
        """Prompt tokens the engine can serve from its cache (all but the last: it is computed)."""
        return len(self.token_ids) - 1


@dataclass(slots=True)
class _Kept:
    id: str
    tier: Tier
    tenant: str
    token_ids: list[int]
    key: int  # the chained hash of the turn's last whole prompt block
    expires_ms: int
    touched_ms: int  # when its blocks were last freed into the LRU (its finish, then each touch)
    touched_allocated: int  # the keeper's allocation count then
    in_flight: bool = False


def block_keys(tenant: str, token_ids: list[int], block_tokens: int) -> list[int]:
    """Chained hashes of the whole blocks of ``token_ids`` (as the engine's prefix cache keys them, and
    salted by tenant as tailcut salts it): two prompts share key ``i`` iff their first ``i + 1`` blocks
    are the same tokens of the same tenant."""
    keys: list[int] = []
    key = hash(tenant)
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(token_ids[start : start + block_tokens])))
        keys.append(key)
    return keys


@dataclass(slots=True)
class KeeperStats:
    kept: int = 0
    returns: int = 0
    touches: int = 0
    evicted: int = 0  # touches that found their prefix gone


class PrefixKeeper:
    def __init__(self, config: KeepAliveConfig, *, block_tokens: int) -> None:
        self.config = config
        self.block_tokens = block_tokens
        self.return_share = 0.0
        self.stats = KeeperStats()
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # oldest finish first
        self._by_touch: OrderedDict[str, None] = OrderedDict()  # the same ids, least recently touched first
        self._by_key: dict[int, str] = {}
        self._touch_ids = itertools.count()
        self._in_flight: dict[str, str] = {}  # touch id → kept id
        self._kept_tokens = 0
        self._allocated_tokens = 0  # KV tokens allocated since the keeper started
        # The touch period in force (``due`` sets it from the LRU lifetime).
        self.period_ms = config.ttl_ms
        self._allocation = [PrefillRate(window_ms=window_ms) for window_ms in config.allocation_windows_ms]

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    @property
    def kept_tokens(self) -> int:
        return self._kept_tokens

    @property
    def touching(self) -> bool:
        return self.config.enabled and self.return_share >= self.config.min_return_share

    # --- what the driver reports ------------------------------------------------------------------

    def allocated(self, num_tokens: int) -> None:
        """KV tokens entered the engine (a prompt admitted, output generated): the LRU's pace."""
        self._allocated_tokens += num_tokens
        for rate in self._allocation:
            rate.observe(num_tokens)

    def arrived(self, tier: Tier, tenant: str, prompt_ids: list[int]) -> None:
        """A client's request arrived: does it return to a kept turn? (Continuations are not arrivals.)"""
        if not self.config.enabled or tier not in self.config.tiers:
            return
        returned = None
        for key in reversed(block_keys(tenant, prompt_ids, self.block_tokens)):
            returned = self._by_key.get(key)
            if returned is not None:
                break
        if returned is not None:
            self.stats.returns += 1
            self._drop(returned)  # the new turn holds those blocks now
        self.return_share += self.config.return_smoothing * ((returned is not None) - self.return_share)

    def finished(
        self, request_id: str, tier: Tier, tenant: str, prompt_ids: list[int], output_ids: list[int], now_ms: int
    ) -> None:
        """A request of a kept tier finished: keep its prompt and reply (in whole blocks) for ``ttl_ms``."""
        config = self.config
        if not config.enabled or tier not in config.tiers:
            return
        prompt_keys = block_keys(tenant, prompt_ids, self.block_tokens)
        token_ids = prompt_ids + output_ids
        num_whole = (len(token_ids) - 1) // self.block_tokens * self.block_tokens
        if not prompt_keys or num_whole == 0:
            return  # not a whole block to keep
        self._drop(request_id)
        previous = self._by_key.get(prompt_keys[-1])
        if previous is not None:
            self._drop(previous)  # the same prompt again: the newer turn is kept
        kept = _Kept(
            request_id,
            tier,
            tenant,
            token_ids[: num_whole + 1],
            prompt_keys[-1],
            expires_ms=now_ms + config.ttl_ms,
            touched_ms=now_ms,
            touched_allocated=self._allocated_tokens,
        )
        self._kept[request_id] = kept
        self._by_touch[request_id] = None
        self._by_key[kept.key] = request_id
        self._kept_tokens += num_whole
        self.stats.kept += 1

    def touched(self, touch_id: str, num_cached_tokens: int) -> None:
        """A touch ended; ``num_cached_tokens``: what the engine served of it from its prefix cache."""
        kept_id = self._in_flight.pop(touch_id, None)
        kept = self._kept.get(kept_id) if kept_id is not None else None
        if kept is None:
            return
        kept.in_flight = False
        if num_cached_tokens < EVICTED_SHARE * (len(kept.token_ids) - 1):
            self.stats.evicted += 1
            self._drop(kept.id)

    # --- one round --------------------------------------------------------------------------------

    def due(self, now_ms: int, *, free_kv_tokens: int) -> list[Touch]:
        """The touches to make now: each kept turn freed into the LRU a period ago, or with
        ``period_share`` of ``free_kv_tokens`` allocated since (``min_period_ms`` apart at least).
        Expired turns are let go, and the oldest while the kept KV is over its share of ``free_kv_tokens``."""
        config = self.config
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if oldest.expires_ms > now_ms and self._kept_tokens <= config.max_share_of_free * max(0, free_kv_tokens):
                break
            self._drop(oldest.id)
        rate = max(average.update(now_ms) for average in self._allocation)
        lifetime_ms = max(0, free_kv_tokens) / rate if rate > 0 else float(config.ttl_ms)
        self.period_ms = period_ms = int(
            min(config.ttl_ms, max(config.min_period_ms, config.period_share * lifetime_ms))
        )
        reach_tokens = config.period_share * max(0, free_kv_tokens)
        touches: list[Touch] = []
        if not self.touching:
            return touches
        for kept_id in list(itertools.islice(self._by_touch, config.max_touches_per_round)):
            kept = self._kept[kept_id]
            waited_ms = now_ms - kept.touched_ms
            allocated = self._allocated_tokens - kept.touched_allocated
            if waited_ms < config.min_period_ms or (waited_ms < period_ms and allocated < reach_tokens):
                break  # the rest were touched later still, with less allocated since
            kept.touched_ms = now_ms
            kept.touched_allocated = self._allocated_tokens
            self._by_touch.move_to_end(kept_id)
            if kept.in_flight:
                continue  # its last touch is still in the engine
            touch = Touch(f"keep-{next(self._touch_ids)}", kept.tier, kept.tenant, kept.token_ids)
            kept.in_flight = True
            self._in_flight[touch.id] = kept.id
            touches.append(touch)
        self.stats.touches += len(touches)
        return touches

    # --- internals --------------------------------------------------------------------------------

    def _drop(self, kept_id: str) -> None:
        kept = self._kept.pop(kept_id, None)
        if kept is None:
            return
        del self._by_touch[kept_id]
        if self._by_key.get(kept.key) == kept_id:
            del self._by_key[kept.key]
        self._kept_tokens -= len(kept.token_ids) - 1
