"""``tailcut bench reservation``: KV reservation by predicted output, by ``max_tokens`` and none, on the
virtual clock (SIMULATOR).

The scheduler admits a request only if the KV it counts for it fits (``SchedRequest.reserved_kv_tokens``,
``SchedulerConfig.kv_reservation``): ``none`` counts the prompt alone, as vLLM does by itself; ``max``
the prompt and the rest of ``max_tokens`` (at most a slice); ``predicted`` the prompt and the predicted
output. This runs the ``tailcut`` policy of ``tailcut bench policies`` with each mode, at each load, on
one seeded trace per load, and reports how often the reservation of an engine call was short (it
produced more) or wasteful (a whole KV block stayed unused) beside what that did to the engine (its
recompute preemptions) and to latency and throughput.

Requests ask for their tier's longest reply and end at their drawn length (``max_tokens="tier-cap"``),
as real clients do: with the load generator's exact ``max_tokens`` (ignore_eos), ``max`` would be an
oracle. Two KV caches: the GPU-scale one of every other simulator figure (Llama-3.1-8B on an 80 GB
card), where KV does not bind at seed-mix (every mode gives the same run), and a 24 GB card's, where it
does; each cache's loads are shares of the ``fifo`` capacity measured with that cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

import orjson
from rich.console import Console
from rich.table import Table

from bench.policies import Job, JobResult, run_job, variants
from bench.simrun import CAPACITY_REQUESTS, SIMULATOR_NOTE, SimConfig, fifo_capacity_rps
from bench.workloads import Workload
from workers.engines.costmodel import GB, CostModel, kv_capacity_tokens
from workers.scheduling import KvReservation

MODES: tuple[KvReservation, ...] = get_args(KvReservation)
LOADS: tuple[float, ...] = (0.9, 1.0, 1.2)
# Name → KV cache tokens. The 24 GB card pairs a smaller cache with the H100 step costs, so KV binds.
KV_CACHES: dict[str, int] = {
    "80 GB card": kv_capacity_tokens(),
    "24 GB card": kv_capacity_tokens(gpu_memory_bytes=24 * GB),
}


def jobs_for(
    workload: Workload,
    cost: CostModel,
    *,
    seed: int,
    duration_s: float,
    loads: Sequence[float],
    capacity_rps: Mapping[str, float],
    kv_caches: Mapping[str, int],
) -> list[tuple[str, Job]]:
    """(KV cache, run) for every KV cache, load and mode: ``tailcut`` as ``tailcut bench policies`` runs it."""
    (tailcut,) = (variant for variant in variants() if variant.label == "tailcut")
    return [
        (
            name,
            Job(
                replace(tailcut, label=mode, scheduler=replace(tailcut.scheduler, kv_reservation=mode)),
                load,
                load * capacity_rps[name],
                seed,
                duration_s,
                workload,
                cost,
                max_tokens="tier-cap",
                kv_capacity_tokens=kv_tokens,
            ),
        )
        for name, kv_tokens in kv_caches.items()
        for load in loads
        for mode in MODES
    ]


def row_of(result: JobResult, kv_cache: str) -> dict[str, Any]:
    """One mode at one load: the reservations' record, the engine's preemptions, latency, throughput."""
    run = result.run
    record = run["reservations"]
    realtime = next(row for row in result.rows if row["tier"] == "realtime")
    background = next((row for row in result.rows if row["tier"] == "background"), None)
    return {
        "kv_cache": kv_cache,
        "kv_capacity_tokens": run["kv_capacity_tokens"],
        "load": result.job.load,
        "rate_rps": run["rate_rps"],
        "mode": run["kv_reservation"],
        "calls": record["calls"],
        "short_share": record["short_share"],
        "wasteful_share": record["wasteful_share"],
        "unused_tokens_per_call": record["unused_tokens_per_call"],
        "overrun_tokens_per_call": record["overrun_tokens"] / record["calls"] if record["calls"] else 0.0,
        "engine_preempted": run["engine_preempted"],
        "scheduler_preempted": run["preempted"],
        "max_running": run["max_running"],
        "kv_mean_usage": run["kv_mean_usage"],
        "kv_peak_usage": run["kv_peak_usage"],
        "realtime_p99_ttft_ms": realtime["p99_ttft_ms"],
        "realtime_p99_e2e_ms": realtime["p99_e2e_ms"],
        "realtime_attainment": realtime["attainment"],
        "output_tokens_per_s": sum(row["output_tokens_per_s"] for row in result.rows),
        "background_tokens_per_s": background["output_tokens_per_s"] if background else 0.0,
        "rejected": sum(row["rejected"] for row in result.rows),
        "unfinished": sum(row["unfinished"] for row in result.rows),
        "reservations": record,
    }


@dataclass(slots=True)
class ReservationReport:
    workload: Workload
    cost: CostModel
    seed: int
    duration_s: float
    kv_caches: dict[str, int]
    capacity_rps: dict[str, float]
    rows: list[dict[str, Any]]
    wall_s: float


def run(
    workload: Workload,
    cost: CostModel,
    *,
    seed: int,
    duration_s: float,
    loads: Sequence[float] = LOADS,
    kv_caches: Mapping[str, int] = KV_CACHES,
    jobs: int | None = None,
    capacity_requests: int = CAPACITY_REQUESTS,
    on_start: Callable[[int], None] | None = None,
    on_done: Callable[[JobResult], None] | None = None,
) -> ReservationReport:
    """Measure ``fifo``'s capacity with each KV cache, then every mode at every load on each."""
    started = time.perf_counter()
    capacity = {
        name: fifo_capacity_rps(
            workload,
            cost,
            seed=seed,
            num_requests=capacity_requests,
            base=SimConfig(policy="fifo", cost=cost, kv_capacity_tokens=kv_tokens),
        )
        for name, kv_tokens in kv_caches.items()
    }
    batch = jobs_for(
        workload, cost, seed=seed, duration_s=duration_s, loads=loads, capacity_rps=capacity, kv_caches=kv_caches
    )
    if on_start is not None:
        on_start(len(batch))
    results: dict[int, JobResult] = {}
    workers = jobs or os.cpu_count() or 1
    if workers == 1:
        for index, (_name, job) in enumerate(batch):
            results[index] = run_job(job)
            if on_done is not None:
                on_done(results[index])
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            # Highest loads first, so the pool does not end waiting on one straggler.
            order = sorted(range(len(batch)), key=lambda index: -batch[index][1].load)
            futures = {pool.submit(run_job, batch[index][1]): index for index in order}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if on_done is not None:
                    on_done(results[futures[future]])
    rows = [row_of(results[index], name) for index, (name, _job) in enumerate(batch)]
    return ReservationReport(
        workload, cost, seed, duration_s, dict(kv_caches), capacity, rows, time.perf_counter() - started
    )


def note(cost: CostModel) -> str:
    return SIMULATOR_NOTE.format(cost=cost.name)


def print_report(console: Console, report: ReservationReport) -> None:
    console.print(
        f"workload {report.workload.name}, seed {report.seed}, {report.duration_s:g} virtual s per run, "
        f"tailcut with max_tokens = the tier's longest reply; {len(report.rows)} runs in {report.wall_s:.0f} s wall"
    )
    for name, kv_tokens in report.kv_caches.items():
        table = Table(
            title=f"KV reservation, {name}: {kv_tokens:,} KV tokens, fifo capacity "
            f"{report.capacity_rps[name]:.1f} req/s (SIMULATOR)"
        )
        for column in (
            "load",
            "mode",
            "short",
            "wasteful",
            "unused tok/call",
            "engine preempt.",
            "sched. preempt.",
            "max running",
            "rt P99 TTFT",
            "rt P99 E2E",
            "out tok/s",
            "429s",
        ):
            table.add_column(column, justify="left" if column == "mode" else "right")
        for row in report.rows:
            if row["kv_cache"] != name:
                continue
            table.add_row(
                f"{row['load']:.0%}",
                row["mode"],
                f"{row['short_share']:.1%}",
                f"{row['wasteful_share']:.1%}",
                f"{row['unused_tokens_per_call']:.1f}",
                str(row["engine_preempted"]),
                str(row["scheduler_preempted"]),
                str(row["max_running"]),
                _ms(row["realtime_p99_ttft_ms"]),
                _ms(row["realtime_p99_e2e_ms"]),
                f"{row['output_tokens_per_s']:,.0f}",
                str(row["rejected"]),
            )
        console.print(table)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def write(report: ReservationReport, out: Path, *, note: str, command: Sequence[str]) -> Path:
    """``out/reservation.json``: every mode at every load and KV cache; its path."""
    out.mkdir(parents=True, exist_ok=True)
    cost = report.cost
    results = {
        "simulated": True,
        "note": note,
        "command": list(command),
        "cost_model": {
            "name": cost.name,
            "base_us": cost.base_us,
            "prefill_token_us": cost.prefill_token_us,
            "decode_seq_us": cost.decode_seq_us,
        },
        "workload": report.workload.model_dump(),
        "seed": report.seed,
        "duration_s": report.duration_s,
        "max_tokens": "tier-cap",
        "modes": list(MODES),
        "kv_caches": report.kv_caches,
        "capacity_rps": report.capacity_rps,
        "wall_s": report.wall_s,
        "rows": report.rows,
    }
    path = out / "reservation.json"
    path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return path
