"""The baseline policies and the factory of every policy (pure).

- ``fifo`` (``ArrivalOrder``): one queue in arrival order, no tiers, no budget, no slices — what a
  plain engine server does.
- ``vllm-priority`` (``VllmPriority``): the same, with the tier as the engine's request priority —
  what turning on vLLM's priority scheduling alone gives.
- ``tailcut``: the SLO rules of DESIGN.md (``workers.scheduler.TailcutPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from queues.keys import Tier
from workers.scheduler import TailcutPolicy
from workers.scheduling import (
    TIER_RANK,
    Decision,
    EngineView,
    PolicyName,
    RequestHeap,
    RunningTable,
    SchedRequest,
    SchedulerConfig,
    SchedulingPolicy,
)


class ArrivalOrder(RunningTable):
    """``fifo``: everything in arrival order, each request in one engine call."""

    steers_token_budget = False
    # It admits by free slots alone: KV is the engine's own allocator's business, as in a plain server.
    admits_by_kv = False
    # A plain engine server streams what the engine gives, however late.
    degrades = False

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__()
        self.config = config
        self._arrival = RequestHeap()

    @property
    def num_waiting(self) -> int:
        return len(self._arrival)

    def waiting(self) -> Iterator[SchedRequest]:
        yield from self._arrival

    def add(self, request: SchedRequest) -> None:
        self._arrival.push((request.arrival_ms,), request)

    def remove(self, request_id: str) -> SchedRequest | None:
        if request_id in self._running:
            return self._running.pop(request_id)
        return self._arrival.remove(request_id)

    def schedule(self, view: EngineView, now_ms: int) -> Decision:
        decision = Decision()
        for _ in range(view.free_slots):
            if not self._arrival:
                break
            request = self._arrival.pop()
            self._running[request.id] = request
            decision.admit.append(request)
        return decision

    def slice_limit(self, request: SchedRequest) -> int:
        return request.remaining_tokens

    def engine_priority(self, request: SchedRequest) -> int:
        return 0

    def summary_priority(self, request: SchedRequest) -> int:
        return self.engine_priority(request)

    def at_slice_boundary(self, request_id: str, view: EngineView) -> bool:
        return False

    def prefetch_room(self, tier: Tier, prefetch: int) -> int:
        return prefetch - self.num_waiting


class VllmPriority(ArrivalOrder):
    """``vllm-priority``: arrival order here, the tier as the engine's priority (lower runs first)."""

    def engine_priority(self, request: SchedRequest) -> int:
        return TIER_RANK[request.tier]


POLICIES: dict[PolicyName, Callable[[SchedulerConfig], SchedulingPolicy]] = {
    "tailcut": TailcutPolicy,
    "fifo": ArrivalOrder,
    "vllm-priority": VllmPriority,
}


def make_scheduler(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy ``config.policy`` names."""
    return POLICIES[config.policy](config)
