"""Output-length prediction at admission, learned online from finished requests (pure, in-process).

The bucket of a request is chosen from prompt tokens plus predicted output tokens, so the predictor
runs on every admission and must cost well under a millisecond (``tailcut bench predictor``
measures it). It keeps an exponential moving average of the real output length per
``(tenant, tier, prompt bucket)``, falling back to ``(tier, prompt bucket)`` and then to a per-tier
prior until a key has history. A prediction never exceeds the request's ``max_tokens``.

Each API process learns from the requests it served; the error of every prediction is exported as
``tailcut_prediction_error_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from queues.keys import Tier

# Typical reply lengths per tier before any history (WORKLOADS.md seed-mix midpoints, rounded up).
TIER_PRIOR_TOKENS: dict[Tier, int] = {"realtime": 64, "normal": 256, "background": 1024}
# Prompt-length classes of the history key: replies to long prompts differ from replies to short ones.
PROMPT_CLASS_EDGES = (128, 512)

K = TypeVar("K")


def prompt_class(num_prompt_tokens: int) -> int:
    return sum(num_prompt_tokens >= edge for edge in PROMPT_CLASS_EDGES)


@dataclass(slots=True)
class _Average:
    value: float
    count: int = 1


class OutputLengthPredictor:
    def __init__(self, *, smoothing: float = 0.2, max_keys: int = 100_000) -> None:
        self._smoothing = smoothing
        self._max_keys = max_keys
        self._by_tenant: dict[tuple[str, Tier, int], _Average] = {}
        self._by_tier: dict[tuple[Tier, int], _Average] = {}

    def predict(self, *, tier: Tier, tenant: str, prompt_tokens: int, max_tokens: int) -> int:
        cls = prompt_class(prompt_tokens)
        history = self._by_tenant.get((tenant, tier, cls)) or self._by_tier.get((tier, cls))
        guess = history.value if history is not None else TIER_PRIOR_TOKENS[tier]
        return max(1, min(max_tokens, round(guess)))

    def observe(self, *, tier: Tier, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        cls = prompt_class(prompt_tokens)
        self._update(self._by_tier, (tier, cls), output_tokens)
        if len(self._by_tenant) < self._max_keys or (tenant, tier, cls) in self._by_tenant:
            self._update(self._by_tenant, (tenant, tier, cls), output_tokens)

    def _update(self, table: dict[K, _Average], key: K, value: int) -> None:
        average = table.get(key)
        if average is None:
            table[key] = _Average(float(value))
        else:
            average.value += self._smoothing * (value - average.value)
            average.count += 1
