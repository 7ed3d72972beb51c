"""The staged cold start of a worker: how much of its capacity it opens, as a function of the time since it
started serving (pure: the caller passes the elapsed time).

A fresh engine is slow on its first requests (caches empty, allocator and kernels cold), and a worker
that joins a busy pool would otherwise take a full batch of the pool's backlog at once and serve all
of it slowly. So:

- **stage 1** (``stage1_s``, default 2 min): the model is loaded and ``first`` (10%) of the capacity is
  open — requests running at once and the per-step token budget;
- **stage 2** (``stage2_s``, default 3 min): the capacity grows in ``step`` (20%) steps, evenly spaced
  (10% → 30% → 50% → 70% → 90%);
- **stage 3**: everything is open, and the background warmers may start.

Both durations 0: no ramp (stage 3 from the start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RampSchedule:
    stage1_s: float = 120.0
    stage2_s: float = 180.0
    first: float = 0.10
    step: float = 0.20

    def __post_init__(self) -> None:
        if self.stage1_s < 0 or self.stage2_s < 0:
            raise ValueError("ramp stage durations must be >= 0")
        if not 0 < self.first <= 1 or not 0 < self.step <= 1:
            raise ValueError("the ramp's first fraction and step must lie in (0, 1]")

    @property
    def steps(self) -> int:
        """Stage 2's increases: as many ``step``s as stay below the whole capacity."""
        return max(0, math.ceil((1.0 - self.first) / self.step) - 1)

    @property
    def total_s(self) -> float:
        return self.stage1_s + self.stage2_s

    def stage(self, elapsed_s: float) -> int:
        if elapsed_s < self.stage1_s:
            return 1
        if elapsed_s < self.total_s:
            return 2
        return 3

    def fraction(self, elapsed_s: float) -> float:
        """Share of the capacity open ``elapsed_s`` after the start."""
        stage = self.stage(elapsed_s)
        if stage == 1:
            return self.first
        if stage == 3:
            return 1.0
        # Stage 2 is cut into `steps` equal parts; the k-th adds k steps.
        done = math.floor((elapsed_s - self.stage1_s) / self.stage2_s * self.steps) + 1
        return min(1.0, self.first + min(done, self.steps) * self.step)

    def capacity(self, elapsed_s: float, whole: int) -> int:
        """How many of ``whole`` (sequences, tokens) are open: at least 1."""
        return max(1, math.floor(whole * self.fraction(elapsed_s) + 1e-9))
