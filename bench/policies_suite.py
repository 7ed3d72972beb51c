"""``tailcut bench policies --suite``: every shipped workload through ``bench.policies`` (SIMULATOR).

Each workload in ``bench/workloads/`` runs the four policies of WORKLOADS.md (static-batch, fifo,
vllm-priority, tailcut) at the loads the targets are checked at (90%, 100%, 120% of that workload's own
fifo capacity), on one seeded trace per load of 360 virtual seconds by default (``policies.DURATION_S``,
the standalone command's duration, so a workload's rows are the ones ``tailcut bench policies
--workload`` gives at those loads). ``--duration 120`` takes about a quarter of the time, but fifo's P99
at 90% is made by bursts that come every few minutes, which a 120-second trace may hold or miss: ratios
to fifo's P99 read differently there. It prints each workload's queue wait per tier × tenant and its
targets table, then one summary line of the targets met per workload; ``--out DIR`` writes
``DIR/<workload>/results.json`` (with the plots) and ``DIR/suite.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from bench import policies, policies_report
from bench.policies import JobResult, PoliciesReport
from bench.simrun import CAPACITY_REQUESTS, MIN_CAPACITY_REQUESTS
from bench.stats import TargetCheck
from bench.workloads import Workload, load_workload, shipped_workloads
from tailcut.errors import FatalError
from workers.engines.costmodel import CostModel

SUITE_LABELS: tuple[str, ...] = ("static-batch", "fifo", "vllm-priority", "tailcut")
SUITE_LOADS: tuple[float, ...] = (0.9, 1.0, 1.2)


@dataclass(slots=True)
class SuiteEntry:
    report: PoliciesReport
    checks: list[TargetCheck]

    @property
    def num_met(self) -> int:
        return sum(check.met for check in self.checks)


def run_suite(
    workloads: Sequence[Workload],
    cost: CostModel,
    *,
    seed: int,
    duration_s: float = policies.DURATION_S,
    loads: Sequence[float] = SUITE_LOADS,
    jobs: int | None = None,
    capacity_requests: int = CAPACITY_REQUESTS,
    on_workload: Callable[[Workload], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    on_done: Callable[[JobResult], None] | None = None,
) -> list[SuiteEntry]:
    """Each workload's policies run (no KV experiment) and its targets, in the order given."""
    entries = []
    for workload in workloads:
        if on_workload is not None:
            on_workload(workload)
        report = policies.run(
            workload,
            cost,
            seed=seed,
            duration_s=duration_s,
            loads=loads,
            jobs=jobs,
            labels=SUITE_LABELS,
            kv=False,
            capacity_requests=capacity_requests,
            on_start=on_start,
            on_done=on_done,
        )
        entries.append(SuiteEntry(report, policies.check_targets(report)))
    return entries


def summary_line(entries: Sequence[SuiteEntry]) -> str:
    """``targets met: seed-mix 13/14, bursty 12/14, ...; 48 of 56 in all``."""
    parts = [f"{entry.report.workload.name} {entry.num_met}/{len(entry.checks)}" for entry in entries]
    met = sum(entry.num_met for entry in entries)
    total = sum(len(entry.checks) for entry in entries)
    return f"targets met: {', '.join(parts)}; {met} of {total} in all"


def print_suite(console: Console, entries: Sequence[SuiteEntry]) -> None:
    for entry in entries:
        report = entry.report
        console.print(
            f"[bold]{report.workload.name}[/bold]: {report.workload.description}\n"
            f"fifo capacity {report.capacity_rps:.1f} req/s, {report.duration_s:g} virtual s per run, "
            f"{len(report.results)} runs in {report.wall_s:.0f} s wall"
        )
        console.print(policies_report.tenant_table(report, 0.9))
        console.print(
            policies_report.targets_table(entry.checks, f"{report.workload.name}: targets (WORKLOADS.md) for tailcut")
        )
    console.print(summary_line(entries))


def suite_json(entries: Sequence[SuiteEntry], *, note: str, command: Sequence[str]) -> dict[str, Any]:
    return {
        "simulated": True,
        "note": note,
        "command": list(command),
        "summary": summary_line(entries),
        "workloads": [
            {
                "name": entry.report.workload.name,
                "capacity_rps": entry.report.capacity_rps,
                "duration_s": entry.report.duration_s,
                "seed": entry.report.seed,
                "targets_met": entry.num_met,
                "targets": [{"name": c.name, "value": c.value, "target": c.target, "met": c.met} for c in entry.checks],
            }
            for entry in entries
        ],
    }


def write_suite(
    entries: Sequence[SuiteEntry], out: Path, *, note: str, cost: CostModel, command: Sequence[str]
) -> Path:
    """``out/<workload>/results.json`` and plots for each workload, and ``out/suite.json``; its path."""
    for entry in entries:
        policies_report.write(
            entry.report, entry.checks, out / entry.report.workload.name, note=note, cost=cost, command=command
        )
    path = out / "suite.json"
    path.write_bytes(orjson.dumps(suite_json(entries, note=note, command=command), option=orjson.OPT_INDENT_2))
    return path


def command(args: argparse.Namespace, cost: CostModel) -> None:
    """The ``--suite`` form of ``tailcut bench policies`` (``bench.cli``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if args.workload is not None:
        raise FatalError("give --suite (every shipped workload) or --workload NAME_OR_PATH, not both")
    duration_s = policies.DURATION_S if args.duration is None else args.duration
    loads = SUITE_LOADS if args.loads is None else parse_loads(args.loads)
    if duration_s <= 0:
        raise FatalError("--duration must be positive")
    capacity = capacity_requests(args)
    workloads = suite_workloads(getattr(args, "suite", None) or "")
    console = Console(width=None if sys.stdout.isatty() else 150)
    note = policies.note(cost)
    console.print(f"[bold]{note}[/bold]")
    with Progress(
        TextColumn("simulating {task.fields[workload]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    ) as progress:
        task = progress.add_task("", total=None, workload="")

        def workload_started(workload: Workload) -> None:
            progress.reset(task, total=None, description="measuring fifo capacity", workload=workload.name)

        def started(total: int) -> None:
            progress.update(task, total=total, description="")

        def done(result: JobResult) -> None:
            progress.update(task, advance=1, description=f"{result.job.variant.label} at {result.job.load:.0%}")

        entries = run_suite(
            workloads,
            cost,
            seed=args.seed,
            duration_s=duration_s,
            loads=loads,
            jobs=args.jobs,
            capacity_requests=capacity,
            on_workload=workload_started,
            on_start=started,
            on_done=done,
        )
    print_suite(console, entries)
    if args.out:
        path = write_suite(entries, Path(args.out), note=note, cost=cost, command=sys.argv)
        console.print(f"wrote {path} and each workload's results.json and plots in {path.parent}")


def suite_workloads(names: str) -> list[Workload]:
    """The shipped workloads ``names`` (comma-separated) lists, in the shipped order; every one when empty."""
    shipped = shipped_workloads()
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(shipped))
    if unknown:
        raise FatalError(f"--suite names shipped workloads ({', '.join(shipped)}), not {', '.join(unknown)}")
    return [load_workload(name) for name in shipped if not wanted or name in wanted]


def capacity_requests(args: argparse.Namespace) -> int:
    """``--capacity-requests``, or the default (``simrun.CAPACITY_REQUESTS``)."""
    value = getattr(args, "capacity_requests", None)
    if value is None:
        return CAPACITY_REQUESTS
    if value < MIN_CAPACITY_REQUESTS:
        raise FatalError(f"--capacity-requests must be at least {MIN_CAPACITY_REQUESTS}: the 10-90% window needs them")
    return int(value)


def parse_loads(text: str) -> tuple[float, ...]:
    """``--loads``: positive shares of fifo capacity that hold 0.9, 1.0 and 1.2 (the targets' loads)."""
    try:
        loads = tuple(float(value) for value in text.split(","))
    except ValueError as exc:
        raise FatalError(f"--loads must be numbers separated by commas, got {text!r}") from exc
    if not {0.9, 1.0, 1.2} <= set(loads) or min(loads) <= 0:
        raise FatalError("--loads must be positive and hold 0.9, 1.0 and 1.2 (the targets are checked there)")
    return loads
