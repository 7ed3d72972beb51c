"""SIMULATOR baseline ``static-batch``: the source article's static batching, as a scheduling policy.

Batches of up to ``batch_size`` requests in arrival order, each run in one engine call; the next batch
starts only when the longest member of the last one finished (the "barrel effect"). Only the
simulator runs it: no one deploys it, it is the failure tailcut's numbers are measured against.
"""

from __future__ import annotations

from dataclasses import replace

from workers.policies import ArrivalOrder
from workers.scheduling import Decision, EngineView, SchedulerConfig


class StaticBatch(ArrivalOrder):
    def __init__(self, config: SchedulerConfig, *, batch_size: int) -> None:
        super().__init__(config)
        self.batch_size = batch_size

    def schedule(self, view: EngineView, now_ms: int) -> Decision:
        if self.running:
            return Decision()
        return super().schedule(replace(view, free_slots=min(view.free_slots, self.batch_size)), now_ms)
