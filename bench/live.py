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

The comparison only means something if the pipeline keeps up: the worker's log says how far the engine
ran behind its schedule (``sim_behind``, ``sim_stopped``), the client's send lag whether the load
generator kept the trace's offsets, and each process's CPU time who used the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal

import orjson
import redis
from rich.console import Console
from rich.table import Table

from api.settings import ApiSettings
from bench.loadgen import LoadResult, run_open_loop
from bench.policies import Job, records_of, variants
from bench.simrun import SimConfig, fifo_capacity_rps, floor_e2e_ms, simulate
from bench.stats import RequestRecord, Summary, attainment, summarize
from bench.workloads import Arrival, Workload, poisson_trace
from queues.keys import TIERS, Tier
from tailcut.errors import ConfigError
from tailcut.models import max_model_len, served_name
from tailcut.up import free_port, private_redis, stop_process, wait_ready
from workers.engines.costmodel import CostModel

LivePolicy = Literal["fifo", "tailcut"]
LIVE_POLICIES: tuple[LivePolicy, ...] = ("fifo", "tailcut")
# Live and virtual ratios agree when |live / virtual − 1| is at most this.
AGREEMENT_TOLERANCE = 0.25
NOTE = "SIMULATOR engine in real time ×{scale:g} (live pipeline) vs the virtual clock; cost model {cost}"
# The live run is bounded at the virtual run's length in real time, times this, plus the extra.
TIMEOUT_FACTOR = 1.5
TIMEOUT_EXTRA_S = 30.0
Metric = Literal["ttft_ms", "e2e_ms"]
# The load generator's event loop is probed this often; a probe this late (real ms) is a stall.
STALL_PROBE_S = 0.01
STALL_MS = 20.0
# Processes whose CPU time a live run reports ("client": this process, the load generator).
CPU_NAMES = ("api", "worker", "redis", "client")


@dataclass(frozen=True, slots=True)
class LiveSetup:
    workload: Workload
    cost: CostModel
    load: float  # share of fifo's capacity
    duration_s: float  # simulated seconds of arrivals
    time_scale: float
    seed: int
    policies: tuple[LivePolicy, ...]
    model_dir: Path  # its tokenizer serves the API; the sim engine runs no model
    log_dir: Path  # the API's and the worker's logs go here
    show_progress: bool = False


# --- pure parts ------------------------------------------------------------------------------------


def stretch(trace: Sequence[Arrival], time_scale: float) -> list[Arrival]:
    """The same requests in the same order, every offset multiplied by ``time_scale`` (real seconds)."""
    return [replace(arrival, at_s=arrival.at_s * time_scale) for arrival in trace]


def to_simulated(record: RequestRecord, time_scale: float) -> RequestRecord:
    """A record measured in real time with every time divided by ``time_scale``: simulated time."""

    def scaled(value: float | None) -> float | None:
        return None if value is None else value / time_scale

    return replace(
        record,
        sent_s=record.sent_s / time_scale,
        ttft_ms=scaled(record.ttft_ms),
        e2e_ms=scaled(record.e2e_ms),
        tpot_ms=scaled(record.tpot_ms),
        gaps_ms=[gap / time_scale for gap in record.gaps_ms],
    )


def tokens_before(record: RequestRecord, window_s: float) -> float:
    """Output tokens of ``record`` received before ``window_s`` from the run's start. Chunk times are
    rebuilt from the send time, the TTFT and the gaps; a chunk carrying several tokens (deltas merge
    when a consumer lags) counts its share of the request's total."""
    if record.ttft_ms is None or not record.output_tokens:
        return 0.0
    at_s = record.sent_s + record.ttft_ms / 1000
    num_inside = int(at_s < window_s)
    for gap_ms in record.gaps_ms:
        at_s += gap_ms / 1000
        num_inside += at_s < window_s
    return record.output_tokens * num_inside / (len(record.gaps_ms) + 1)


def agrees(live: float, virtual: float, tolerance: float = AGREEMENT_TOLERANCE) -> bool:
    """Whether a live ratio agrees with the virtual one: |live / virtual − 1| ≤ ``tolerance``."""
    if virtual == 0:
        return live == 0
    return abs(live / virtual - 1) <= tolerance


def latencies_ms(records: Iterable[RequestRecord], metric: Metric, end_s: float) -> list[float]:
    """``metric`` of every request that was not shed; one that never got there counts at its time so far
    (run end − send), a lower bound, as ``bench.policies.run_job`` counts it."""
    values = []
    for record in records:
        value = getattr(record, metric)
        if value is not None:
            values.append(value)
        elif record.status != "rejected":
            values.append((end_s - record.sent_s) * 1000)
    return values


def paired_delta_ms(
    live: Sequence[RequestRecord], virtual: Sequence[RequestRecord], metric: Metric, tier: Tier
) -> Summary | None:
    """Live minus virtual ``metric`` of the same requests (one trace: same index, same request)."""
    by_index = {record.index: record for record in virtual}
    deltas = []
    for record in live:
        twin = by_index.get(record.index)
        mine, theirs = getattr(record, metric), getattr(twin, metric, None)
        if record.tier == tier and mine is not None and theirs is not None:
            deltas.append(mine - theirs)
    return summarize(deltas)


def stalled_first_tokens(records: Iterable[RequestRecord], stalls: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the requests (real-time records) whose first token the client awaited while its event
    loop stalled: a stall at ``at_s``, ``late_ms`` late, blocked it from ``at_s`` for the probe interval
    plus ``late_ms``."""
    blocked = [(at_s, at_s + STALL_PROBE_S + late_ms / 1000) for at_s, late_ms in stalls]
    return {
        record.index
        for record in records
        if record.ttft_ms is not None
        and any(start < record.sent_s + record.ttft_ms / 1000 and record.sent_s < end for start, end in blocked)
    }


def read_worker_log(path: Path) -> dict[str, Any]:
    """What the worker's JSON log says about the engine keeping its schedule, its request outcomes, and
    the mean real time a realtime request spent from the API's enqueue to its final token at the worker."""
    behind_shares: list[float] = []
    realtime_ms: list[float] = []
    stopped: dict[str, Any] = {}
    outcomes: Counter[str] = Counter()
    num_problems = 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            body = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(body, dict):
            continue
        event = str(body.get("event", ""))
        num_problems += body.get("level") in ("warning", "error", "critical")
        if event == "sim_behind":
            behind_shares.append(float(body.get("behind_share", 0.0)))
        elif event == "sim_stopped":
            stopped = body
        elif event.startswith("request_"):
            outcomes[event.removeprefix("request_")] += 1
            if event == "request_final" and body.get("tier") == "realtime":
                realtime_ms.append(float(body.get("wait_ms", 0)) + float(body.get("run_ms", 0)))
    return {
        "sim_behind_warnings": len(behind_shares),
        "max_behind_share": max(behind_shares, default=0.0),
        "behind_ms": stopped.get("behind_ms"),
        "engine_steps": stopped.get("steps"),
        "engine_virtual_s": stopped.get("virtual_s"),
        "outcomes": dict(outcomes),
        "warnings": num_problems,
        "realtime_enqueue_to_final_mean_ms": sum(realtime_ms) / len(realtime_ms) if realtime_ms else None,
    }


# --- one side of one policy ------------------------------------------------------------------------


@dataclass(slots=True)
class Side:
    """One policy's run on one clock, every time in simulated time."""

    records: list[RequestRecord]
    end_s: float  # when the run ended (the last request finished, or the bound)
    background_tokens: float  # background output tokens within the arrival window
    metrics: dict[str, Any]
    stats: dict[str, Any]


def side(
    records: list[RequestRecord],
    *,
    end_s: float,
    background_tokens: float,
    setup: LiveSetup,
    rate_rps: float,
    stats: dict[str, Any],
) -> Side:
    metrics: dict[str, Any] = {}
    for tier in TIERS:
        mine = [record for record in records if record.tier == tier]
        if not mine:
            continue
        ttft = summarize(latencies_ms(mine, "ttft_ms", end_s))
        e2e = summarize(latencies_ms(mine, "e2e_ms", end_s))
        metrics[tier] = {
            "requests": len(mine),
            "ok": sum(record.status == "ok" for record in mine),
            "rejected": sum(record.status == "rejected" for record in mine),
            "errors": sum(record.status == "error" for record in mine),
            "p50_ttft_ms": _p(ttft, "p50"),
            "p90_ttft_ms": _p(ttft, "p90"),
            "p99_ttft_ms": _p(ttft, "p99"),
            "p50_e2e_ms": _p(e2e, "p50"),
            "p99_e2e_ms": _p(e2e, "p99"),
            "max_e2e_ms": _p(e2e, "max"),
            "floor_e2e_ms": floor_e2e_ms(setup.workload, setup.cost, rate_rps, tier),
            "attainment": attainment(mine, setup.workload.mix(tier).slo),
        }
    metrics["background_tokens_per_s"] = background_tokens / setup.duration_s
    return Side(records, end_s, background_tokens, metrics, stats)


def _p(summary: Summary | None, name: str) -> float | None:
    return None if summary is None else float(getattr(summary, name))


def sim_config(policy: LivePolicy, setup: LiveSetup, rate_rps: float) -> SimConfig:
    """The virtual run's configuration: ``bench.policies``' variant of that name."""
    variant = next(variant for variant in variants() if variant.label == policy)
    return Job(variant, setup.load, rate_rps, setup.seed, setup.duration_s, setup.workload, setup.cost).config()


def run_virtual(policy: LivePolicy, trace: list[Arrival], setup: LiveSetup, rate_rps: float, api: ApiSettings) -> Side:
    run = simulate(trace, setup.workload, sim_config(policy, setup, rate_rps), duration_s=setup.duration_s, api=api)
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
    }
    env = {f"TAILCUT_ENGINE__{name}": str(value) for name, value in engine.items()}
    env |= {f"TAILCUT_SCHEDULER__{name}": str(value) for name, value in sched.items()}
    env["TAILCUT_MAX_RUNNING"] = str(config.max_num_seqs)
    return env


def api_env(config: SimConfig, api: ApiSettings, time_scale: float) -> dict[str, str]:
    """The live API's settings: the virtual run's buckets and shedding bounds (none for fifo, as the
    simulator's fifo), deadlines multiplied by ``time_scale`` so nothing expires that would not on the
    virtual clock."""
    env = {f"TAILCUT_{tier.upper()}_DEADLINE_S": repr(api.deadline_s(tier) * time_scale) for tier in TIERS}
    env |= {
        f"TAILCUT_SHED_{tier.upper()}_WAITING": str(config.shed.limit(tier) if config.shed else 0) for tier in TIERS
    }
    env["TAILCUT_SHORT_MAX_TOKENS"] = str(api.short_max_tokens)
    env["TAILCUT_LONG_MIN_TOKENS"] = str(api.long_min_tokens)
    return env


def _spawn(command: str, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tailcut", command],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``), None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu_s(url: str) -> float | None:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        info: dict[str, Any] = client.info("cpu")  # type: ignore[assignment]
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _machine_cpu_s() -> tuple[float, float, float] | None:
    """CPU seconds of the whole machine so far (Linux): busy and total over all cores (``/proc/stat``),
    and the time some runnable task waited for a core (pressure stall information, 0 without it)."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    ticks = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    waited_s = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        some = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        waited_s = int(some.rsplit("total=", 1)[1]) / 1e6
    return busy / ticks, (busy + idle + iowait) / ticks, waited_s


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _watching_stalls(load: Awaitable[LoadResult]) -> tuple[LoadResult, list[tuple[float, float]]]:
    """Run the load generator while watching its event loop: every probe woken more than
    ``STALL_MS`` late is a client stall (seconds from the start, real ms late). A stalled client reads
    chunks late, which inflates the latencies it measures."""
    stalls: list[tuple[float, float]] = []

    async def watch() -> None:
        origin = time.perf_counter()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(STALL_PROBE_S)
            late_ms = (time.perf_counter() - before - STALL_PROBE_S) * 1000
            if late_ms > STALL_MS:
                stalls.append((before - origin, late_ms))

    watcher = asyncio.create_task(watch())
    try:
        return await load, stalls
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def run_live(
    policy: LivePolicy, trace: list[Arrival], setup: LiveSetup, rate_rps: float, api: ApiSettings, timeout_s: float
) -> Side:
    """One policy through a fresh stack (private redis-server, API, one ``sim`` worker), the trace sent
    open loop in real time, everything stopped in reverse order before the worker's log is read."""
    config = sim_config(policy, setup, rate_rps)
    worker_log, api_log = setup.log_dir / f"worker-{policy}.log", setup.log_dir / f"api-{policy}.log"
    setup.log_dir.mkdir(parents=True, exist_ok=True)
    real_trace = stretch(trace, setup.time_scale)
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(private_redis())
        port = free_port()
        env = {**os.environ, "TAILCUT_REDIS_URL": redis_url, "TAILCUT_MODEL": str(setup.model_dir)}
        env["TAILCUT_LOG_FORMAT"] = "json"
        if setup.workload.max_request_tokens > max_model_len(setup.model_dir):
            env["TAILCUT_MAX_MODEL_LEN"] = str(setup.workload.max_request_tokens)
        worker = _spawn(
            "worker", env | worker_env(config, setup.time_scale), stack.enter_context(worker_log.open("wb"))
        )
        stack.callback(stop_process, worker, "worker")
        api_env_all = (
            env | api_env(config, api, setup.time_scale) | {"TAILCUT_PORT": str(port), "TAILCUT_HOST": "127.0.0.1"}
        )
        api_process = _spawn("api", api_env_all, stack.enter_context(api_log.open("wb")))
        stack.callback(stop_process, api_process, "api")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, [("worker", worker), ("api", api_process)])
        except ConfigError as exc:
            raise ConfigError(f"{policy}: {exc.message} (logs: {worker_log}, {api_log})") from exc
        pids = {"api": api_process.pid, "worker": worker.pid}
        cpu_before = {name: _process_cpu_s(pid) for name, pid in pids.items()}
        cpu_before |= {"redis": _redis_cpu_s(redis_url), "client": _self_cpu_s()}
        machine_before = _machine_cpu_s()
        load = run_open_loop(
            url, served_name(setup.model_dir, None), real_trace, timeout_s=timeout_s, show_progress=setup.show_progress
        )
        result, client_stalls = asyncio.run(_watching_stalls(load))
        cpu_after = {name: _process_cpu_s(pid) for name, pid in pids.items()}
        cpu_after |= {"redis": _redis_cpu_s(redis_url), "client": _self_cpu_s()}
        machine_after = _machine_cpu_s()
    cpu_s = {
        name: after - before
        for name, before in cpu_before.items()
        if before is not None and (after := cpu_after[name]) is not None
    }
    machine: dict[str, float] = {}
    if machine_before is not None and machine_after is not None:
        busy_s, total_s, waited_s = (
            after - before for before, after in zip(machine_before, machine_after, strict=True)
        )
        # Busy share of every core, the CPU that processes other than this run's used meanwhile (another
        # benchmark on a shared machine disturbs the real-time run), and the share of the time some
        # runnable task waited for a core.
        machine = {
            "busy_share": busy_s / total_s,
            "others_cpu_s": busy_s - sum(cpu_s.values()),
            "cpu_pressure_share": waited_s / result.duration_s,
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


@dataclass(slots=True)
class PolicyResult:
    policy: LivePolicy
    live: Side
    virtual: Side

    def paired(self) -> dict[str, Any]:
        """Live minus virtual per request, realtime tier (simulated ms)."""
        return {
            metric: None
            if (delta := paired_delta_ms(self.live.records, self.virtual.records, metric, "realtime")) is None
            else asdict(delta)
            for metric in ("ttft_ms", "e2e_ms")
        }

    def realtime_p99_ttft_unstalled_ms(self, side: Side) -> float:
        """Realtime P99 TTFT of ``side`` without the requests whose first token the live client awaited
        during one of its stalls (the same requests left out on both clocks)."""
        stalled = set(self.live.stats.get("client_stalls", {}).get("first_token_awaited", []))
        mine = [record for record in side.records if record.tier == "realtime" and record.index not in stalled]
        return _p(summarize(latencies_ms(mine, "ttft_ms", side.end_s)), "p99") or 0.0


@dataclass(frozen=True, slots=True)
class RatioCheck:
    name: str
    live: float
    virtual: float
    agree: bool
    key: bool = True  # one of the ratios; the others only help read them

    @property
    def off(self) -> float:
        """Live over virtual, minus one."""
        return self.live / self.virtual - 1 if self.virtual else float("inf")


@dataclass(slots=True)
class LiveReport:
    setup: LiveSetup
    capacity_rps: float
    rate_rps: float  # simulated requests per second
    num_requests: int
    results: list[PolicyResult]
    ratios: list[RatioCheck]
    wall_s: float

    @property
    def note(self) -> str:
        return NOTE.format(scale=self.setup.time_scale, cost=self.setup.cost.name)


def ratio_checks(results: Sequence[PolicyResult]) -> list[RatioCheck]:
    """tailcut / fifo of the key figures, live and virtual (needs both policies). Two extras help read
    the P99 TTFT: the P90, less sensitive to a few requests delayed together, and the P99 without the
    requests whose first token the live client awaited while it stalled."""
    by_policy = {result.policy: result for result in results}
    if not {"fifo", "tailcut"} <= set(by_policy):
        return []
    ours, fifo = by_policy["tailcut"], by_policy["fifo"]

    def realtime(key: str) -> Callable[[Side], float]:
        return lambda side: float(side.metrics.get("realtime", {}).get(key) or 0)

    figures: list[tuple[str, Callable[[Side], float], bool]] = [
        ("realtime P99 TTFT, tailcut / fifo", realtime("p99_ttft_ms"), True),
        ("realtime P99 E2E, tailcut / fifo", realtime("p99_e2e_ms"), True),
        ("background tok/s, tailcut / fifo", lambda side: float(side.metrics["background_tokens_per_s"]), True),
        ("realtime P90 TTFT, tailcut / fifo", realtime("p90_ttft_ms"), False),
    ]
    checks = []
    unstalled = (
        "realtime P99 TTFT without client-stalled first tokens, tailcut / fifo",
        (ours.realtime_p99_ttft_unstalled_ms(ours.live), ours.realtime_p99_ttft_unstalled_ms(ours.virtual)),
        (fifo.realtime_p99_ttft_unstalled_ms(fifo.live), fifo.realtime_p99_ttft_unstalled_ms(fifo.virtual)),
    )
    for name, figure, key in figures:
        if not figure(fifo.live) or not figure(fifo.virtual):
            continue  # the workload has no such tier
        live = figure(ours.live) / figure(fifo.live)
        virtual = figure(ours.virtual) / figure(fifo.virtual)
        checks.append(RatioCheck(name, live, virtual, agrees(live, virtual), key))
    name, (ours_live, ours_virtual), (fifo_live, fifo_virtual) = unstalled
    if fifo_live and fifo_virtual:
        live, virtual = ours_live / fifo_live, ours_virtual / fifo_virtual
        checks.append(RatioCheck(name, live, virtual, agrees(live, virtual), key=False))
    return checks


def run(setup: LiveSetup, *, on_status: Callable[[str], None] | None = None) -> LiveReport:
    """fifo's capacity, the trace, every policy on the virtual clock, then every policy live."""
    started = time.perf_counter()
    say = on_status or (lambda _line: None)
    say("measuring fifo capacity on the virtual clock")
    capacity = fifo_capacity_rps(setup.workload, setup.cost, seed=setup.seed)
    rate = setup.load * capacity
    trace = poisson_trace(setup.workload, rate, seed=setup.seed, duration_s=setup.duration_s)
    api = ApiSettings()
    virtual = {policy: run_virtual(policy, trace, setup, rate, api) for policy in setup.policies}
    timeout_s = max(side.end_s for side in virtual.values()) * setup.time_scale * TIMEOUT_FACTOR + TIMEOUT_EXTRA_S
    results = []
    for policy in setup.policies:
        expected_s = virtual[policy].end_s * setup.time_scale
        say(f"{policy}: {len(trace)} requests live, about {expected_s:.0f} s (bound {timeout_s:.0f} s)")
        live = run_live(policy, trace, setup, rate, api, timeout_s)
        results.append(PolicyResult(policy, live, virtual[policy]))
    return LiveReport(setup, capacity, rate, len(trace), results, ratio_checks(results), time.perf_counter() - started)


# --- output ----------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 10_000 else f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def print_report(console: Console, report: LiveReport) -> None:
    setup = report.setup
    console.print(f"[bold]{report.note}[/bold]")
    console.print(
        f"workload {setup.workload.name}, seed {setup.seed}: fifo capacity {report.capacity_rps:.1f} req/s (virtual); "
        f"{setup.load:.0%} load = {report.rate_rps:.1f} simulated req/s = {report.rate_rps / setup.time_scale:.2f} "
        f"real req/s; {report.num_requests} requests in {setup.duration_s:g} simulated s; {report.wall_s:.0f} s wall"
    )
    figures = Table(title="live vs virtual, simulated time (times ÷ time scale)")
    for column in (
        "policy",
        "clock",
        "rt P50 TTFT",
        "rt P99 TTFT",
        "rt P50 E2E",
        "rt P99 E2E",
        "floor",
        "nm P99 TTFT",
        "bg tok/s",
        "ok / n",
    ):
        figures.add_column(column, justify="left" if column in ("policy", "clock") else "right")
    for result in report.results:
        for clock, which in (("live", result.live), ("virtual", result.virtual)):
            realtime, normal = which.metrics["realtime"], which.metrics.get("normal", {})
            num_ok = sum(which.metrics[tier]["ok"] for tier in TIERS if tier in which.metrics)
            figures.add_row(
                result.policy,
                clock,
                _ms(realtime["p50_ttft_ms"]),
                _ms(realtime["p99_ttft_ms"]),
                _ms(realtime["p50_e2e_ms"]),
                _ms(realtime["p99_e2e_ms"]),
                _ms(realtime["floor_e2e_ms"]),
                _ms(normal.get("p99_ttft_ms")),
                f"{which.metrics['background_tokens_per_s']:,.0f}",
                f"{num_ok} / {len(which.records)}",
            )
        figures.add_section()
    console.print(figures)
    if report.ratios:
        ratios = Table(title=f"ratios tailcut / fifo: live vs virtual (agree: within {AGREEMENT_TOLERANCE:.0%})")
        for column in ("ratio", "live", "virtual", "live / virtual", "agree"):
            ratios.add_column(column, justify="left" if column == "ratio" else "right")
        for check in report.ratios:
            ratios.add_row(
                check.name if check.key else f"{check.name} (extra)",
                f"{check.live:.3f}",
                f"{check.virtual:.3f}",
                f"{check.off + 1:.3f}",
                "yes" if check.agree else "[red]no[/red]",
            )
        console.print(ratios)
    health = Table(title="did the live run keep up? (real time)")
    for column in (
        "policy",
        "engine late",
        "sim_behind",
        "send lag P99/max",
        "client stalls",
        "CPU api/wkr/redis/client",
        "machine: busy, others' CPU, CPU wait",
    ):
        health.add_column(column, justify="left" if column == "policy" else "right")
    where = Table(title="where live differs from virtual (Δ = live − virtual of the same request, simulated ms)")
    for column in (
        "policy",
        "steps live/virt",
        "rt E2E outside worker (real)",
        "rt TTFT Δ P50/P90/P99",
        "rt E2E Δ P50/P90/P99",
    ):
        where.add_column(column, justify="left" if column == "policy" else "right")
    for result in report.results:
        stats = result.live.stats
        worker = stats["worker"]
        behind, steps = worker["behind_ms"], worker["engine_steps"]
        late = "-"
        if behind is not None:
            per_step = f", {behind / steps:.1f} ms/step" if steps else ""
            late = f"{behind / 1000:.1f} s = {behind / 1000 / stats['wall_s']:.1%}{per_step}"
        shares = stats["cpu_share_of_one_core"]
        machine, stalls = stats["machine"], stats["client_stalls"]
        health.add_row(
            result.policy,
            late,
            f"{worker['sim_behind_warnings']} (max {worker['max_behind_share']:.1%})",
            " / ".join(_ms(stats["send_lag_ms"] and stats["send_lag_ms"][q]) for q in ("p99", "max")),
            f"{stalls['count']}, max {_ms(stalls['max_ms'])}",
            "/".join(f"{shares[name]:.2f}" if name in shares else "-" for name in CPU_NAMES),
            f"{machine['busy_share']:.0%}, {machine['others_cpu_s']:.0f} s, {machine['cpu_pressure_share']:.0%}"
            if machine
            else "-",
        )
        paired = result.paired()
        quantiles = ("p50", "p90", "p99")
        where.add_row(
            result.policy,
            f"{steps} / {result.virtual.stats['engine_steps']}",
            _ms(stats["realtime_e2e_mean_real_ms"]["outside_worker"]),
            " / ".join(_ms(paired["ttft_ms"] and paired["ttft_ms"][q]) for q in quantiles),
            " / ".join(_ms(paired["e2e_ms"] and paired["e2e_ms"][q]) for q in quantiles),
        )
    console.print(health)
    console.print(where)


def as_dict(report: LiveReport) -> dict[str, Any]:
    """Everything of the report for ``live.json`` (per-request records without their chunk gaps)."""
    setup = report.setup

    def records(which: Side) -> list[dict[str, Any]]:
        rows = []
        for record in which.records:
            row = asdict(record)
            gaps_ms = row.pop("gaps_ms")
            row["num_chunks"] = len(gaps_ms) + (record.ttft_ms is not None)
            row["max_gap_ms"] = max(gaps_ms, default=None)
            rows.append(row)
        return rows

    return {
        "simulated": True,
        "note": report.note,
        "times": "simulated ms (live: client-measured real time ÷ time_scale); lag and wall in real time",
        "workload": setup.workload.model_dump(),
        "cost_model": asdict(setup.cost),
        "load": setup.load,
        "duration_s": setup.duration_s,
        "time_scale": setup.time_scale,
        "seed": setup.seed,
        "capacity_rps": report.capacity_rps,
        "rate_rps": report.rate_rps,
        "real_rate_rps": report.rate_rps / setup.time_scale,
        "requests": report.num_requests,
        "wall_s": report.wall_s,
        "tolerance": AGREEMENT_TOLERANCE,
        "ratios": [asdict(check) | {"live_over_virtual": check.off + 1} for check in report.ratios],
        "policies": [
            {
                "policy": result.policy,
                "live": result.live.metrics | {"stats": result.live.stats, "end_s": result.live.end_s},
                "virtual": result.virtual.metrics | {"stats": result.virtual.stats, "end_s": result.virtual.end_s},
                "paired_realtime_delta_ms": result.paired(),
                "records": {"live": records(result.live), "virtual": records(result.virtual)},
            }
            for result in report.results
        ],
    }


def write(report: LiveReport, out: Path) -> list[Path]:
    """``out/live.json`` and the realtime CDFs (E2E and TTFT), live vs virtual per policy."""
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "live.json"]
    written[0].write_bytes(orjson.dumps(as_dict(report), option=orjson.OPT_INDENT_2))
    setup = report.setup
    note = (
        f"SIMULATOR engine in real time ×{setup.time_scale:g} (live)\nvs the virtual clock, {setup.cost.name}\n"
        f"{setup.workload.name} at {setup.load:.0%} of fifo capacity\ntimes in simulated ms"
    )
    metrics: tuple[tuple[str, Metric], ...] = (("e2e", "e2e_ms"), ("ttft", "ttft_ms"))
    for name, metric in metrics:
        series: dict[str, dict[str, list[float]]] = {}
        for result in report.results:
            for clock, which in (("live", result.live), ("virtual", result.virtual)):
                realtime = [record for record in which.records if record.tier == "realtime"]
                series[f"{result.policy} {clock}"] = {"realtime": latencies_ms(realtime, metric, which.end_s)}
        written.append(plots.plot_cdf(series, name.upper(), out / f"live_cdf_{name}.png", note=note, log_x=True))
    return written


def command(args: Any) -> None:
    """``tailcut bench live`` (arguments from ``bench.cli``)."""
    import tempfile

    from bench.workloads import workload_and_cost
    from tailcut.errors import FatalError
    from tailcut.models import prepare_tiny
    from tailcut.settings import CommonSettings

    workload, cost = workload_and_cost(args.workload, args.cost_model)
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
