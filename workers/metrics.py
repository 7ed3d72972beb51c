"""Prometheus metrics of one worker process, read from the worker's own state at scrape time.

Nothing here runs per token: the collector reads the counters the worker keeps anyway (preemptions,
yields, engine calls, degradations, outcomes) and its live state (running and waiting requests per
tier, the token budget in force, the step time, the breakers) when Prometheus asks. vLLM's own
metrics of the engine in this process (KV-cache usage, prefix-cache queries and hits, its latencies)
are re-exported under their ``vllm:`` names from prometheus-client's default registry, where vLLM
registers them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from queues.breakers import STATE_VALUES
from queues.keys import TIERS
from workers.reservation import VERDICTS, ReservationRecord

if TYPE_CHECKING:
    from workers.worker import Worker

VLLM_PREFIX = "vllm:"


class WorkerCollector(Collector):
    """The ``tailcut_worker_*`` families of one worker (and its view of the shared breakers)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        labels = {"worker": worker.worker_id}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, text, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, text, labels=names)
            family.add_metric(values, value)
            return family

        running = GaugeMetricFamily(
            "tailcut_worker_running_requests", "Requests in the engine now.", labels=[*names, "tier"]
        )
        waiting = GaugeMetricFamily(
            "tailcut_worker_waiting_requests",
            "Requests read from Redis, waiting in this worker's queue.",
            labels=[*names, "tier"],
        )
        by_tier = worker.requests_by_tier()
        for tier in TIERS:
            num_running, num_waiting = by_tier[tier]
            running.add_metric([*values, tier], num_running)
            waiting.add_metric([*values, tier], num_waiting)
        yield running
        yield waiting
        budget = worker.token_budget
        if budget is not None:
            yield gauge("tailcut_worker_token_budget_tokens", "The engine's per-step token budget in force.", budget)
        chunk = worker.prefill_chunk
        if chunk is not None:
            yield gauge(
                "tailcut_worker_prefill_chunk_tokens",
                "The engine's prefill chunk in force (most prompt tokens one request computes per step), as "
                "the scheduler set it from the realtime prompts seen.",
                chunk,
            )
        yield gauge(
            "tailcut_worker_warmup_stage",
            "Cold-start stage: 1 (10% of the capacity open), 2 (growing in 20% steps), 3 (all open).",
            worker.warmup_stage,
        )
        yield gauge(
            "tailcut_worker_capacity_ratio",
            "Share of the capacity the cold-start ramp has open.",
            worker.capacity_fraction,
        )
        warmer = worker.prefix_warmer
        if warmer is not None:
            prefixes = GaugeMetricFamily(
                "tailcut_worker_prefix_warmup_prompts",
                "Prefix warmup's prompts: planned, done, failed (refused by the engine), yielded (aborted for real "
                "traffic and run again later).",
                labels=[*names, "state"],
            )
            for state, count in (
                ("planned", warmer.total),
                ("done", warmer.done),
                ("failed", warmer.failed),
                ("yielded", warmer.yielded),
            ):
                prefixes.add_metric([*values, state], count)
            yield prefixes
        keeper = worker.keeper
        if keeper is not None:
            yield counter(
                "tailcut_worker_keepalive_touches_total",
                "Prefix keep-alive touches sent to the engine (one-token requests keeping finished chat turns cached).",
                keeper.stats.touches,
            )
            yield counter(
                "tailcut_worker_keepalive_returns_total",
                "Requests that continued a kept chat turn (their prompt starts with its prompt).",
                keeper.stats.returns,
            )
            yield counter(
                "tailcut_worker_keepalive_evicted_total",
                "Touches that found their turn evicted already (the turn is let go).",
                keeper.stats.evicted,
            )
            yield gauge(
                "tailcut_worker_keepalive_kept_tokens", "KV tokens of the chat turns kept now.", keeper.kept_tokens
            )
        yield gauge(
            "tailcut_worker_step_seconds", "Smoothed time of one engine step (decode iteration).", worker.step_ms / 1000
        )
        yield gauge(
            "tailcut_worker_kv_capacity_tokens", "Tokens the engine's KV cache holds.", worker.kv_capacity_tokens
        )
        yield counter("tailcut_worker_preemptions_total", "Running requests preempted.", worker.num_preempted)
        yield counter(
            "tailcut_worker_yields_total", "Slices that ended by handing the rest back to Redis.", worker.num_yielded
        )
        yield counter(
            "tailcut_worker_engine_calls_total", "Engine calls (slices, summaries) started.", worker.num_engine_calls
        )
        yield counter("tailcut_worker_degradations_total", "Replies degraded (summaries, caps).", worker.num_degraded)
        outcomes = CounterMetricFamily(
            "tailcut_worker_requests_total", "Deliveries this worker ended, by outcome.", labels=[*names, "outcome"]
        )
        for outcome, count in sorted(worker.outcomes.items()):
            outcomes.add_metric([*values, outcome], count)
        yield outcomes
        breakers = GaugeMetricFamily(
            "tailcut_breaker_state",
            "Circuit breaker of each SLO tier as this worker last read it: 0 closed, 1 half-open, 2 open.",
            labels=[*names, "tier"],
        )
        for tier, view in sorted(worker.breakers.views.items()):
            breakers.add_metric([*values, tier], STATE_VALUES[view.state])
        yield breakers
        yield from reservation_families(worker.reservations, labels)


def reservation_families(record: ReservationRecord, labels: dict[str, str]) -> Iterator[Metric]:
    """How the scheduler's KV reservations fared (``workers.reservation``): engine calls by verdict, and
    the output tokens reserved, produced and reserved but left unused."""
    names, values = list(labels), list(labels.values())
    calls = CounterMetricFamily(
        "tailcut_worker_kv_reservations",
        "Engine calls by how their KV reservation fared: short (produced more than reserved), wasteful (a whole "
        "KV block reserved and unused), exact.",
        labels=[*names, "outcome"],
    )
    for outcome in VERDICTS:
        calls.add_metric([*values, outcome], record.count(outcome))
    yield calls
    for name, text, value in (
        ("reserved", "Output tokens of KV the scheduler reserved for engine calls.", record.reserved_tokens),
        ("produced", "Output tokens the engine calls with a reservation produced.", record.produced_tokens),
        ("unused", "Output tokens of KV reserved and not produced.", record.unused_tokens),
    ):
        family = CounterMetricFamily(f"tailcut_worker_kv_reservation_{name}_tokens", text, labels=names)
        family.add_metric(values, value)
        yield family


class VllmCollector(Collector):
    """vLLM's metrics from the default registry (where vLLM registers them), under their own names."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if family.name.startswith(VLLM_PREFIX):
                yield family


def worker_registry(worker: Worker) -> CollectorRegistry:
    """What a worker process serves on ``/metrics``: its own families and vLLM's."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    registry.register(VllmCollector())
    return registry
