"""Output-length prediction at admission (must cost well under 1 ms).

``PriorPredictor`` is the starting point: a per-tier prior capped by the request's ``max_tokens``.
"""

from __future__ import annotations

from queues.keys import Tier

# Typical reply lengths per tier (WORKLOADS.md seed-mix midpoints, rounded up).
TIER_PRIOR_TOKENS: dict[Tier, int] = {"realtime": 64, "normal": 256, "background": 1024}


class PriorPredictor:
    def predict(self, *, tier: Tier, tenant: str, prompt_tokens: int, max_tokens: int) -> int:
        return min(max_tokens, TIER_PRIOR_TOKENS[tier])
