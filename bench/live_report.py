"""``tailcut bench live``'s output: the tables, ``live.json`` (the summary), ``live-records.jsonl`` (every
request on both clocks) and the realtime CDF plots."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.live_compare import AGREEMENT_TOLERANCE, REPLAY_JITTER_MS, LiveReport
from bench.live_records import Metric, latencies_ms
from bench.records import record_row, write_records
from queues.keys import TIERS

# Processes whose CPU time a live run reports ("client": this process, the load generator).
CPU_NAMES = ("api", "worker", "redis", "client")


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
        replayed = any(check.replays for check in report.ratios)
        columns = ["ratio", "live", "virtual", "live / virtual", "agree"]
        if replayed:
            columns += ["virtual replays min–max", "median", "live / median", "agree"]
        for column in columns:
            ratios.add_column(column, justify="left" if column == "ratio" else "right")
        for check in report.ratios:
            row = [
                check.name if check.key else f"{check.name} (extra)",
                f"{check.live:.3f}",
                f"{check.virtual:.3f}",
                f"{check.off + 1:.3f}",
                _verdict(check.agree),
            ]
            if replayed:
                spread = (check.virtual, *check.replays)
                row += (
                    [
                        f"{min(spread):.3f}–{max(spread):.3f}",
                        f"{check.virtual_median:.3f}",
                        f"{check.live / check.virtual_median:.3f}",
                        _verdict(check.agree_replays),
                    ]
                    if check.replays
                    else ["", "", "", ""]
                )
            ratios.add_row(*row)
        console.print(ratios)
        if replayed:
            console.print(
                f"replays: the trace on the virtual clock {len(report.ratios[0].replays)} more times, each arrival "
                f"up to {REPLAY_JITTER_MS:g} simulated ms later (as late as a live run hands them to the engine)"
            )
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


def record_rows(report: LiveReport) -> Iterator[dict[str, Any]]:
    """Every request of every policy on both clocks, for ``live-records.jsonl`` (without their chunk gaps:
    how many chunks, and the longest gap)."""
    for result in report.results:
        for clock, which in (("live", result.live), ("virtual", result.virtual)):
            for record in which.records:
                row = record_row(record, policy=result.policy, clock=clock)
                gaps_ms = row.pop("gaps_ms")
                row["num_chunks"] = len(gaps_ms) + (record.ttft_ms is not None)
                row["max_gap_ms"] = max(gaps_ms, default=None)
                yield row


def as_dict(report: LiveReport) -> dict[str, Any]:
    """The summary of the report for ``live.json``: everything but the per-request records."""
    setup = report.setup
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
        "ratios": [
            asdict(check)
            | {
                "live_over_virtual": check.off + 1,
                "virtual_median": check.virtual_median,
                "live_over_virtual_median": check.live / check.virtual_median if check.virtual_median else None,
                "agree_replays": check.agree_replays,
            }
            for check in report.ratios
        ],
        "policies": [
            {
                "policy": result.policy,
                "live": result.live.metrics | {"stats": result.live.stats, "end_s": result.live.end_s},
                "virtual": result.virtual.metrics | {"stats": result.virtual.stats, "end_s": result.virtual.end_s},
                "paired_realtime_delta_ms": result.paired(),
            }
            for result in report.results
        ],
    }


def write(report: LiveReport, out: Path) -> list[Path]:
    """``out/live.json``, ``out/live-records.jsonl`` and the realtime CDFs (E2E and TTFT), live vs virtual per
    policy."""
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "live.json"]
    written[0].write_bytes(orjson.dumps(as_dict(report), option=orjson.OPT_INDENT_2))
    written.append(write_records(out, "live", record_rows(report)))
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


def _verdict(agree: bool) -> str:
    return "yes" if agree else "[red]no[/red]"
