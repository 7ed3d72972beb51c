"""SIMULATOR runs on a virtual clock: the worker's own scheduling and request code driving the ``sim``
engine (pure, offline).

Nothing here runs a model or waits for a clock. A trace of arrivals (``bench.workloads``) goes through
the code the live pipeline runs: ``admission.admitter.Admitter`` admits each arrival (bucket,
output-length prediction, deadline, load shedding) and learns from each finished request; the
scheduling policy (``workers.policies.make_scheduler``) decides every round on the same
``workers.capacity.engine_view`` the worker builds; each admitted request runs as a
``workers.lifecycle.RequestLifecycle`` — the worker's per-request state machine, which names the
engine calls, turns outputs into events and decides at each slice boundary whether to finish, go on or
yield; the engine's step budget follows the scheduler's by the worker's ``BudgetFollower`` rule. A
multi-turn session's turns share their leading prompt ids (``bench.workloads.sim_session_token_ids``),
so the engine's prefix cache serves a later turn the earlier prompt it repeats. The
decisions are carried out on ``SimEngine``, whose steps take the time the cost model gives them. A
10-minute seed-mix trace runs in seconds, and the same seed gives the same figures in any process.

What differs from the live worker is only what a virtual clock changes: rounds run once per engine
step here (the live worker runs one per change, which is at least as often), and, as with a real
engine, the driver reads a step's outputs (tokens, finishes, first tokens) only once the next step is
under way (``output_lag_steps``), so what it does about them lands a step later; ``tailcut bench
live`` found the live pipeline between this and reading at once, closer to this.

Policies:
- ``fifo``, ``vllm-priority``: every arrival goes straight to the engine (a plain engine server), FCFS
  or with the tier as vLLM's priority;
- ``tailcut``: the full scheduler (``SchedulerConfig``), plus load shedding at admission;
- ``static-batch``: the source article's baseline (``bench.static_batch``): batches of up to
  ``static_batch_size`` requests in arrival order, the next batch only after the longest member of the
  last one finished.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from admission.admitter import Admitter
from admission.config import AdmissionConfig, Deadlines
from admission.request import GenerationRequest, ServedModel, TokenPrompt
from admission.settings import AdmissionSettings
from admission.shedding import ShedLimits
from bench.static_batch import StaticBatch
from bench.workloads import Arrival, TierMix, Workload, draw_requests, sim_session_token_ids
from queues.keys import Tier
from queues.messages import RequestMessage, SamplingOptions
from tailcut.errors import OverloadedError
from workers.budget import BudgetConfig
from workers.capacity import BudgetFollower, ChunkFollower, StepTimer, engine_view
from workers.engines.costmodel import CostModel, kv_capacity_tokens
from workers.engines.sim import KvAllocation, SimEngine, StepResult
from workers.engines.steplog import StepLog
from workers.lifecycle import Continue, EngineCall, Finished, RequestLifecycle
from workers.policies import make_scheduler
from workers.reservation import ReservationRecord
from workers.retention import TOUCH_PRIORITY, KeeperStats, PrefixKeeper, Touch
from workers.scheduling import EngineView, PolicyName, SchedRequest, SchedulerConfig, SchedulingPolicy

SimPolicyName = Literal["static-batch", "fifo", "vllm-priority", "tailcut"]
SIM_POLICIES: tuple[SimPolicyName, ...] = ("static-batch", "fifo", "vllm-priority", "tailcut")
TIERS: tuple[Tier, ...] = ("realtime", "normal", "background")

SIMULATOR_NOTE = "SIMULATOR: virtual clock, step times from the {cost} cost model; no model ran"
# Context length of the simulated model (Llama-3.1-8B, the cost models' model).
SIM_MAX_MODEL_LEN = 131_072
# A plain engine server hands every request to the engine, whose own queue orders them.
UNBOUNDED = 1 << 30
NO_DEADLINE_S = 1e9
# Requests sent at once to measure fifo's capacity (``fifo_capacity_rps``). The 10-90% window carries
# the drain's composition: on long-history, whose replies vary most, 3,000 read 2-8% high; 30,000 are
# within 0.5% of 100,000 on every workload tried (BENCHMARKS.md "Where 90% sits on long-history") and
# take 20-45 seconds of one core.
CAPACITY_REQUESTS = 30_000
# Fewer leave no steady window between the first admissions and the drain.
MIN_CAPACITY_REQUESTS = 100
# Synthetic prompt token ids: unique per request, so only a request's own blocks are ever cache hits.
_PROMPT_ID_BASE = 1 << 50


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: SimPolicyName
    cost: CostModel
    label: str = ""
    # Its ``kv_block_tokens`` is replaced by ``block_size``: the scheduler counts the engine's blocks.
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
    # Arrival → the engine first scheduled it (WORKLOADS.md's queue wait, wherever it waited: in
    # tailcut's queues or in a plain engine's own; an expired request: until it was dropped), and its
    # prompt tokens the prefix cache served then.
    queue_wait_ms: float | None = None
    cached_prompt_tokens: int = 0

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
    # Recompute preemptions inside the engine (KV ran out while a running request grew), as against
    # ``num_preempted``: the scheduler's aborts of background work.
    num_engine_preempted: int = 0
    # How the scheduler's KV reservation of each ended engine call compared with its output.
    reservations: ReservationRecord = field(default_factory=ReservationRecord)
    # The engine's prefill chunk at the end, as the policy last set it (None: the policy never did).
    prefill_chunk_tokens: int | None = None
    # What the prefix keep-alive did (``workers.retention``; None: the policy keeps none).
    keep_alive: KeeperStats | None = None


@dataclass(slots=True, eq=False)
class _Request:
    arrival: Arrival
    message: RequestMessage  # the latest one: the original, then each continuation
    record: SimRecord
    life: RequestLifecycle | None = None  # while it runs
    engine_id: str | None = None


class _Driver:
    """One run: the trace, the admitter, the policy, the engine, and each running request's lifecycle."""

    def __init__(
        self, workload: Workload, config: SimConfig, admission: AdmissionConfig, step_log: StepLog | None = None
    ) -> None:
        self.workload = workload
        self.config = config
        self.step_log = step_log
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
        self.scheduler = self._policy()
        # tailcut holds what the engine cannot take; a plain engine server gives the engine everything.
        self.max_running = config.max_num_seqs if config.policy == "tailcut" else UNBOUNDED
        if config.policy == "static-batch":
            # The article's system has no deadlines: a request waits for its batch however long.
            admission = replace(admission, deadlines=Deadlines(NO_DEADLINE_S, NO_DEADLINE_S, NO_DEADLINE_S))
        self.admitter = Admitter(
            replace(admission, shed=config.shed or ShedLimits.never()),
            ServedModel("sim", SIM_MAX_MODEL_LEN),
            queue_depth=self,
        )
        self.by_engine_id: dict[str, _Request] = {}
        self.by_id: dict[str, _Request] = {}
        self.step = StepTimer()
        self.budget = BudgetFollower(config.max_num_batched_tokens)
        self.chunk = ChunkFollower(None)  # as the worker's: the first chunk asked for is applied
        self.num_preempted = 0
        self.num_yielded = 0
        self.reservations = ReservationRecord()
        self.next_prompt_id = _PROMPT_ID_BASE
        # tailcut keeps finished chat turns in the engine's prefix cache, as the worker does.
        keep_alive = config.scheduler.keep_alive
        self.keeper = (
            PrefixKeeper(keep_alive, block_tokens=config.block_size)
            if config.policy == "tailcut" and keep_alive.enabled and config.prefix_cache
            else None
        )
        self.touches: dict[str, Touch] = {}
        self.now_ms = 0  # the clock at the arrival being admitted (``oldest_wait_ms``)

    def _policy(self) -> SchedulingPolicy:
        config = self.config
        # The reservation mode and the engine's block size hold for every policy, so each one's
        # reservations are recorded alike (only tailcut admits by them).
        scheduler = config.scheduler

        def plain(policy: PolicyName, budget: BudgetConfig) -> SchedulerConfig:
            return SchedulerConfig(
                policy=policy, budget=budget, kv_reservation=scheduler.kv_reservation, kv_block_tokens=config.block_size
            )

        if config.policy == "static-batch":
            return StaticBatch(plain("fifo", BudgetConfig()), batch_size=config.static_batch_size)
        if config.policy == "tailcut":
            return make_scheduler(replace(scheduler, kv_block_tokens=config.block_size))
        return make_scheduler(plain(config.policy, scheduler.budget))

    # --- arrivals (``QueueDepth`` for the admitter's shedding rule) -------------------------------

    def waiting(self, tier: Tier) -> int:
        return sum(1 for request in self.scheduler.waiting() if request.tier == tier)

    def oldest_wait_ms(self, tier: Tier) -> float:
        """Of the requests not started yet (a continuation carries its first arrival; a worker's goes
        back into the intake stream with a new entry id)."""
        waiting = (request for request in self.scheduler.waiting() if request.tier == tier and not request.continuation)
        oldest = min((request.arrival_ms for request in waiting), default=None)
        return 0.0 if oldest is None else self.now_ms - oldest

    def retry_after_s(self, tier: Tier, limit: int) -> int:
        return 1  # a trace does not come back

    def arrive(self, arrival: Arrival) -> SimRecord:
        exact = self.config.max_tokens == "exact"
        request = GenerationRequest(
            prompt=TokenPrompt(self._prompt_ids(arrival)),
            reply_to="sim",
            tier=arrival.tier,
            tenant=arrival.tenant,
            max_tokens=arrival.output_tokens if exact else self.workload.mix(arrival.tier).output_tokens[1],
            sampling=SamplingOptions(ignore_eos=exact),
        )
        self.now_ms = int(arrival.at_s * 1000)
        try:
            message = self.admitter.admit_tokens(request, request_id=f"r{arrival.index}", at_ms=self.now_ms)
        except OverloadedError:
            # Refused before any prediction: reported in the bucket its real length gives (as the
            # live load generator reports every request).
            bucket = self.admitter.config.buckets.of(arrival.prompt_tokens + arrival.output_tokens)
            return SimRecord(arrival, bucket, status="rejected")
        record = SimRecord(arrival, message.bucket)
        if self.keeper is not None:
            self.keeper.arrived(message.tier, message.tenant, message.prompt_token_ids)
        self.by_id[message.id] = _Request(arrival, message, record)
        self.scheduler.add(SchedRequest.of(message))
        return record

    def _prompt_ids(self, arrival: Arrival) -> list[int]:
        if arrival.session is not None:
            # A session's turns share their leading ids: turn k's prompt starts with turn k-1's.
            return sim_session_token_ids(arrival.session, arrival.prompt_tokens)
        first, self.next_prompt_id = self.next_prompt_id, self.next_prompt_id + arrival.prompt_tokens
        return list(range(first, self.next_prompt_id))

    # --- one round ------------------------------------------------------------------------------

    def view(self) -> EngineView:
        return engine_view(
            self.scheduler,
            max_running=self.max_running,
            kv_capacity_tokens=self.engine.kv_capacity_tokens,
            backlog={},
            step_ms=self.step.value_ms,
        )

    def schedule(self, now_ms: int) -> None:
        view = self.view()
        decision = self.scheduler.schedule(view, now_ms)
        if self.keeper is not None:
            for admitted in decision.admit:
                self.keeper.allocated(admitted.prompt_tokens)
            for touch in self.keeper.due(now_ms, free_kv_tokens=view.free_kv_tokens):
                self.touches[touch.id] = touch
                self._add(touch.id, touch.token_ids, 1, priority=TOUCH_PRIORITY)
        for admitted in decision.admit:
            request = self.by_id[admitted.id]
            life = RequestLifecycle(request.message, admitted, self.scheduler, reservations=self.reservations)
            if life.expired(now_ms):  # as the worker: its deadline passed before it could start
                request.record.status = "expired"
                request.record.queue_wait_ms = now_ms - request.arrival.at_s * 1000  # waited, then dropped
                self.scheduler.finish(admitted.id, admitted)
                del self.by_id[admitted.id]
                continue
            request.life = life
            self._start(request, life.next_call())
        for victim in decision.preempt:
            request = self.by_id[victim.id]
            if request.engine_id is not None:
                self.engine.abort(request.engine_id)
                del self.by_engine_id[request.engine_id]
                request.engine_id = None
            self.num_preempted += 1
            self._requeue(request)
        budget = self.budget.update(decision.token_budget)
        if budget is not None:
            self.engine.set_token_budget(budget)
        chunk = self.chunk.update(decision.prefill_chunk_tokens)
        if chunk is not None:
            self.scheduler.prefill_chunk_applied(self.engine.set_prefill_chunk(chunk))

    def _start(self, request: _Request, call: EngineCall) -> None:
        request.record.engine_calls += 1
        request.engine_id = call.engine_request_id
        self.by_engine_id[call.engine_request_id] = request
        assert request.life is not None
        self._add(
            call.engine_request_id,
            call.prompt_token_ids,
            call.sampling.max_tokens,
            priority=call.priority,
            stop_after=request.arrival.output_tokens - len(request.life.generated),
        )

    def _add(
        self, engine_id: str, token_ids: list[int], max_tokens: int, *, priority: int, stop_after: int | None = None
    ) -> None:
        self.engine.add(engine_id, token_ids, max_tokens, priority=priority, stop_after=stop_after)
        if self.step_log is not None:
            self.step_log.added(self.engine, engine_id, len(token_ids), priority)

    def _requeue(self, request: _Request, message: RequestMessage | None = None) -> None:
        """Back to the scheduler's queue as a continuation (a yield or a preemption)."""
        assert request.life is not None
        request.message = message or request.life.continuation()
        request.life = None
        self.scheduler.add(SchedRequest.of(request.message))

    # --- one step -------------------------------------------------------------------------------

    def after_step(self, step: StepResult, tokens_per_tier: dict[Tier, int] | None) -> None:
        """Hand out the step's tokens (counted per tier into ``tokens_per_tier`` when given)."""
        end_us = step.end_us
        self.step.observe(step.duration_us / 1000)
        for engine_id, num_cached in step.num_cached_tokens.items():
            touch = self.touches.pop(engine_id, None)
            if touch is not None and self.keeper is not None:
                self.keeper.touched(touch.id, num_cached)
                continue
            admitted = self.by_engine_id.get(engine_id)
            if admitted is not None and admitted.record.queue_wait_ms is None:
                admitted.record.queue_wait_ms = step.start_us / 1000 - admitted.arrival.at_s * 1000
                admitted.record.cached_prompt_tokens = num_cached
                self.scheduler.prompt_cached(admitted.message.id, num_cached)
        for engine_id, token_id in step.new_token_ids.items():
            request = self.by_engine_id.get(engine_id)
            if request is None or request.life is None:  # preempted after the step ran
                continue
            if tokens_per_tier is not None:
                tokens_per_tier[request.arrival.tier] += 1
            request.life.on_output([token_id], "", event=False)
            if request.record.ttft_ms is None:
                request.record.ttft_ms = end_us / 1000 - request.arrival.at_s * 1000
        for engine_id in step.finished:
            request = self.by_engine_id.pop(engine_id, None)
            if request is None:
                continue
            request.engine_id = None
            self._call_done(request, end_us)

    def _call_done(self, request: _Request, end_us: float) -> None:
        life = request.life
        assert life is not None
        # The engine stops a request at its slice limit ("length") or where the trace says the model
        # ends its reply (an end-of-sequence, "stop").
        reason = "stop" if len(life.generated) >= request.arrival.output_tokens else "length"
        if self.keeper is not None:
            self.keeper.allocated(life.call_tokens)
        outcome = life.end_call(reason, self.view)
        if isinstance(outcome, Finished):
            request.record.e2e_ms = end_us / 1000 - request.arrival.at_s * 1000
            request.record.output_tokens = len(life.generated)
            if self.keeper is not None:
                self.keeper.finished(
                    life.id,
                    request.arrival.tier,
                    request.arrival.tenant,
                    life.message.prompt_token_ids,
                    life.generated,
                    int(end_us / 1000),
                )
            self.scheduler.finish(life.id)
            del self.by_id[life.id]
            self.admitter.observe(life.message, len(life.generated))
        elif isinstance(outcome, Continue):
            self._start(request, outcome.call)
        else:
            self.num_yielded += 1
            self._requeue(request, outcome.message)


def simulate(
    trace: list[Arrival],
    workload: Workload,
    config: SimConfig,
    *,
    duration_s: float,
    api: AdmissionSettings | None = None,
    on_progress: Callable[[float], None] | None = None,
    step_log: StepLog | None = None,
) -> SimRun:
    """Run ``trace`` through ``config`` on the virtual clock until every request finished or
    ``config.drain_s`` after the last arrival; what is still queued then is ``unfinished``.
    ``api``: the buckets and deadlines of a live API to mirror (default admission's own); shedding
    comes from ``config.shed``; ``step_log``: where the engine's steps are written (left open)."""
    driver = _Driver(workload, config, api.admission_config() if api is not None else AdmissionConfig(), step_log)
    engine = driver.engine
    records: list[SimRecord] = []
    window_tokens = dict.fromkeys(TIERS, 0)
    kv = KvSample()
    pending = deque(trace)
    last_arrival_s = trace[-1].at_s if trace else 0.0
    stop_us = (max(last_arrival_s, duration_s) + config.drain_s) * 1e6
    window_end_us = duration_s * 1e6
    num_steps = 0
    num_engine_preempted = 0
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
        if not driver.by_id and not engine.num_unfinished():  # (the engine may hold only touches)
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
        num_engine_preempted += len(step.preempted)
        if step_log is not None:
            step_log.stepped(engine, step)
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
        request.record.output_tokens = len(
            request.life.generated if request.life else request.message.generated_token_ids
        )
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
        num_engine_preempted=num_engine_preempted,
        reservations=driver.reservations,
        prefill_chunk_tokens=driver.chunk.applied,
        keep_alive=driver.keeper.stats if driver.keeper is not None else None,
    )


# --- capacity and the physical floor ----------------------------------------------------------------


def fifo_capacity_rps(
    workload: Workload,
    cost: CostModel,
    *,
    seed: int,
    num_requests: int = CAPACITY_REQUESTS,
    base: SimConfig | None = None,
) -> float:
    """Saturation request rate of ``fifo``: everything arrives at once, completions per second
    between the 10% and 90% marks (leaving out the ramp-up and the draining tail).

    A workload with multi-turn sessions is measured without the prefix cache. Sent at once, a later
    turn finds its earlier prompt in the cache far more often than in an open-loop trace near that
    rate, where the turn gap leaves the LRU time to evict it (long-history: 62% of the realtime prompt
    tokens hit in the saturation run, about 1% under fifo at 90%), so with the cache the measurement
    overstated the rate fifo sustains (long-history: 61.6 against 55.9 req/s)."""
    config = base or SimConfig(policy="fifo", cost=cost)
    config = SimConfig(
        policy="fifo",
        cost=cost,
        kv_capacity_tokens=config.kv_capacity_tokens,
        block_size=config.block_size,
        prefix_cache=config.prefix_cache and not any(mix.sessions for mix in workload.tiers),
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
    so ``T = base + c_p·rate·T·P̄ + c_d·rate·T·Ō``, P̄ the prompt tokens a prefill computes with each
    session's previous prompt in the prefix cache. Infinite when the work alone fills every step."""
    load = rate_rps * (
        cost.prefill_token_us * workload.mean_uncached_prompt_tokens + cost.decode_seq_us * workload.mean_output_tokens
    )
    load /= 1e6
    return math.inf if load >= 1 else cost.base_us / (1 - load)


def floor_e2e_ms(workload: Workload, cost: CostModel, rate_rps: float, tier: Tier, *, quantile: float = 0.99) -> float:
    """Physical floor of a tier's E2E at the given quantile of its reply length: one step that
    prefills the prompt, then one decode step per further token, every step at least the mean step
    the offered load requires (WORKLOADS.md "What physics allows"). The reply length is the tier's at
    that quantile (linear between uniform bounds); the prefill is the tier's longest, with a session's
    previous prompt served from the prefix cache."""
    return floor_at_step_ms(workload.mix(tier), cost, mean_step_us(workload, cost, rate_rps), quantile=quantile)


def floor_at_step_ms(mix: TierMix, cost: CostModel, step_us: float, *, quantile: float = 0.99) -> float:
    """``floor_e2e_ms`` with every step at least ``step_us`` (the mean step some other work requires)."""
    prefill_us = max(step_us, cost.step_us(mix.max_uncached_prompt_tokens, 0))
    return (prefill_us + (mix.output_tokens_at(quantile) - 1) * step_us) / 1000
