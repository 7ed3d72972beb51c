"""SIMULATOR: the steps tailcut's slowest realtime replies decode in, against everyone's (not shipped).

Runs one suite job (a shipped policy variant on a workload's seeded trace at a load, the capacity
given as the suite measured it) on the virtual clock with the engine's step log, then, for the
realtime replies of the top 1% E2E, of the middle tenth and of all, averages over the steps between
each reply's first token and its end: the step time, the prompt tokens computed per step (realtime and
lower tiers apart, and background of the lower tiers, by the engine priority each request was added
with) and the decoding requests; then the share of busy steps that computed no background prompt token.
Run from the repository root:

    .venv/bin/python docs/benchmarks/policies-suite-360s-capacity-30k/slow_realtime_steps.py \\
        long-history 2 52.679412402573845 [tailcut] [0.9]
"""

from __future__ import annotations

import bisect
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench import policies
from bench.simrun import SimRecord, simulate
from bench.workloads import make_trace, workload_and_cost
from workers.engines.steplog import StepLog

REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of realtime (its summaries: 0)
NORMAL_PRIORITY = 3  # and of the normal tier (background: 5)


def steps_of(path: Path) -> list[dict[str, Any]]:
    """The log's step lines, each with the prompt tokens computed for realtime and for lower tiers."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    priority = {line["add"]: line["priority"] for line in lines if "add" in line}
    steps = [line for line in lines if "step_ms" in line]
    for step in steps:
        computed = [
            (priority.get(request_id, REALTIME_PRIORITY + 1), n) for request_id, n in step["prefilling"].items()
        ]
        step["realtime_prefill"] = sum(n for rank, n in computed if rank <= REALTIME_PRIORITY)
        step["lower_prefill"] = sum(n for rank, n in computed if rank > REALTIME_PRIORITY)
        step["background_prefill"] = sum(n for rank, n in computed if rank > NORMAL_PRIORITY)
    return steps


def report(label: str, group: Sequence[SimRecord], steps: list[dict[str, Any]]) -> str:
    starts = [step["step_ms"] for step in steps]

    def decoding(record: SimRecord) -> list[dict[str, Any]]:
        sent_ms = record.arrival.at_s * 1000
        assert record.ttft_ms is not None and record.e2e_ms is not None
        low = bisect.bisect_left(starts, sent_ms + record.ttft_ms)
        return steps[low : bisect.bisect_right(starts, sent_ms + record.e2e_ms)]

    windows = [window for window in map(decoding, group) if window]

    def mean(field: str) -> float:
        return float(statistics.mean(statistics.mean(step[field] for step in window) for window in windows))

    return (
        f"{label:>7} ({len(group)} replies): E2E {statistics.mean(r.e2e_ms or 0 for r in group):.0f} ms, "
        f"TTFT {statistics.mean(r.ttft_ms or 0 for r in group):.1f} ms, "
        f"{statistics.mean(r.arrival.output_tokens for r in group):.1f} tokens; "
        f"per decode step {mean('ms'):.2f} ms, prompt tokens realtime {mean('realtime_prefill'):.0f} "
        f"+ lower tiers {mean('lower_prefill'):.0f} (background {mean('background_prefill'):.0f}), "
        f"{mean('decode'):.0f} decoding"
    )


def run_with_steps(job: policies.Job) -> tuple[list[SimRecord], list[dict[str, Any]]]:
    """Run ``job`` on its seeded trace with the engine's step log: its realtime replies, by E2E, and the
    log's steps (``steps_of``)."""
    trace = make_trace(job.workload, job.rate_rps, seed=job.seed, duration_s=job.duration_s)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "steps.jsonl"
        log = StepLog(path)
        run = simulate(trace, job.workload, job.config(), duration_s=job.duration_s, step_log=log)
        log.close()
        steps = steps_of(path)
    replies = sorted(
        (r for r in run.records if r.arrival.tier == "realtime" and r.e2e_ms is not None and r.ttft_ms is not None),
        key=lambda record: record.e2e_ms or 0.0,
    )
    return replies, steps


def main(argv: Sequence[str]) -> None:
    name, seed, capacity = argv[0], int(argv[1]), float(argv[2])
    label = argv[3] if len(argv) > 3 else "tailcut"
    load = float(argv[4]) if len(argv) > 4 else 0.9
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    variant = next(variant for variant in policies.variants() if variant.label == label)
    job = policies.Job(variant, load, load * capacity, seed, policies.DURATION_S, workload, cost)
    replies, steps = run_with_steps(job)
    count = len(replies)
    busy = [step["ms"] for step in steps if step["ms"] > 0]
    print(f"{name}, seed {seed}, {label} at {load:.0%}: {len(busy)} steps, mean {statistics.mean(busy):.2f} ms")
    print(report("top 1%", replies[count * 99 // 100 :], steps))
    print(report("middle", replies[count * 45 // 100 : count * 55 // 100], steps))
    print(report("all", replies, steps))
    without = sum(1 for step in steps if step["ms"] > 0 and not step["background_prefill"])
    print(f"steps with no background prefill: {without / len(busy):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
