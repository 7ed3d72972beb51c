"""What the engine step that gives a request its first token carries, on each clock of a `bench live` run.

Reads the step logs `tailcut bench live` writes (`<policy>-live-steps.jsonl`, `<policy>-virtual-steps.jsonl`,
optionally gzipped; `workers/engines/steplog.py`) and prints, per clock, for the first engine call of every
request of one engine priority (1: tailcut's realtime tier): how many steps after its `add` line the first
token came (0: the next step), and that step's duration and prefill tokens; then, over the steps that give
such first tokens, the prefill they carry of lower-tier prompts (priority above 1) admitted into that very
step, of lower-tier prompts already running, and of the realtime tier.

    .venv/bin/python docs/benchmarks/live-long-history-2026-12-05/first_token_steps.py \\
        docs/benchmarks/live-long-history-2026-12-05/run3/tailcut-virtual-steps.jsonl.gz \\
        docs/benchmarks/live-long-history-2026-12-05/run3/tailcut-live-steps.jsonl.gz
"""

from __future__ import annotations

import gzip
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

REALTIME_PRIORITY = 1


def read(path: Path) -> list[dict[str, Any]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [orjson.loads(line) for line in raw.splitlines()]


def first_token_steps(lines: list[dict[str, Any]], priority: int) -> tuple[Counter[int], list[float], list[int]]:
    """Steps from add to first token, and the first-token step's duration (ms) and prefill tokens."""
    added: dict[str, int] = {}  # engine request id → index of the next step after its add line
    steps: list[dict[str, Any]] = []
    for line in lines:
        if "add" in line:
            if line["priority"] == priority and line["add"].endswith("-0-0"):  # a request's first engine call
                added[line["add"]] = len(steps)
        else:
            steps.append(line)
    lag: Counter[int] = Counter()
    durations: list[float] = []
    prefill: list[int] = []
    for index, step in enumerate(steps):
        for request_id in step["first"]:
            if request_id in added:
                lag[index - added.pop(request_id)] += 1
                durations.append(step["ms"])
                prefill.append(step["prefill"])
    return lag, durations, prefill


def prefill_by_kind(lines: list[dict[str, Any]], priority: int) -> tuple[int, dict[str, float], float]:
    """Over the steps giving a first token at ``priority``: how many, the mean prefill tokens of lower
    tiers admitted in the step, of lower tiers already running, and of ``priority`` itself; and the share
    of those steps that admitted lower-tier prompts."""
    priorities: dict[str, int] = {}
    sums = dict.fromkeys(("lower admitted", "lower running", "own tier"), 0.0)
    num_steps = num_with_admitted = 0
    for line in lines:
        if "add" in line:
            priorities[line["add"]] = line["priority"]
            continue
        if not any(priorities.get(request_id) == priority for request_id in line["first"]):
            continue
        num_steps += 1
        admitted_lower = 0
        for request_id, tokens in line["prefilling"].items():
            mine = priorities.get(request_id, 0)
            if mine == priority:
                sums["own tier"] += tokens
            elif mine > priority and request_id in line["admitted"]:
                admitted_lower += tokens
            elif mine > priority:
                sums["lower running"] += tokens
        sums["lower admitted"] += admitted_lower
        num_with_admitted += admitted_lower > 0
    means = {kind: total / max(1, num_steps) for kind, total in sums.items()}
    return num_steps, means, num_with_admitted / max(1, num_steps)


def main(paths: list[str]) -> None:
    for name in paths:
        lines = read(Path(name))
        lag, durations, prefill = first_token_steps(lines, REALTIME_PRIORITY)
        ordered = sorted(durations)
        print(
            f"{Path(name).name}: {len(durations)} first tokens; steps after the add {sorted(lag.items())}; "
            f"that step {statistics.mean(durations):.2f} ms mean, {ordered[int(0.9 * len(ordered))]:.2f} ms P90, "
            f"{statistics.mean(prefill):.0f} prefill tokens mean"
        )
        num_steps, means, share = prefill_by_kind(lines, REALTIME_PRIORITY)
        kinds = ", ".join(f"{kind} {tokens:.0f}" for kind, tokens in means.items())
        print(f"  {num_steps} such steps, prefill tokens mean: {kinds}; {share:.0%} admitted lower-tier prompts")


if __name__ == "__main__":
    main(sys.argv[1:])
