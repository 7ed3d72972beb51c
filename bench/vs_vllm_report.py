"""``tailcut bench vs-vllm``'s output: the results table, the comparison, ``vs_vllm.json`` (the summary),
``vs_vllm-records.jsonl`` (every request) and the TTFT plot."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import stats
from bench.cpu import BUSY_MACHINE_SHARE, MACHINE
from bench.levels import LevelResult
from bench.records import record_row, write_records
from bench.stats import TargetCheck

if TYPE_CHECKING:
    from bench.vs_vllm import SystemRun, VsReport


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def server_cpu_share(result: LevelResult) -> float | None:
    """Cores the system under test used during the level: every process of its process groups."""
    if not result.cpu_s or result.duration_s <= 0:
        return None
    return sum(seconds for name, seconds in result.cpu_s.items() if name not in ("client", MACHINE)) / result.duration_s


def _cores(value: float | None, *, warn: bool = False) -> str:
    if value is None:
        return "-"
    return f"[red]{value:.2f}[/red]" if warn and value >= BUSY_MACHINE_SHARE else f"{value:.2f}"


def results_table(runs: Sequence[SystemRun]) -> Any:
    from rich.table import Table

    table = Table(title="latency (ms), output tokens/s and CPU (cores), same load, one system at a time")
    columns = ("system", "round", "c", "n", "ok", "TTFT P50", "TTFT P99", "E2E P50", "E2E P99", "gap P50", "tok/s")
    for column in (*columns, "server CPU", "client", "others"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for run in runs:
        for level in run.levels:
            result = level.result
            table.add_row(
                run.system,
                "all" if run.round < 0 else str(run.round + 1),
                str(level.concurrency),
                str(result.num_requests),
                str(result.num_ok) + (f" ({result.num_wrong_length} wrong length)" if result.num_wrong_length else ""),
                _ms(result.ttft_ms.p50 if result.ttft_ms else None),
                _ms(result.ttft_ms.p99 if result.ttft_ms else None),
                _ms(result.e2e_ms.p50 if result.e2e_ms else None),
                _ms(result.e2e_ms.p99 if result.e2e_ms else None),
                _ms(result.gap_ms.p50 if result.gap_ms else None),
                f"{level.output_tokens_per_s:.1f}",
                _cores(server_cpu_share(result)),
                _cores(result.cpu_share("client")),
                _cores(result.others_cpu_share, warn=True),
            )
        table.add_section()
    return table


def print_report(console: Any, report: VsReport) -> None:
    from rich.table import Table

    plan = report.plan
    console.print(
        f"tailcut vs vLLM's own server, model {report.model}, {plan.workload.tiers[0].prompt_tokens[0]} prompt "
        f"tokens, {plan.output_tokens} output tokens (ignore_eos, temperature 0), closed loop; "
        f"{os.cpu_count()} shared cores, the engine's compute threads on {report.engine_cores or 'all'} of them; "
        f"{report.wall_s:.0f} s wall"
    )
    console.print("start: " + ", ".join(f"{run.system} {run.start_s:.0f} s" for run in report.runs))
    console.print(results_table([*report.runs, *report.pooled]))
    console.print(
        "server CPU: cores the system under test used (tailcut: API, Redis, worker and its engine process; vLLM: its "
        "server and engine process); others: cores taken by processes outside the benchmark (or the kernel)."
    )
    for run in report.runs:
        for level in run.levels:
            if (level.result.others_cpu_share or 0) >= BUSY_MACHINE_SHARE:
                console.print(
                    f"[red]{run.system} c={level.concurrency}: {level.result.others_cpu_share:.2f} cores went to "
                    "processes outside the benchmark: the comparison is unfair; rerun on a quiet machine[/red]"
                )
            if level.result.errors:
                failures = ", ".join(f"{count}× {error}" for error, count in level.result.errors.items())
                console.print(f"[red]{run.system} c={level.concurrency}: {failures}[/red]")
    if report.comparison is None:
        return
    comparison = report.comparison
    table = Table(title="tailcut against vLLM's own server")
    for column in ("measure", "value", "wanted", ""):
        table.add_column(column, justify="left" if column == "measure" else "right")
    checks = {check.name: check for check in report.targets}
    p50_check = checks.get("TTFT P50 overhead at c=1 (ms)")
    table.add_row(
        "TTFT P50 overhead at c=1 (tailcut − vLLM)",
        f"{_ms(comparison.ttft_p50_overhead_ms)} ms",
        p50_check.target if p50_check else "",
        _met(p50_check),
    )
    table.add_row("TTFT P99 overhead at c=1 (tailcut − vLLM)", f"{_ms(comparison.ttft_p99_overhead_ms)} ms", "", "")
    ratio_check = checks.get(f"throughput ratio at c={comparison.concurrency}")
    ratio = comparison.throughput_ratio
    table.add_row(
        f"output tokens/s at c={comparison.concurrency}, tailcut / vLLM",
        "-" if ratio is None else f"{ratio:.1%}",
        ratio_check.target if ratio_check else "",
        _met(ratio_check),
    )
    for system, spread in report.round_spread.items():
        if spread is not None:
            label = f"{system}'s own rounds at c={comparison.concurrency}: lowest ÷ highest tokens/s"
            table.add_row(label, f"{spread:.1%}", "", "")
    for index, each in enumerate(report.per_round if len(report.per_round) > 1 else []):
        ratio_text = "-" if each.throughput_ratio is None else f"{each.throughput_ratio:.1%}"
        table.add_row(
            f"round {index + 1}: TTFT P50 / P99 overhead, throughput ratio",
            f"{_ms(each.ttft_p50_overhead_ms)} / {_ms(each.ttft_p99_overhead_ms)} ms, {ratio_text}",
            "",
            "",
        )
    console.print(table)


def _met(check: TargetCheck | None) -> str:
    if check is None:
        return ""
    return "met" if check.met else "[red]missed[/red]"


def as_dict(report: VsReport) -> dict[str, Any]:
    """The summary for ``vs_vllm.json``: everything but the per-request records."""
    return {
        "model": report.model,
        "model_dir": report.model_dir,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "engine_cores": report.engine_cores or os.cpu_count(),
        "engine_args": report.engine_args,
        "vllm_server_command": report.server_command,
        "load": {
            "prompt_tokens": report.plan.workload.tiers[0].prompt_tokens[0],
            "output_tokens": report.plan.output_tokens,
            "tier": report.plan.workload.tiers[0].tier,
            "requests_c1": report.plan.requests_c1,
            "concurrency": report.plan.concurrency,
            "requests_cn": report.plan.requests_cn,
        },
        "rounds": len(report.per_round) or 1,
        "systems": [_run_dict(run) for run in report.runs],
        "pooled": [_run_dict(run) for run in report.pooled],
        "comparison": asdict(report.comparison) if report.comparison else None,
        "per_round": [asdict(comparison) for comparison in report.per_round],
        "round_spread": report.round_spread,
        "targets": [asdict(check) for check in report.targets],
        "wall_s": report.wall_s,
    }


def _run_dict(run: SystemRun) -> dict[str, Any]:
    return {
        "system": run.system,
        "round": run.round,
        "start_s": run.start_s,
        "levels": [
            {
                **level.result.as_dict(),
                "concurrency": level.concurrency,
                "output_tokens_per_s": level.output_tokens_per_s,
            }
            for level in run.levels
        ],
    }


def record_rows(report: VsReport) -> Iterator[dict[str, Any]]:
    """Every request of every round, system and level, for ``vs_vllm-records.jsonl``."""
    for run in report.runs:
        for level in run.levels:
            for record in level.records:
                yield record_row(record, system=run.system, round=run.round, concurrency=level.concurrency)


def write_outputs(report: VsReport, out: Path, *, command: Sequence[str], arguments: Mapping[str, Any]) -> Path:
    """``vs_vllm.json``, ``vs_vllm-records.jsonl`` and the TTFT plot in ``out``; the JSON's path."""
    import orjson

    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    path = out / "vs_vllm.json"
    data = {"command": list(command), "arguments": dict(arguments), **as_dict(report)}
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    write_records(out, "vs_vllm", record_rows(report))
    series = {
        run.system: {
            f"concurrency {level.concurrency}": stats.values_of(level.records, "ttft_ms") for level in run.levels
        }
        for run in (report.pooled or report.runs)
    }
    note = f"LIVE, vLLM CPU engine, {report.model}, {report.plan.output_tokens}-token replies, closed loop"
    plots.plot_cdf(series, "TTFT", out / "vs_vllm_cdf_ttft.png", note=note)
    return path
