"""SIMULATOR runs on a virtual clock: the worker's scheduler driving the ``sim`` engine (pure, offline).

Nothing here runs a model or waits for a clock. A trace of arrivals (``bench.workloads``) is fed to the
same code the live pipeline runs — ``api.admission.bucket_of`` and the output-length predictor pick the
bucket, ``workers.continuation`` builds the scheduler's requests and continuations, ``Scheduler``
decides every round — and the decisions are carried out on ``SimEngine``, whose steps take the time
the cost model gives them. A 10-minute seed-mix trace runs in seconds, and the same seed gives the
same figures in any process.

What the driver does per round mirrors ``workers.worker.Worker``: a scheduling round (its admissions
become engine requests ``{id}-{slice}`` with the tier as priority, its preemptions abort and requeue a
continuation), the budget it chose applied to the engine's step budget, one engine step, then each
finished slice either continues at once (``at_slice_boundary`` said go on) or is requeued. Rounds run
once per engine step here; the live worker runs one per change, which is at least as often. As with a
real engine, the driver reads a step's outputs (tokens, finishes, first tokens) only once the next
step is under way (``output_lag_steps``), so what it does about them lands a step later; ``tailcut
bench live`` found the live pipeline between this and reading at once, closer to this.

Policies:
- ``fifo``, ``vllm-priority``: every arrival goes straight to the engine (a plain engine server), FCFS
  or with the tier as vLLM's priority;
- ``tailcut``: the full scheduler (``SchedulerConfig``), plus load shedding at admission;
- ``static-batch``: the source article's baseline: batches of up to ``static_batch_size`` requests in
  arrival order, the next batch only after the longest member of the last one finished.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from api.admission import bucket_of
from api.predictor import OutputLengthPredictor
from api.settings import ApiSettings
from api.shedding import ShedLimits
from bench.workloads import Arrival, Workload, draw_requests
from queues.keys import Tier
from queues.messages import RequestMessage, SamplingSpec
from workers.continuation import continuation, sched_request
from workers.engines.costmodel import CostModel, kv_capacity_tokens
from workers.engines.sim import KvAllocation, SimEngine, StepResult
from workers.scheduler import EngineView, Policy, Scheduler, SchedulerConfig

SimPolicyName = Literal["static-batch", "fifo", "vllm-priority", "tailcut"]
SIM_POLICIES: tuple[SimPolicyName, ...] = ("static-batch", "fifo", "vllm-priority", "tailcut")
TIERS: tuple[Tier, ...] = ("realtime", "normal", "background")

SIMULATOR_NOTE = "SIMULATOR: virtual clock, step times from the {cost} cost model; no model ran"
# Smoothing of the step time the scheduler sees, as the live worker's ``STEP_SMOOTHING``.
STEP_SMOOTHING = 0.2
# Synthetic prompt token ids: unique per request, so only a request's own blocks are ever cache hits.
_PROMPT_ID_BASE = 1 << 50


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: SimPolicyName
    cost: CostModel
    label: str = ""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    shed: ShedLimits | None = None
    kv_capacity_tokens: int = field(default_factory=kv_capacity_tokens)
    block_size: int = 16
    kv_allocation: KvAllocation = "paged"
    prefix_cache: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # tailcut configures the engine's ``long_prefill_token_threshold``; the baselines keep vLLM's 0.
    long_prefill_token_threshold: int = 256
    static_batch_size: int = 256
    # ``exact``: a request asks for exactly its drawn output length (as the live load generator does,
    # with ignore_eos); ``tier-cap``: it asks for its tier's longest reply and ends (end-of-sequence)
    # at its drawn length, as real clients do — what a static KV reservation has to hold.
    max_tokens: Literal["exact", "tier-cap"] = "exact"
    # After the last arrival, the run goes on at most this long for queued work to finish.
    drain_s: float = 120.0
    # 1: the scheduler learns of a step's tokens, finishes and first tokens only while the engine
    # already runs the next step (vLLM's engine core does not wait for its client), so reactions to
    # them land a step later; new arrivals still make the next step. 0: it learns at once.
    output_lag_steps: Literal[0, 1] = 1

    @property
    def name(self) -> str:
        return self.label or self.policy


@dataclass(slots=True)
class SimRecord:
    """One request's fate on the virtual clock (times in ms from its arrival)."""

    arrival: Arrival
    bucket: str
    status: Literal["ok", "rejected", "expired", "unfinished"] = "ok"
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    engine_calls: int = 0

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass(slots=True)
class KvSample:
    """Duration-weighted KV figures of a run."""

    busy_us: float = 0.0
    usage_us: float = 0.0  # Σ kv_usage · duration
    filled_us: float = 0.0  # Σ (filled slots / used slots) · duration
    peak_usage: float = 0.0
    max_running: int = 0

    def add(self, step: StepResult, num_running: int) -> None:
        self.busy_us += step.duration_us
        self.usage_us += step.kv_usage * step.duration_us
        self.filled_us += (1.0 - step.kv_reserved_unused_share) * step.duration_us
        self.peak_usage = max(self.peak_usage, step.kv_usage)
        self.max_running = max(self.max_running, num_running)

    @property
    def mean_usage(self) -> float:
        return self.usage_us / self.busy_us if self.busy_us else 0.0

    @property
    def mean_filled_share(self) -> float:
        return self.filled_us / self.busy_us if self.busy_us else 0.0


@dataclass(slots=True)
class SimRun:
    config: SimConfig
    duration_s: float
    records: list[SimRecord]
    end_s: float
    num_steps: int
    # Output tokens produced per tier within the arrival window [0, duration_s).
    window_output_tokens: dict[Tier, int]
    kv: KvSample
    num_preempted: int = 0
    num_yielded: int = 0


@dataclass(slots=True, eq=False)
class _Request:
    arrival: Arrival
    message: RequestMessage
    record: SimRecord
    generated: list[int] = field(default_factory=list)
    engine_id: str | None = None
    slice_generated: int = 0


class _Driver:
    """One run: the trace, the scheduler (tailcut and the arrival-order policies), the engine."""

    def __init__(self, workload: Workload, config: SimConfig, api: ApiSettings) -> None:
        self.workload = workload
        self.config = config
        self.api = api
        self.engine = SimEngine(
            config.cost,
            kv_capacity_tokens=config.kv_capacity_tokens,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            kv_allocation=config.kv_allocation,
            prefix_cache=config.prefix_cache,
            policy="fcfs" if config.policy in ("fifo", "static-batch") else "priority",
            long_prefill_token_threshold=config.long_prefill_token_threshold if config.policy == "tailcut" else 0,
        )
        scheduler_policy: Policy = "vllm-priority" if config.policy == "vllm-priority" else "fifo"
        self.scheduler = Scheduler(
            config.scheduler
            if config.policy == "tailcut"
            else SchedulerConfig(policy=scheduler_policy, budget=config.scheduler.budget)
        )
        self.predictor = OutputLengthPredictor()
        self.by_engine_id: dict[str, _Request] = {}
        self.by_id: dict[str, _Request] = {}
        self.static_queue: deque[_Request] = deque()
        self.step_ms = 20.0
        self.num_preempted = 0
        self.num_yielded = 0
        self.next_prompt_id = _PROMPT_ID_BASE

    # --- arrivals -------------------------------------------------------------------------------

    def arrive(self, arrival: Arrival) -> SimRecord:
        mix = self.workload.mix(arrival.tier)
        predicted = self.predictor.predict(
            tier=arrival.tier,
            tenant=arrival.tenant,
            prompt_tokens=arrival.prompt_tokens,
            max_tokens=mix.output_tokens[1],
        )
        arrival_ms = int(arrival.at_s * 1000)
        message = RequestMessage(
            id=f"r{arrival.index}",
            tenant=arrival.tenant,
            tier=arrival.tier,
            bucket=bucket_of(arrival.prompt_tokens + predicted, self.api),
            prompt_token_ids=self._prompt_ids(arrival.prompt_tokens),
            sampling=SamplingSpec(
                max_tokens=mix.output_tokens[1] if self.config.max_tokens == "tier-cap" else arrival.output_tokens,
                ignore_eos=self.config.max_tokens == "exact",
            ),
            predicted_output_tokens=predicted,
            enqueued_at_ms=arrival_ms,
            deadline_ms=arrival_ms + int(self.api.deadline_s(arrival.tier) * 1000),
            reply_to="sim",
        )
        record = SimRecord(arrival, message.bucket)
        if self.config.shed is not None and self.config.shed.sheds(arrival.tier, self._num_waiting(arrival.tier)):
            record.status = "rejected"
            return record
        request = _Request(arrival, message, record)
        self.by_id[message.id] = request
        if self.config.policy == "static-batch":
            self.static_queue.append(request)
        else:
            self.scheduler.add(sched_request(message))
        return record

    def _prompt_ids(self, count: int) -> list[int]:
        first, self.next_prompt_id = self.next_prompt_id, self.next_prompt_id + count
        return list(range(first, self.next_prompt_id))

    def _num_waiting(self, tier: Tier) -> int:
        return sum(1 for request in self.scheduler.waiting() if request.tier == tier)

    # --- one round ------------------------------------------------------------------------------

    def view(self) -> EngineView:
        running = self.scheduler.running.values()
        slice_tokens = self.config.scheduler.slice_tokens
        return EngineView(
            free_slots=self.config.max_num_seqs - len(running),
            free_kv_tokens=self.engine.kv_capacity_tokens - sum(r.kv_tokens(slice_tokens) for r in running),
            step_ms=self.step_ms,
        )

    def schedule(self, now_ms: int) -> None:
        if self.config.policy == "static-batch":
            if self.engine.num_unfinished() == 0:
                for _ in range(min(self.config.static_batch_size, len(self.static_queue))):
                    request = self.static_queue.popleft()
                    self._start(request, request.message.sampling.max_tokens, priority=0)
            return
        if self.config.policy != "tailcut":
            # A plain engine server: everything goes to the engine, whose own queue orders it.
            view = EngineView(free_slots=self.scheduler.num_waiting, free_kv_tokens=1 << 40)
            for admitted in self.scheduler.schedule(view, now_ms).admit:
                request = self.by_id[admitted.id]
                self._start(request, admitted.remaining_tokens, priority=self.scheduler.engine_priority(admitted))
            return
        decision = self.scheduler.schedule(self.view(), now_ms)
        for admitted in decision.admit:
            request = self.by_id[admitted.id]
            if now_ms > request.message.deadline_ms:  # as the worker: expired before it could run
                request.record.status = "expired"
                self.scheduler.finish(admitted.id, admitted)
                del self.by_id[admitted.id]
                continue
            self._start(
                request, self.scheduler.slice_limit(admitted), priority=self.scheduler.engine_priority(admitted)
            )
        for victim in decision.preempt:
            request = self.by_id[victim.id]
            if request.engine_id is not None:
                self.engine.abort(request.engine_id)
                del self.by_engine_id[request.engine_id]
                request.engine_id = None
            self.num_preempted += 1
            self._requeue(request)
        self.engine.set_token_budget(decision.token_budget)

    def _start(self, request: _Request, max_tokens: int, *, priority: int) -> None:
        """One engine call: the prompt plus what the request generated so far, as the worker sends."""
        message = request.message
        engine_id = f"{message.id}-{message.slice_index}-{request.record.engine_calls}"
        request.record.engine_calls += 1
        request.engine_id = engine_id
        request.slice_generated = 0
        self.by_engine_id[engine_id] = request
        self.engine.add(
            engine_id,
            message.prompt_token_ids + request.generated,
            max_tokens,
            priority=priority,
            stop_after=request.arrival.output_tokens - len(request.generated),
        )

    def _requeue(self, request: _Request) -> None:
        request.message = continuation(request.message, request.generated, next_seq=len(request.generated) + 1)
        self.scheduler.add(sched_request(request.message))

    # --- one step -------------------------------------------------------------------------------

    def after_step(self, step: StepResult, tokens_per_tier: dict[Tier, int] | None) -> None:
        """Hand out the step's tokens (counted per tier into ``tokens_per_tier`` when given)."""
        end_us = step.end_us
        self.step_ms += STEP_SMOOTHING * (step.duration_us / 1000 - self.step_ms)
        for engine_id, token_id in step.new_token_ids.items():
            request = self.by_engine_id.get(engine_id)
            if request is None:  # preempted after the step ran: its continuation starts from before
                continue
            if tokens_per_tier is not None:
                tokens_per_tier[request.arrival.tier] += 1
            request.generated.append(token_id)
            request.slice_generated += 1
            if request.slice_generated == 1:
                self.scheduler.prefilled(request.message.id)
            if request.record.ttft_ms is None:
                request.record.ttft_ms = end_us / 1000 - request.arrival.at_s * 1000
        for engine_id in step.finished:
            request = self.by_engine_id.pop(engine_id, None)
            if request is None:
                continue
            request.engine_id = None
            self._slice_done(request, end_us)

    def _slice_done(self, request: _Request, end_us: float) -> None:
        message = request.message
        if len(request.generated) >= request.arrival.output_tokens:
            request.record.e2e_ms = end_us / 1000 - request.arrival.at_s * 1000
            request.record.output_tokens = len(request.generated)
            self.scheduler.finish(message.id)
            del self.by_id[message.id]
            self.predictor.observe(
                tier=message.tier,
                tenant=message.tenant,
                prompt_tokens=len(message.prompt_token_ids),
                output_tokens=len(request.generated),
            )
            return
        # A slice ended short of max_tokens: the worker continues or yields (tailcut only slices).
        self.scheduler.advance(message.id, request.slice_generated)
        if self.scheduler.at_slice_boundary(message.id, self.view()):
            self.num_yielded += 1
            self._requeue(request)
            return
        message.slice_index += 1
        running = self.scheduler.running[message.id]
        self._start(request, self.scheduler.slice_limit(running), priority=self.scheduler.engine_priority(running))


def simulate(
    trace: list[Arrival],
    workload: Workload,
    config: SimConfig,
    *,
    duration_s: float,
    api: ApiSettings | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> SimRun:
    """Run ``trace`` through ``config`` on the virtual clock until every request finished or
    ``config.drain_s`` after the last arrival; what is still queued then is ``unfinished``."""
    driver = _Driver(workload, config, api or ApiSettings())
    engine = driver.engine
    records: list[SimRecord] = []
    window_tokens = dict.fromkeys(TIERS, 0)
    kv = KvSample()
    pending = deque(trace)
    last_arrival_s = trace[-1].at_s if trace else 0.0
    stop_us = (max(last_arrival_s, duration_s) + config.drain_s) * 1e6
    window_end_us = duration_s * 1e6
    num_steps = 0
    next_progress_us = 0.0
    # With ``output_lag_steps`` 1, a step's outputs reach the driver only once the next step is
    # under way, as a worker reads vLLM's outputs while its engine core already runs the next step.
    unread: StepResult | None = None

    def read(step: StepResult) -> None:
        driver.after_step(step, window_tokens if step.start_us < window_end_us else None)

    while True:
        now_us = engine.now_us
        while pending and pending[0].at_s * 1e6 <= now_us:
            records.append(driver.arrive(pending.popleft()))
        if not driver.by_id:
            if not pending:
                break
            engine.idle_until(pending[0].at_s * 1e6)
            continue
        if now_us >= stop_us:
            break
        driver.schedule(int(now_us / 1000))
        step = engine.step()
        if step.idle:
            if unread is not None:  # the engine ran dry: what it last produced is read now
                read(unread)
                unread = None
                continue
            # Nothing could run (a static batch waits for its start, or the engine is empty while
            # requests wait in the scheduler for the clock): move to the next arrival.
            if engine.num_unfinished() or not pending:
                raise RuntimeError(f"simulation stalled at {now_us / 1e6:.3f} s with {len(driver.by_id)} requests")
            engine.idle_until(pending[0].at_s * 1e6)
            continue
        num_steps += 1
        kv.add(step, engine.num_running)
        if config.output_lag_steps:
            if unread is not None:
                read(unread)
            unread = step
        else:
            read(step)
        if on_progress is not None and now_us >= next_progress_us:
            on_progress(now_us / 1e6)
            next_progress_us = now_us + 1e6
    if unread is not None:
        read(unread)
    for request in driver.by_id.values():
        request.record.status = "unfinished"
        request.record.output_tokens = len(request.generated)
    return SimRun(
        config=config,
        duration_s=duration_s,
        records=records,
        end_s=engine.now_us / 1e6,
        num_steps=num_steps,
        window_output_tokens=window_tokens,
        kv=kv,
        num_preempted=driver.num_preempted,
        num_yielded=driver.num_yielded,
    )


# --- capacity and the physical floor ----------------------------------------------------------------


def fifo_capacity_rps(
    workload: Workload, cost: CostModel, *, seed: int, num_requests: int = 3000, base: SimConfig | None = None
) -> float:
    """Saturation request rate of ``fifo``: everything arrives at once, completions per second
    between the 10% and 90% marks (leaving out the ramp-up and the draining tail)."""
    config = base or SimConfig(policy="fifo", cost=cost)
    config = SimConfig(
        policy="fifo",
        cost=cost,
        kv_capacity_tokens=config.kv_capacity_tokens,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        drain_s=math.inf,
    )
    trace = draw_requests(workload, num_requests, np.random.default_rng([seed, 3]))
    run = simulate(trace, workload, config, duration_s=0.0)
    done = sorted(record.e2e_ms for record in run.records if record.e2e_ms is not None)
    low, high = done[len(done) // 10], done[len(done) * 9 // 10]
    return (len(done) * 8 // 10) / ((high - low) / 1000)


def mean_step_us(workload: Workload, cost: CostModel, rate_rps: float) -> float:
    """The shortest average step that serves the offered work: with steps back to back, each step
    carries ``rate·T`` requests' worth of prefill and ``rate·T·mean output`` decodes (Little's law),
    so ``T = base + c_p·rate·T·P̄ + c_d·rate·T·Ō``. Infinite when the work alone fills every step."""
    load = rate_rps * (
        cost.prefill_token_us * workload.mean_prompt_tokens + cost.decode_seq_us * workload.mean_output_tokens
    )
    load /= 1e6
    return math.inf if load >= 1 else cost.base_us / (1 - load)


def floor_e2e_ms(workload: Workload, cost: CostModel, rate_rps: float, tier: Tier, *, quantile: float = 0.99) -> float:
    """Physical floor of a tier's E2E at the given quantile of its reply length: one step that
    prefills the prompt, then one decode step per further token, every step at least the mean step
    the offered load requires (WORKLOADS.md "What physics allows")."""
    mix = workload.mix(tier)
    low, high = mix.output_tokens
    tokens = low + quantile * (high - low)
    step_us = mean_step_us(workload, cost, rate_rps)
    prefill_us = max(step_us, cost.step_us(mix.prompt_tokens[1], 0))
    return (prefill_us + (tokens - 1) * step_us) / 1000
