"""Token budget per scheduling round (pure). ``floor``, ``ceiling`` and ``per_short`` are
``BudgetConfig``'s ``min_tokens`` (default 1024), ``max_tokens`` (2048) and ``tokens_per_short`` (64).

- ``article``: the source article's rule, ``max(floor, min(ceiling, n_short_waiting * per_short))``
  (the article's own floor is 512: ``tailcut bench policies`` runs it as ``tailcut/article-512``). It
  trades throughput for latency: with few short requests waiting it sits at the floor.
- ``room`` (the default): the article's rule applied to the room for new prompts above the running
  decodes, ``min(ceiling, n_running + max(floor, min(ceiling, n_short_waiting * per_short)))``. Every
  running request decodes one token per step, so under load the article's fixed floor leaves less and
  less room for prefill until the queues grow without bound; this floor grows with the batch instead.
- ``slack``: large steps while every realtime request (running or waiting) has slack to its deadline,
  the floor as soon as one does not. Slack is the time left to the deadline minus the decode time it
  still needs at the current step time.

Below the rules, what the ``tailcut`` policy's adaptive sizes are measured with: ``PromptLengths``
(a high quantile of a tier's recent prompt lengths), ``PrefillRate`` (prompt tokens arriving per
millisecond) and ``TimeAverage`` (a value averaged over time, such as the realtime requests in flight).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

BudgetRule = Literal["article", "room", "slack"]


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    rule: BudgetRule = "room"
    min_tokens: int = 1024
    max_tokens: int = 2048
    tokens_per_short: int = 64
    # A realtime request is "tight" when its slack falls below this margin.
    slack_margin_ms: int = 250


@dataclass(frozen=True, slots=True)
class RealtimeProgress:
    """What the slack rule needs to know about one realtime request."""

    deadline_ms: int
    remaining_tokens: int


def article_budget(config: BudgetConfig, num_short_waiting: int) -> int:
    return max(config.min_tokens, min(config.max_tokens, num_short_waiting * config.tokens_per_short))


def room_budget(config: BudgetConfig, num_short_waiting: int, num_running: int) -> int:
    return min(config.max_tokens, num_running + article_budget(config, num_short_waiting))


def slack_budget(config: BudgetConfig, realtime: Iterable[RealtimeProgress], *, now_ms: int, step_ms: float) -> int:
    for request in realtime:
        slack_ms = request.deadline_ms - now_ms - request.remaining_tokens * step_ms
        if slack_ms < config.slack_margin_ms:
            return config.min_tokens
    return config.max_tokens


def token_budget(
    config: BudgetConfig,
    *,
    num_short_waiting: int,
    num_running: int = 0,
    realtime: Iterable[RealtimeProgress],
    now_ms: int,
    step_ms: float,
) -> int:
    if config.rule == "article":
        return article_budget(config, num_short_waiting)
    if config.rule == "room":
        return room_budget(config, num_short_waiting, num_running)
    return slack_budget(config, realtime, now_ms=now_ms, step_ms=step_ms)


class PromptLengths:
    """A high quantile of the prompt lengths one tier sent lately: what the scheduler sizes the engine's
    prefill chunk and the per-step room by, instead of constants that fit one mix.

    Keeps the last ``window`` lengths (sorted too, so a quantile costs one index); ``size()`` is the
    ``quantile`` of them times the ``scale`` last observed with (the share of a prompt the engine
    computes: what its prefix cache does not serve), rounded up to whole ``grain``-token blocks,
    ``None`` until ``min_samples`` were seen. The scale applies to the whole window, so a share learned
    late does not leave the prompts seen before it counted whole. It follows the lengths with
    hysteresis, so the engine setting made from it moves rarely: up at once (a chunk too small splits
    prompts), down only once the quantile fell a whole ``shrink_tokens`` below it.
    """

    def __init__(
        self, *, window: int, quantile: float, grain: int, min_samples: int = 8, shrink_tokens: int = 64
    ) -> None:
        self.window = window
        self.quantile = quantile
        self.grain = grain
        self.min_samples = min(min_samples, window)
        self.shrink_tokens = shrink_tokens
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        self._size: int | None = None

    def __len__(self) -> int:
        return len(self._recent)

    def observe(self, num_tokens: int, scale: float = 1.0) -> None:
        if len(self._recent) == self.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(num_tokens)
        bisect.insort(self._sorted, num_tokens)
        if len(self._sorted) < self.min_samples:
            return
        index = min(len(self._sorted) - 1, max(0, math.ceil(self.quantile * len(self._sorted)) - 1))
        size = -(-math.ceil(self._sorted[index] * scale) // self.grain) * self.grain
        if self._size is None or size > self._size or size <= self._size - self.shrink_tokens:
            self._size = size

    def size(self) -> int | None:
        """The quantile in whole grains (with hysteresis), or ``None`` while too few were seen."""
        return self._size


class PrefillRate:
    """The prompt tokens arriving per millisecond, smoothed over ``window_ms`` of the clock the
    scheduler is given (a time-weighted moving average, so bursts and lulls count by their length)."""

    def __init__(self, *, window_ms: float) -> None:
        self.window_ms = window_ms
        self.tokens_per_ms = 0.0
        self._pending_tokens = 0
        self._last_ms: int | None = None

    def observe(self, num_tokens: int) -> None:
        """A prompt of ``num_tokens`` arrived (counted at the next ``update``)."""
        self._pending_tokens += num_tokens

    def update(self, now_ms: int) -> float:
        """Fold in what arrived since the last update; the smoothed rate."""
        if self._last_ms is None:
            self._last_ms = now_ms
            return self.tokens_per_ms
        elapsed_ms = now_ms - self._last_ms
        if elapsed_ms <= 0:
            return self.tokens_per_ms
        weight = 1 - math.exp(-elapsed_ms / self.window_ms)
        self.tokens_per_ms += weight * (self._pending_tokens / elapsed_ms - self.tokens_per_ms)
        self._pending_tokens = 0
        self._last_ms = now_ms
        return self.tokens_per_ms


class TimeAverage:
    """A value sampled at each round, averaged over ``window_ms`` of the scheduler's clock (each
    sample weighs by the time since the one before, so frequent rounds do not count more)."""

    def __init__(self, *, window_ms: float) -> None:
        self.window_ms = window_ms
        self.value = 0.0
        self._last_ms: int | None = None

    def update(self, now_ms: int, sample: float) -> float:
        if self._last_ms is not None and now_ms > self._last_ms:
            self.value += (1 - math.exp(-(now_ms - self._last_ms) / self.window_ms)) * (sample - self.value)
        if self._last_ms is None or now_ms > self._last_ms:
            self._last_ms = now_ms
        return self.value
