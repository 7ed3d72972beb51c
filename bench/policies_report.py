"""``tailcut bench policies``' output (SIMULATOR): the tables per tier, the queue wait per tier × tenant,
the KV table, the targets, ``results.json`` and the plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from bench import plots
from bench.policies import PoliciesReport
from bench.stats import TargetCheck
from queues.keys import TIERS, Tier
from workers.engines.costmodel import CostModel


def print_report(console: Console, report: PoliciesReport, checks: list[TargetCheck]) -> None:
    console.print(
        f"workload {report.workload.name}, seed {report.seed}, {report.duration_s:g} virtual s per run; "
        f"fifo capacity {report.capacity_rps:.1f} req/s; {len(report.results) + len(report.kv_results)} runs "
        f"in {report.wall_s:.0f} s wall"
    )
    tiers = {mix.tier for mix in report.workload.tiers}
    for tier in ("realtime", "normal"):
        if tier not in tiers:
            continue
        table = Table(title=f"{tier}: latency beside the floor and the background throughput left (SIMULATOR)")
        for column in (
            "policy",
            "load",
            "P99 TTFT",
            "P50 E2E",
            "P99 E2E",
            "floor",
            "E2E/floor",
            "attain.",
            "bg tok/s",
            "offered",
            "429s",
        ):
            table.add_column(column, justify="left" if column == "policy" else "right")
        for result in report.results:
            row = next((row for row in result.rows if row["tier"] == tier), None)
            if row is None:
                continue
            background = next((row for row in result.rows if row["tier"] == "background"), NO_BACKGROUND)
            rejected = sum(r["rejected"] for r in result.rows)
            table.add_row(
                row["policy"],
                f"{row['load']:.0%}",
                _ms(row["p99_ttft_ms"]),
                _ms(row["p50_e2e_ms"]),
                _ms(row["p99_e2e_ms"]),
                _ms(row["floor_e2e_ms"]),
                f"{row['p99_e2e_ms'] / row['floor_e2e_ms']:.2f}",
                f"{row['attainment']:.1%}",
                f"{background['output_tokens_per_s']:,.0f}",
                f"{background['offered_tokens_per_s']:,.0f}",
                str(rejected),
            )
        console.print(table)
    console.print(tenant_table(report, 0.9))
    if not report.kv_results:
        console.print(targets_table(checks, f"targets (WORKLOADS.md) for tailcut on {report.workload.name}"))
        return
    kv = Table(title="KV cache: static reservation vs paged blocks (fifo at 90%, max_tokens = tier cap; SIMULATOR)")
    for column in ("allocation", "mean use", "peak use", "slots holding KV", "max running", "rt P99 E2E"):
        kv.add_column(column, justify="left" if column == "allocation" else "right")
    for result in report.kv_results:
        stats = result.run
        realtime = next((row for row in result.rows if row["tier"] == "realtime"), None)
        name = "static" if stats["kv_allocation"] == "static" else f"paged {stats['block_size']}"
        kv.add_row(
            name,
            f"{stats['kv_mean_usage']:.1%}",
            f"{stats['kv_peak_usage']:.1%}",
            f"{stats['kv_filled_share']:.1%}",
            str(stats["max_running"]),
            _ms(realtime["p99_e2e_ms"]) if realtime is not None else "-",
        )
    console.print(kv)
    console.print(targets_table(checks, "targets (WORKLOADS.md) for tailcut"))


# Tenant columns: the policies whose queue wait is compared.
TENANT_POLICIES = ("fifo", "vllm-priority", "tailcut")
NO_BACKGROUND = {"output_tokens_per_s": 0.0, "offered_tokens_per_s": 0.0}


def tenant_table(report: PoliciesReport, load: float) -> Table:
    """P99 queue wait per tier × tenant under each policy at ``load``, with tailcut's TTFT and attainment."""
    table = Table(
        title=f"{report.workload.name} at {load:.0%}: P99 queue wait per tier × tenant (arrival → first scheduled; "
        "SIMULATOR)"
    )
    for column in ("tier", "tenant", "share", *(f"{p} wait" for p in TENANT_POLICIES), "tc P99 TTFT", "tc attain."):
        table.add_column(column, justify="left" if column in ("tier", "tenant") else "right")
    rows = {
        (row["policy"], row["tier"], row["tenant"]): row
        for result in report.results
        if result.job.load == load
        for row in result.tenant_rows
    }
    tiers: list[Tier] = [mix.tier for mix in report.workload.tiers]
    for tier in tiers:
        for tenant in report.workload.tenants:
            ours = rows.get(("tailcut", tier, tenant))
            if ours is None:
                continue
            waits = [rows.get((policy, tier, tenant)) for policy in TENANT_POLICIES]
            table.add_row(
                tier,
                tenant,
                f"{ours['share_of_tier']:.0%}",
                *(_ms(row["p99_queue_wait_ms"]) if row else "-" for row in waits),
                _ms(ours["p99_ttft_ms"]),
                f"{ours['attainment']:.1%}",
            )
    return table


def targets_table(checks: Sequence[TargetCheck], title: str) -> Table:
    targets = Table(title=title)
    for column in ("target", "measured", "wanted", ""):
        targets.add_column(column, justify="left" if column == "target" else "right")
    for check in checks:
        targets.add_row(
            check.name,
            "-" if check.value is None else f"{check.value:.3f}",
            check.target,
            "met" if check.met else "[red]missed[/red]",
        )
    return targets


def plot(report: PoliciesReport, out: Path, note: str) -> None:
    at_90 = [result for result in report.results if result.job.load == 0.9]
    # P99 against load for the most latency-bound tier the workload has (realtime, where there is one).
    present = {mix.tier for mix in report.workload.tiers}
    tier = next(tier for tier in TIERS if tier in present)
    for name, attribute in (("e2e", "e2e_ms"), ("ttft", "ttft_ms")):
        series = {result.job.variant.label: getattr(result, attribute) for result in at_90}
        plots.plot_cdf(series, name.upper(), out / f"policies_cdf_{name}_90.png", note=f"90% load; {note}", log_x=True)
        key = f"p99_{name}_ms"
        rows = [
            (row["policy"], row["load"], row[key])
            for result in report.results
            if result.job.variant.policy != "static-batch"
            for row in result.rows
            if row["tier"] == tier
        ]
        floor = None
        if name == "e2e":
            floor = {
                row["load"]: row["floor_e2e_ms"]
                for result in report.results
                for row in result.rows
                if row["tier"] == tier
            }
        plots.plot_p99_vs_load(
            rows,
            out / f"policies_p99_{name}_vs_load.png",
            note=f"{tier} tier (static-batch off the scale)\n{note}",
            metric=f"P99 {name.upper()}",
            load_label="load (share of fifo capacity)",
            floor_ms=floor,
            log_y=True,
        )


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 10_000 else f"{value:.0f} ms"


def write(
    report: PoliciesReport,
    checks: Sequence[TargetCheck],
    out: Path,
    *,
    note: str,
    cost: CostModel,
    command: Sequence[str],
) -> Path:
    """``out/results.json`` (every run's rows per tier, the KV runs, the targets) and the plots; its path."""
    out.mkdir(parents=True, exist_ok=True)
    workload = report.workload
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
        "workload": workload.model_dump(),
        "seed": report.seed,
        "duration_s": report.duration_s,
        "capacity_rps": report.capacity_rps,
        "wall_s": report.wall_s,
        "runs": [row for result in report.results for row in result.rows],
        "tenants": [row for result in report.results for row in result.tenant_rows],
        "run_stats": [result.run for result in report.results],
        "kv": [result.run | {"rows": result.rows} for result in report.kv_results],
        "targets": [{"name": c.name, "value": c.value, "target": c.target, "met": c.met} for c in checks],
    }
    path = out / "results.json"
    path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    plot(report, out, note)
    return path
