"""Minimum fair share for the normal tier: deficit round robin with latency-driven weights (pure).

Each flow (a tenant) gets ``quantum * w_i`` tokens of credit per visit, with
``w_i = 1 / ln(1 + RTT_avg / RTT_i)`` clamped to ``[min_weight, max_weight]``: a flow whose recent
queue latency ``RTT_i`` is above the average gets a larger weight, one that is doing well a smaller
one. Without latency data a flow gets the weight of an average flow, ``1 / ln 2``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

NEUTRAL_WEIGHT = 1 / math.log(2)


def rtt_weight(rtt_avg_ms: float, rtt_ms: float, *, min_weight: float, max_weight: float) -> float:
    """``1 / ln(1 + RTT_avg / RTT_i)``, clamped; neutral when either latency is unknown (<= 0)."""
    if rtt_avg_ms <= 0 or rtt_ms <= 0:
        return min(max(NEUTRAL_WEIGHT, min_weight), max_weight)
    weight = 1 / math.log1p(rtt_avg_ms / rtt_ms)
    return min(max(weight, min_weight), max_weight)


@dataclass
class _Flow(Generic[T]):
    name: str
    items: deque[tuple[T, int]] = field(default_factory=deque)
    deficit: float = 0.0


class DeficitRoundRobin(Generic[T]):
    """Weighted DRR over named flows; ``pop`` returns the next item and charges its cost."""

    def __init__(self, quantum: int, weight: Callable[[str], float]) -> None:
        self._quantum = quantum
        self._weight = weight
        self._flows: dict[str, _Flow[T]] = {}
        self._active: deque[_Flow[T]] = deque()
        self._credited = False

    def __len__(self) -> int:
        return sum(len(flow.items) for flow in self._active)

    def __iter__(self) -> Iterator[T]:
        for flow in self._active:
            for item, _cost in flow.items:
                yield item

    def push(self, flow_name: str, item: T, cost: int) -> None:
        flow = self._flows.setdefault(flow_name, _Flow(flow_name))
        if not flow.items:
            self._active.append(flow)
        flow.items.append((item, max(1, cost)))

    def push_front(self, flow_name: str, item: T, cost: int) -> None:
        """Undo a ``pop`` (the item did not fit after all): it goes back first, its cost refunded."""
        flow = self._flows.setdefault(flow_name, _Flow(flow_name))
        if not flow.items:
            self._active.appendleft(flow)
            self._credited = True
        flow.items.appendleft((item, max(1, cost)))
        flow.deficit += max(1, cost)

    def remove(self, match: Callable[[T], bool]) -> T | None:
        for flow in list(self._active):
            for entry in flow.items:
                if match(entry[0]):
                    flow.items.remove(entry)
                    if not flow.items:
                        self._drop(flow)
                    return entry[0]
        return None

    def pop(self) -> T | None:
        while self._active:
            flow = self._active[0]
            if not self._credited:
                flow.deficit += self._quantum * self._weight(flow.name)
                self._credited = True
            item, cost = flow.items[0]
            if cost <= flow.deficit:
                flow.deficit -= cost
                flow.items.popleft()
                if not flow.items:
                    self._drop(flow)
                return item
            self._active.rotate(-1)
            self._credited = False
        return None

    def _drop(self, flow: _Flow[T]) -> None:
        flow.deficit = 0.0
        if self._active and self._active[0] is flow:
            self._active.popleft()
            self._credited = False
        else:
            self._active.remove(flow)
