"""``tailcut bench overhead``'s output: the latency and throughput tables, ``overhead.json`` and the plot."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cpu import BUSY_MACHINE_SHARE
from bench.levels import LevelResult, api_bound_tokens_per_s
from bench.stats import Summary

if TYPE_CHECKING:
    from bench.overhead import OverheadReport

PROCESSES = ("api", "worker", "redis", "client")


def _ms(summary: Summary | None, attribute: str) -> str:
    if summary is None:
        return "-"
    value = float(getattr(summary, attribute))
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _step(step_ms: float) -> str:
    return "zero cost" if step_ms == 0 else f"steps of {step_ms:g} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def latency_table(levels: Sequence[LevelResult], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("client")
    for column in ("streams", "requests", "ok", "TTFT P50", "TTFT P99", "E2E P50", "E2E P99", "gap P50", "gap P99"):
        table.add_column(column, justify="right")
    for level in levels:
        table.add_row(
            level.client,
            str(level.streams),
            str(level.num_requests),
            str(level.num_ok) + (f" ({level.num_wrong_length} wrong length)" if level.num_wrong_length else ""),
            _ms(level.ttft_ms, "p50"),
            _ms(level.ttft_ms, "p99"),
            _ms(level.e2e_ms, "p50"),
            _ms(level.e2e_ms, "p99"),
            _ms(level.gap_ms, "p50"),
            _ms(level.gap_ms, "p99"),
        )
    return table


def throughput_table(levels: Sequence[LevelResult], ceilings: Sequence[LevelResult]) -> Any:
    from rich.table import Table

    table = Table(title="output tokens received per second; CPU per process: share of one core | µs per token")
    table.add_column("client")
    for column in ("streams", "tokens/s", "steady", "tokens/chunk", *PROCESSES, "others", "API-bound"):
        table.add_column(column, justify="right")
    rows = [(str(level.streams), level) for level in levels]
    rows += [(f"{level.streams} canned", level) for level in ceilings]
    for label, level in rows:
        cells = []
        for name in PROCESSES:
            share, per_token = level.cpu_share(name), level.cpu_us_per_token(name)
            if name == "api" and share is None:
                share, per_token = level.cpu_share("server"), level.cpu_us_per_token("server")
            cells.append("-" if share is None or per_token is None else f"{share:.0%} | {per_token:.1f}")
        others = level.others_cpu_share
        table.add_row(
            level.client,
            label,
            _rate(level.tokens_per_s),
            _rate(level.steady_tokens_per_s),
            f"{level.num_tokens / level.num_chunks:.1f}" if level.num_chunks else "-",
            *cells,
            "-" if others is None else f"{others:.0%}" if others < BUSY_MACHINE_SHARE else f"[red]{others:.0%}[/red]",
            _rate(api_bound_tokens_per_s(level)),
        )
    return table


def _prompt(report: OverheadReport) -> str:
    if report.prompt == "text":
        return f"text prompts of {report.prompt_tokens} words (tokenized by the API)"
    return f"{report.prompt_tokens} prompt tokens"


def print_report(console: Any, report: OverheadReport) -> None:
    from rich.table import Table

    console.print(
        f"tailcut pipeline overhead, null engine ({_step(report.step_ms)}), model {report.model}: "
        f"{_prompt(report)}, {report.output_tokens} output tokens per request, tier {report.tier}, "
        f"policy {report.policy}, "
        "closed loop; "
        f"{os.cpu_count()} cores shared by the API, the worker, Redis and the client; {report.wall_s:.0f} s wall"
        + (
            f"; a Python loop iteration took {report.python_loop_ns:.0f} ns here (runs on machines whose figure "
            "differs are not comparable)"
            if report.python_loop_ns is not None
            else ""
        )
    )
    console.print(latency_table(report.levels, "latency (ms): TTFT = tailcut's added latency before the first token"))
    console.print(throughput_table(report.levels, report.client_ceilings))
    console.print(
        "client httpx: bench.client (parses every event); raw: counts chunks on the wire and reads the token "
        "count from the usage chunk. steady: tokens/s between the 10th and 90th percentile of tokens received "
        "(ramp left out). tokens/chunk: above 1 where tailcut coalesced a stream that fell behind (the canned "
        "server sends one per chunk). others: CPU of processes outside the benchmark. API-bound: 1 s ÷ the API's "
        "CPU per token, the rate one API process would reach with a core of its own."
        + (
            " 'canned': the client against a canned SSE server (its own ceiling; the api column is that server)."
            if report.client_ceilings
            else ""
        )
    )
    for level in [*report.levels, *report.client_ceilings]:
        name = f"{level.client} client, {level.streams} streams"
        if (level.others_cpu_share or 0) >= BUSY_MACHINE_SHARE:
            console.print(
                f"[red]{name}: processes outside the benchmark (or the kernel) took {level.others_cpu_share:.0%} "
                "of a core during this level: its figures are not tailcut's alone; rerun on a quiet machine[/red]"
            )
        if level.errors:
            failures = ", ".join(f"{count}× {error}" for error, count in level.errors.items())
            console.print(f"[red]{name}: {failures}[/red]")
    targets = Table(title="targets (issue: pipeline overhead)")
    for column in ("target", "measured", "wanted", ""):
        targets.add_column(column, justify="left" if column == "target" else "right")
    for check in report.targets:
        value = "-" if check.value is None else f"{check.value:,.2f}" if check.value < 100 else f"{check.value:,.0f}"
        targets.add_row(check.name, value, check.target, "met" if check.met else "[red]missed[/red]")
    console.print(targets)


def write_outputs(report: OverheadReport, out: Path, *, command: Sequence[str], arguments: Mapping[str, Any]) -> Path:
    import orjson

    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    data = {"command": list(command), "arguments": dict(arguments), **report.as_dict()}
    path = out / "overhead.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    note = (
        f"LIVE, null engine ({_step(report.step_ms)}), {report.output_tokens}-token replies, closed loop; "
        f"{os.cpu_count()} shared cores"
    )
    rows = []
    for level in report.levels:
        for metric, summary in (("TTFT", level.ttft_ms), ("E2E", level.e2e_ms)):
            if summary is not None:
                rows += [(f"{metric} P50 ({level.client})", float(level.streams), summary.p50)]
                rows += [(f"{metric} P99 ({level.client})", float(level.streams), summary.p99)]
    plots.plot_p99_vs_load(
        rows,
        out / "overhead_latency.png",
        note=note,
        metric="latency",
        load_label="concurrent streams",
        log_y=True,
    )
    return path
