"""``tailcut bench policies --suite`` (SIMULATOR): every shipped workload, a targets table each, per-tenant rows."""

from __future__ import annotations

import argparse
import io
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from bench import policies, policies_suite
from bench.simrun import CAPACITY_REQUESTS
from bench.workloads import load_workload, shipped_workloads
from tailcut.errors import FatalError
from workers.engines.costmodel import PROFILES

H100 = PROFILES["h100-llama3-8b"]


@pytest.fixture(scope="module")
def entries() -> list[policies_suite.SuiteEntry]:
    # A small capacity measurement and 3 virtual seconds per run: the figures mean nothing, the shape does.
    workloads = [load_workload(name) for name in shipped_workloads()]
    return policies_suite.run_suite(workloads, H100, seed=0, duration_s=3.0, jobs=2, capacity_requests=300)


def test_the_suite_runs_every_shipped_workload_and_checks_its_targets(
    entries: list[policies_suite.SuiteEntry],
) -> None:
    assert [entry.report.workload.name for entry in entries] == shipped_workloads()
    for entry in entries:
        labels = {(result.job.variant.label, result.job.load) for result in entry.report.results}
        assert labels == {(label, load) for label in policies_suite.SUITE_LABELS for load in (0.9, 1.0, 1.2)}
        names = [check.name for check in entry.checks]
        assert "90%: normal P99 TTFT, tailcut / fifo" in names
        assert "90%: realtime P99 E2E, tailcut / vllm-priority" in names
        assert "120%: realtime attainment, tailcut" in names
        assert not entry.report.kv_results


def test_the_suite_prints_a_targets_table_per_workload_and_a_summary(
    entries: list[policies_suite.SuiteEntry],
) -> None:
    out = io.StringIO()
    policies_suite.print_suite(Console(file=out, width=200), entries)
    text = out.getvalue()
    for entry in entries:
        name = entry.report.workload.name
        assert f"{name}: targets (WORKLOADS.md) for tailcut" in text
        assert f"{name} at 90%: P99 queue wait per tier × tenant" in text
        assert f"{name} {entry.num_met}/{len(entry.checks)}" in text
    last = text.strip().splitlines()[-1]
    total = sum(len(entry.checks) for entry in entries)
    assert last.startswith("targets met: ") and last.endswith(f" of {total} in all")


def test_tenant_rows_split_each_tier_by_tenant(entries: list[policies_suite.SuiteEntry]) -> None:
    entry = next(e for e in entries if e.report.workload.name == "sharegpt-chat")
    result = next(r for r in entry.report.results if r.job.variant.label == "tailcut" and r.job.load == 0.9)
    for row in result.rows:
        mine = [t for t in result.tenant_rows if t["tier"] == row["tier"]]
        assert {t["tenant"] for t in mine} <= set(entry.report.workload.tenants)
        assert sum(t["requests"] for t in mine) == row["requests"]
        assert sum(t["share_of_tier"] for t in mine) == pytest.approx(1.0)
        for tenant_row in mine:
            assert tenant_row["p50_queue_wait_ms"] <= tenant_row["p99_queue_wait_ms"]
        assert row["p99_queue_wait_ms"] is not None and 0.0 <= row["prefix_cached_share"] <= 1.0


def test_the_suite_writes_each_workload_and_a_summary(entries: list[policies_suite.SuiteEntry], tmp_path: Path) -> None:
    path = policies_suite.write_suite(entries, tmp_path, note="SIMULATOR", cost=H100, command=["tailcut"])
    suite = orjson.loads(path.read_bytes())
    assert [w["name"] for w in suite["workloads"]] == shipped_workloads()
    assert suite["summary"] == policies_suite.summary_line(entries)
    for entry in entries:
        results = orjson.loads((tmp_path / entry.report.workload.name / "results.json").read_bytes())
        assert results["tenants"] and {"tenant", "p99_queue_wait_ms"} <= results["tenants"][0].keys()
        assert len(results["targets"]) == len(entry.checks)


def test_suite_and_workload_are_either_or() -> None:
    args = argparse.Namespace(workload="seed-mix", duration=None, loads=None)
    with pytest.raises(FatalError, match="not both"):
        policies_suite.command(args, H100)
    with pytest.raises(FatalError, match=r"hold 0\.9, 1\.0 and 1\.2"):
        policies_suite.parse_loads("0.5,0.9")


def test_the_capacity_measurement_takes_the_requests_asked_for_and_refuses_too_few() -> None:
    assert policies_suite.capacity_requests(argparse.Namespace()) == CAPACITY_REQUESTS == 30_000
    assert policies_suite.capacity_requests(argparse.Namespace(capacity_requests=None)) == CAPACITY_REQUESTS
    assert policies_suite.capacity_requests(argparse.Namespace(capacity_requests=30_000)) == 30_000
    with pytest.raises(FatalError, match="at least 100"):
        policies_suite.capacity_requests(argparse.Namespace(capacity_requests=99))


def test_the_suite_runs_the_shipped_workloads_named_or_every_one() -> None:
    assert [workload.name for workload in policies_suite.suite_workloads("")] == shipped_workloads()
    named = policies_suite.suite_workloads("long-history, bursty")
    assert [workload.name for workload in named] == ["bursty", "long-history"]  # in the shipped order
    with pytest.raises(FatalError, match="not nope"):
        policies_suite.suite_workloads("long-history,nope")


def test_overload_is_shed_from_background_first_and_a_run_that_sheds_nothing_meets_it(
    entries: list[policies_suite.SuiteEntry],
) -> None:
    report = next(entry.report for entry in entries if entry.report.workload.name == "seed-mix")
    name = "120%: excess shed as 429, background first (realtime 429s)"

    def met(*, realtime: int, background: int) -> bool:
        refused = {"realtime": realtime, "background": background}
        results = [
            replace(
                result,
                rows=[
                    {**row, "rejected": refused[row["tier"]]}
                    if (row["policy"], row["load"]) == ("tailcut", 1.2) and row["tier"] in refused
                    else row
                    for row in result.rows
                ],
            )
            for result in report.results
        ]
        checks = policies.check_targets(replace(report, results=results))
        return next(check.met for check in checks if check.name == name)

    assert met(realtime=0, background=40)
    assert met(realtime=0, background=0)  # no excess: nothing to shed
    assert not met(realtime=3, background=40)
    assert not met(realtime=3, background=0)
