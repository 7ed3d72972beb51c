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
"""

from __future__ import annotations

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
