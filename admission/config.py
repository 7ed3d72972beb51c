"""The typed admission configuration: bucket edges, tier deadlines, shed limits (pure).

These dataclasses hold the defaults; ``admission.settings.AdmissionSettings`` reads its defaults from
them, and the simulator builds them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from admission.shedding import ShedLimits
from queues.keys import Bucket, Tier


@dataclass(frozen=True, slots=True)
class BucketEdges:
    """Bucket of a request by prompt tokens plus predicted output tokens."""

    short_max_tokens: int = 128  # `short`: below this
    long_min_tokens: int = 512  # `long`: above this; `medium` in between

    def of(self, num_tokens: int) -> Bucket:
        if num_tokens < self.short_max_tokens:
            return "short"
        if num_tokens > self.long_min_tokens:
            return "long"
        return "medium"


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long a request of each tier may wait to start (DESIGN.md: deadlines mean "start by")."""

    realtime_s: float = 5.0
    normal_s: float = 60.0
    background_s: float = 3600.0

    def of(self, tier: Tier) -> float:
        seconds: dict[Tier, float] = {
            "realtime": self.realtime_s,
            "normal": self.normal_s,
            "background": self.background_s,
        }
        return seconds[tier]


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    default_tier: Tier = "normal"
    buckets: BucketEdges = field(default_factory=BucketEdges)
    deadlines: Deadlines = field(default_factory=Deadlines)
    shed: ShedLimits = field(default_factory=ShedLimits)
