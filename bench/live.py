"""``tailcut bench live``: ``fifo`` and ``tailcut`` through the real pipeline with the SIMULATOR engine in
real time, beside the same trace on the virtual clock.

The virtual-clock runs (``bench.simrun``) say what each policy does under the cost model; this asks
whether the live pipeline (API, Redis, the worker's scheduling loop, the ``sim`` engine stepping in real
time, ``workers.engines.sim_live``) does the same. Both sides see one trace: the seeded Poisson trace at
``load`` × fifo capacity, its offsets multiplied by ``time_scale`` for the live side (same requests, same
order). Each policy gets a fresh stack (a private redis-server, the API and one worker as subprocesses)
configured from the very ``SimConfig`` the virtual run uses, every time-based setting (deadlines, slack
margin) multiplied by ``time_scale``. Client-measured times are divided by ``time_scale`` back into
simulated time, and the ratios tailcut / fifo of both sides are compared.

A ratio of P99s over a 20-second trace rests on a handful of requests, and which engine step a burst
of them lands in moves it by ±10% on the virtual clock alone; the live pipeline hands each request to
the engine a fraction of a simulated ms after its offset, so it runs one more such phase. The virtual
side is therefore also replayed ``REPLAYS`` times with every arrival moved by up to ``REPLAY_JITTER_MS``,
and each live ratio is judged against the drawn trace's and against the replays' median. Both clocks
write their engine's steps (``workers.engines.steplog``) beside the logs, to find where they part.

The comparison only means something if the pipeline keeps up: the worker's log says how far the engine
ran behind its schedule (``sim_behind``, ``sim_stopped``), the client's send lag whether the load
generator kept the trace's offsets, and each process's CPU time who used the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from api.settings import ApiSettings
from bench.cpu import cpu_seconds, machine_cpu, self_cpu_seconds
from bench.live_compare import (
    LIVE_POLICIES,
    REPLAY_JITTER_MS,
    REPLAYS,
    LivePolicy,
    LiveReport,
    LiveSetup,
    PolicyResult,
    Side,
    ratio_checks,
    side,
)
from bench.live_records import (
    jittered,
    read_worker_log,
    stalled_first_tokens,
    stretch,
    to_simulated,
    tokens_before,
    watching_stalls,
)
from bench.live_report import print_report, write
from bench.loadgen import run_open_loop
from bench.policies import Job, records_of, variants
from bench.simrun import SimConfig, fifo_capacity_rps, simulate
from bench.stack import tailcut_stack
from bench.stats import summarize
from bench.workloads import Arrival, poisson_trace
from queues.keys import TIERS
from tailcut.errors import FatalError
from tailcut.models import max_model_len, served_name
from workers.breakers import BreakerConfig
from workers.degrade import DegradeConfig
from workers.engines.steplog import StepLog

# The live run is bounded at the virtual run's length in real time, times this, plus the extra.
TIMEOUT_FACTOR = 1.5
TIMEOUT_EXTRA_S = 30.0
READY_TIMEOUT_S = 600.0


def sim_config(policy: LivePolicy, setup: LiveSetup, rate_rps: float) -> SimConfig:
    """The virtual run's configuration: ``bench.policies``' variant of that name."""
    variant = next(variant for variant in variants() if variant.label == policy)
    return Job(variant, setup.load, rate_rps, setup.seed, setup.duration_s, setup.workload, setup.cost).config()


def steps_path(setup: LiveSetup, policy: LivePolicy, clock: str) -> Path:
    """Where one side's engine steps go (``workers.engines.steplog``): ``clock`` ``virtual`` or ``live``."""
    return setup.log_dir / f"{policy}-{clock}-steps.jsonl"


def run_virtual(
    policy: LivePolicy,
    trace: list[Arrival],
    setup: LiveSetup,
    rate_rps: float,
    api: ApiSettings,
    *,
    steps: Path | None = None,
) -> Side:
    """``policy`` on the virtual clock; ``steps``: write the engine's steps there."""
    step_log = StepLog(steps) if steps is not None else None
    try:
        config = sim_config(policy, setup, rate_rps)
        run = simulate(trace, setup.workload, config, duration_s=setup.duration_s, api=api, step_log=step_log)
    finally:
        if step_log is not None:
            step_log.close()
    stats = {
        "engine_steps": run.num_steps,
        "preempted": run.num_preempted,
        "yielded": run.num_yielded,
        "max_running": run.kv.max_running,
    }
    return side(
        records_of(run),
        end_s=run.end_s,
        background_tokens=run.window_output_tokens["background"],
        setup=setup,
        rate_rps=rate_rps,
        stats=stats,
    )


# A realtime latency no live run reaches (the realtime breaker's threshold there: it never trips).
NEVER_SLOW_MS = 2**31 - 1


def worker_env(config: SimConfig, time_scale: float) -> dict[str, str]:
    """The live worker's settings from the virtual run's ``SimConfig`` (as ``bench.simrun._Driver``
    builds its engine and scheduler from it): the same engine, the same scheduler, time-based settings
    multiplied by ``time_scale``, and a read-ahead of ``max_num_seqs`` so the worker holds every
    waiting request as the simulator's scheduler does."""
    scheduler, budget = config.scheduler, config.scheduler.budget
    threshold = config.long_prefill_token_threshold if config.policy == "tailcut" else 0
    engine = {
        "KIND": "sim",
        "SIM_PROFILE": config.cost.name,
        "SIM_TIME_SCALE": repr(time_scale),
        "SIM_KV_CAPACITY_TOKENS": config.kv_capacity_tokens,
        "BLOCK_SIZE": config.block_size,
        "MAX_NUM_SEQS": config.max_num_seqs,
        "MAX_NUM_BATCHED_TOKENS": config.max_num_batched_tokens,
        "ENABLE_PREFIX_CACHING": str(config.prefix_cache).lower(),
        "LONG_PREFILL_TOKEN_THRESHOLD": threshold,
    }
    sched = {
        "POLICY": config.policy,
        "PREFETCH": config.max_num_seqs,
        "BUDGET_RULE": budget.rule,
        "MIN_BUDGET_TOKENS": budget.min_tokens,
        "MAX_BUDGET_TOKENS": budget.max_tokens,
        "TOKENS_PER_SHORT": budget.tokens_per_short,
        "SLACK_MARGIN_MS": round(budget.slack_margin_ms * time_scale),
        "REALTIME_RESERVE_TOKENS": scheduler.realtime_reserve_tokens,
        "MAX_CUT_INS": scheduler.max_cut_ins,
        "SLICE_TOKENS": scheduler.slice_tokens,
        "FAIR_QUANTUM_TOKENS": scheduler.fair_quantum_tokens,
        "FAIR_MIN_WEIGHT": repr(scheduler.fair_min_weight),
        "FAIR_MAX_WEIGHT": repr(scheduler.fair_max_weight),
        # The scheduler's clock-based sizes follow the stretched clock too: a window of 5 real s would
        # average over 5 / time_scale simulated s, and a backlog drained "in 20 s" would take 16 times
        # the room at ×16; the usual step time the slow-step rule compares with is averaged over as long in
        # simulated time (a reply's life is counted in steps, stretched already). The prefix keep-alive
        # keeps a turn for as long in simulated time, and touches it as often (its period's floor and the
        # windows of the allocation rate it is estimated from).
        "TRAFFIC_WINDOW_MS": round(scheduler.traffic_window_ms * time_scale),
        "BACKLOG_DRAIN_MS": round(scheduler.backlog_drain_ms * time_scale),
        "SLOW_STEP_WINDOW_MS": round(scheduler.slow_step_window_ms * time_scale),
        "KEEP_ALIVE_TTL_S": repr(scheduler.keep_alive.ttl_ms / 1000 * time_scale),
        "KEEP_ALIVE_MIN_PERIOD_MS": round(scheduler.keep_alive.min_period_ms * time_scale),
        "KEEP_ALIVE_ALLOCATION_WINDOWS_MS": orjson.dumps(
            [round(window_ms * time_scale) for window_ms in scheduler.keep_alive.allocation_windows_ms]
        ).decode(),
    }
    # The breakers and the heartbeat fallback judge latencies in real time: at their own thresholds a
    # pipeline slowed ×time_scale would trip them all the time (the heartbeat ends replies with
    # summaries), which the virtual run, which has neither, never does. Their thresholds and windows
    # are stretched alike. The realtime breaker cannot trip at all: open, it caps realtime replies and
    # holds background back for REALTIME_OPEN_S, which the simulator does not model, and at its default
    # 800 ms it trips on bursts of 64-token realtime replies at 90% load (their floor there is about
    # 0.9 s): the live run would then measure the breaker, not the scheduling policy both sides run.
    breakers, degrade = BreakerConfig(), DegradeConfig()
    scaled_breakers = {
        "REALTIME_OVER_MS": NEVER_SLOW_MS,
        "REALTIME_OPEN_S": repr(breakers.realtime_open_s * time_scale),
        "NORMAL_P99_MS": round(breakers.normal_p99_ms * time_scale),
        "NORMAL_WINDOW_S": repr(breakers.normal_window_s * time_scale),
        "BACKGROUND_P99_MS": round(breakers.background_p99_ms * time_scale),
        "BACKGROUND_WINDOW_S": repr(breakers.background_window_s * time_scale),
        "EVALUATE_INTERVAL_S": repr(breakers.evaluate_interval_s * time_scale),
    }
    scaled_degrade = {
        "REALTIME_HEARTBEAT_MS": round(degrade.realtime_heartbeat_ms * time_scale),
        "NORMAL_HEARTBEAT_MS": round(degrade.normal_heartbeat_ms * time_scale),
        "BACKGROUND_HEARTBEAT_MS": round(degrade.background_heartbeat_ms * time_scale),
    }
    env = {f"TAILCUT_ENGINE__{name}": str(value) for name, value in engine.items()}
    env |= {f"TAILCUT_SCHEDULER__{name}": str(value) for name, value in sched.items()}
    env |= {f"TAILCUT_BREAKERS__{name}": str(value) for name, value in scaled_breakers.items()}
    env |= {f"TAILCUT_DEGRADE__{name}": str(value) for name, value in scaled_degrade.items()}
    env["TAILCUT_MAX_RUNNING"] = str(config.max_num_seqs)
    return env


def api_env(config: SimConfig, api: ApiSettings, time_scale: float) -> dict[str, str]:
    """The live API's settings: the virtual run's buckets and shedding bounds (none for fifo, as the
    simulator's fifo), deadlines multiplied by ``time_scale`` so nothing expires that would not on the
    virtual clock."""
    env = {
        f"TAILCUT_{tier.upper()}_DEADLINE_S": repr(api.admission_config().deadlines.of(tier) * time_scale)
        for tier in TIERS
    }
    env |= {
        f"TAILCUT_SHED_{tier.upper()}_WAITING": str(config.shed.limit(tier) if config.shed else 0) for tier in TIERS
    }
    env["TAILCUT_SHORT_MAX_TOKENS"] = str(api.short_max_tokens)
    env["TAILCUT_LONG_MIN_TOKENS"] = str(api.long_min_tokens)
    return env


def run_live(
    policy: LivePolicy, trace: list[Arrival], setup: LiveSetup, rate_rps: float, api: ApiSettings, timeout_s: float
) -> Side:
    """One policy through a fresh stack (private redis-server, API, one ``sim`` worker), the trace sent
    open loop in real time, everything stopped in reverse order before the worker's log is read."""
    config = sim_config(policy, setup, rate_rps)
    setup.log_dir.mkdir(parents=True, exist_ok=True)
    real_trace = stretch(trace, setup.time_scale)
    env = {"TAILCUT_LOG_FORMAT": "json"}
    if setup.workload.max_request_tokens > max_model_len(setup.model_dir):
        env["TAILCUT_MAX_MODEL_LEN"] = str(setup.workload.max_request_tokens)
    with contextlib.ExitStack() as stop:
        try:
            stack = stop.enter_context(
                tailcut_stack(
                    setup.model_dir,
                    setup.log_dir,
                    env=env,
                    worker_env=worker_env(config, setup.time_scale)
                    | {"TAILCUT_ENGINE__SIM_STEP_LOG": str(steps_path(setup, policy, "live"))},
                    api_env=api_env(config, api, setup.time_scale),
                    log_tag=policy,
                    ready_timeout_s=READY_TIMEOUT_S,
                )
            )
        except FatalError as exc:
            raise FatalError(f"{policy}: {exc.message}") from exc
        worker_log, api_log = stack.log_path("worker"), stack.log_path("api")
        cpu_before = {name: cpu_seconds(pid) for name, pid in stack.pids.items()} | {"client": self_cpu_seconds()}
        machine_before = machine_cpu()
        load = run_open_loop(
            stack.url,
            served_name(setup.model_dir, None),
            real_trace,
            timeout_s=timeout_s,
            show_progress=setup.show_progress,
        )
        result, client_stalls = asyncio.run(watching_stalls(load))
        cpu_after = {name: cpu_seconds(pid) for name, pid in stack.pids.items()} | {"client": self_cpu_seconds()}
        machine_after = machine_cpu()
    cpu_s = {
        name: after - before
        for name, before in cpu_before.items()
        if before is not None and (after := cpu_after[name]) is not None
    }
    machine: dict[str, float] = {}
    if machine_before is not None and machine_after is not None:
        busy_s = machine_after.busy_s - machine_before.busy_s
        # Busy share of every core, the CPU that processes other than this run's used meanwhile (another
        # benchmark on a shared machine disturbs the real-time run), and the share of the time some
        # runnable task waited for a core.
        machine = {
            "busy_share": busy_s / (machine_after.total_s - machine_before.total_s),
            "others_cpu_s": busy_s - sum(cpu_s.values()),
            "cpu_pressure_share": (machine_after.waited_s - machine_before.waited_s) / result.duration_s,
        }
    sent = {arrival.index: arrival.at_s for arrival in real_trace}
    send_lag = summarize(
        [
            (record.sent_s - sent[record.index]) * 1000
            for record in result.records
            if record.error != "timeout (not sent)"
        ]
    )
    records = [to_simulated(record, setup.time_scale) for record in result.records]
    window_s = setup.duration_s
    assert worker_log is not None
    worker_read = read_worker_log(worker_log)
    client_ms = [r.e2e_ms for r in result.records if r.tier == "realtime" and r.status == "ok" and r.e2e_ms is not None]
    client_mean_ms = sum(client_ms) / len(client_ms) if client_ms else None
    worker_mean_ms = worker_read["realtime_enqueue_to_final_mean_ms"]
    stats = {
        "wall_s": result.duration_s,
        "timeout_s": timeout_s,
        "worker": worker_read,
        # Realtime E2E in real ms, mean: at the client, and from the API's enqueue to the worker's final
        # token; the difference is the API's intake and the way back (Redis, API, SSE, client).
        "realtime_e2e_mean_real_ms": {
            "client": client_mean_ms,
            "worker": worker_mean_ms,
            "outside_worker": None
            if client_mean_ms is None or worker_mean_ms is None
            else client_mean_ms - worker_mean_ms,
        },
        "worker_log": str(worker_log),
        "api_log": str(api_log),
        "send_lag_ms": None if send_lag is None else asdict(send_lag),  # real ms
        "cpu_s": cpu_s,
        "cpu_share_of_one_core": {name: value / result.duration_s for name, value in cpu_s.items()},
        "cpu_share_of_machine": sum(cpu_s.values()) / (result.duration_s * (os.cpu_count() or 1)),
        "machine": machine,
        "errors": dict(Counter(record.error for record in records if record.error)),
        "client_stalls": {
            "count": len(client_stalls),
            "total_ms": sum(late_ms for _at_s, late_ms in client_stalls),
            "max_ms": max((late_ms for _at_s, late_ms in client_stalls), default=0.0),
            "at_s_late_ms": [(round(at_s, 3), round(late_ms, 1)) for at_s, late_ms in client_stalls],
            # Requests whose first token the client awaited during a stall: their TTFT is inflated.
            "first_token_awaited": sorted(stalled_first_tokens(result.records, client_stalls)),
        },
    }
    background = sum(tokens_before(record, window_s) for record in records if record.tier == "background")
    return side(
        records,
        end_s=result.duration_s / setup.time_scale,
        background_tokens=background,
        setup=setup,
        rate_rps=rate_rps,
        stats=stats,
    )


# --- the whole comparison --------------------------------------------------------------------------


def run(setup: LiveSetup, *, on_status: Callable[[str], None] | None = None) -> LiveReport:
    """fifo's capacity, the trace, every policy on the virtual clock, then every policy live."""
    started = time.perf_counter()
    say = on_status or (lambda _line: None)
    say("measuring fifo capacity on the virtual clock")
    capacity = fifo_capacity_rps(setup.workload, setup.cost, seed=setup.seed)
    rate = setup.load * capacity
    trace = poisson_trace(setup.workload, rate, seed=setup.seed, duration_s=setup.duration_s)
    api = ApiSettings()
    virtual = {
        policy: run_virtual(policy, trace, setup, rate, api, steps=steps_path(setup, policy, "virtual"))
        for policy in setup.policies
    }
    replays: list[dict[LivePolicy, Side]] = []
    if set(LIVE_POLICIES) <= set(setup.policies):
        say(f"replaying the trace {REPLAYS} times on the virtual clock, arrivals up to {REPLAY_JITTER_MS:g} ms later")
        for seed in range(1, REPLAYS + 1):
            moved = jittered(trace, REPLAY_JITTER_MS, seed)
            replays.append({policy: run_virtual(policy, moved, setup, rate, api) for policy in LIVE_POLICIES})
    timeout_s = max(side.end_s for side in virtual.values()) * setup.time_scale * TIMEOUT_FACTOR + TIMEOUT_EXTRA_S
    results = []
    for policy in setup.policies:
        expected_s = virtual[policy].end_s * setup.time_scale
        say(f"{policy}: {len(trace)} requests live, about {expected_s:.0f} s (bound {timeout_s:.0f} s)")
        live = run_live(policy, trace, setup, rate, api, timeout_s)
        results.append(PolicyResult(policy, live, virtual[policy]))
    checks = ratio_checks(results, replays)
    return LiveReport(setup, capacity, rate, len(trace), results, checks, time.perf_counter() - started)


def command(args: Any) -> None:
    """``tailcut bench live`` (arguments from ``bench.cli``)."""
    import tempfile

    from bench.workloads import require_realtime, workload_and_cost
    from tailcut.models import prepare_tiny
    from tailcut.settings import CommonSettings

    workload, cost = workload_and_cost(args.workload, args.cost_model)
    require_realtime(workload, "tailcut bench live")
    names = tuple(name.strip() for name in args.policies.split(",") if name.strip())
    if not names or any(name not in LIVE_POLICIES for name in names) or len(set(names)) != len(names):
        raise FatalError(f"--policies must name some of {', '.join(LIVE_POLICIES)} once each, got {args.policies!r}")
    policies: tuple[LivePolicy, ...] = tuple(name for name in LIVE_POLICIES if name in names)
    if args.load <= 0 or args.duration <= 0 or args.time_scale <= 0:
        raise FatalError("--load, --duration and --time-scale must be positive")
    console = Console(width=None if sys.stdout.isatty() else 160)
    # The tiny model's tokenizer serves the API; no model runs.
    model_dir = Path(args.model) if args.model else prepare_tiny(CommonSettings().cache_dir, console.log)
    log_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tailcut-live-logs-"))
    setup = LiveSetup(
        workload=workload,
        cost=cost,
        load=args.load,
        duration_s=args.duration,
        time_scale=args.time_scale,
        seed=args.seed,
        policies=policies,
        model_dir=model_dir,
        log_dir=log_dir,
        show_progress=True,
    )
    report = run(setup, on_status=console.log)
    print_report(console, report)
    console.print(f"worker and API logs in {log_dir}")
    if args.out:
        written = write(report, Path(args.out))
        console.print("wrote " + ", ".join(str(path) for path in written))
