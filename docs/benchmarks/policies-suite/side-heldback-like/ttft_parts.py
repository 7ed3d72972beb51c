"""Side run (SIMULATOR): where the slowest 1% of realtime first tokens spend their time, for one
``side_runs.py`` grid variant on a workload file at one load (seed 0's trace of the given capacity), with
the lower tiers' prefill room optionally capped at ``--cap`` chunks. From the repository root:

    SIDE_SUITE=docs/benchmarks/policies-suite-360s-capacity-30k/seed0/suite.json \\
        .venv/bin/python docs/benchmarks/policies-suite/side-heldback-like/ttft_parts.py \\
        docs/benchmarks/policies-suite/side-heldback-like/heldback-like.json shipped 0.9 50.994308134843905 [--cap 1]

For each of those requests: the part of the engine step in progress at its arrival that it waited
for, that step's lower-tier prefill, the steps until the one that gave its first token, and that step's
prefill (realtime and lower-tier) and decodes; then, over the steps between arrival and that step, the
step's budget and what it used. Realtime requests are the engine's priorities 0 and 1.
"""

import argparse
import bisect
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import policies
from bench.simrun import simulate
from bench.workloads import make_trace, workload_and_cost
from workers import scheduler as schedmod
from workers.engines import sim as simmod

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]

REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of a realtime request (its summaries: 0)
DURATION_S = 360


@dataclass(frozen=True, slots=True)
class Step:
    start_ms: float
    end_ms: float
    budget: int
    used: int
    realtime_prefill: int
    lower_prefill: int
    decodes: int
    first_tokens: tuple[str, ...]


def record_steps(steps: list[Step]) -> None:
    step = simmod.SimEngine.step

    def recording(self: Any) -> Any:
        budget = self._token_budget
        decoding = {request.id for request in self._running if request.decoding}
        result = step(self)
        priority = {request.id: request.priority for request in self._requests.values()}
        prefill = {"realtime": 0, "lower": 0}
        for request_id, num_tokens in result.scheduled_tokens.items():
            if request_id not in decoding:
                tier = "realtime" if priority.get(request_id, REALTIME_PRIORITY) <= REALTIME_PRIORITY else "lower"
                prefill[tier] += num_tokens
        steps.append(
            Step(
                start_ms=result.start_us / 1000,
                end_ms=(result.start_us + result.duration_us) / 1000,
                budget=budget,
                used=sum(result.scheduled_tokens.values()),
                realtime_prefill=prefill["realtime"],
                lower_prefill=prefill["lower"],
                decodes=result.num_decode_seqs,
                first_tokens=tuple(rid for rid in result.new_token_ids if rid not in decoding),
            )
        )
        return result

    simmod.SimEngine.step = recording  # type: ignore[method-assign]


def cap_lower_room(num_chunks: int) -> None:
    room = schedmod.TailcutPolicy.room

    def capped(self: Any, view: Any, now_ms: int) -> Any:
        shipped = room(self, view, now_ms)
        if not self.adapting:
            return shipped
        return replace(shipped, lower_prefill=min(shipped.lower_prefill, num_chunks * shipped.chunk))

    schedmod.TailcutPolicy.room = capped  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("spec")
    parser.add_argument("load", type=float)
    parser.add_argument("capacity", type=float)
    parser.add_argument("--cap", type=int, default=0, help="the lower tiers' room at most this many chunks")
    args = parser.parse_args()
    side_runs.patch_sizes(args.spec)
    if args.cap:
        cap_lower_room(args.cap)
    steps: list[Step] = []
    record_steps(steps)
    workload, cost = workload_and_cost(args.workload, "h100-llama3-8b")
    rate_rps = args.load * args.capacity
    job = policies.Job(side_runs.grid_variant(args.spec), args.load, rate_rps, 0, DURATION_S, workload, cost)
    trace = make_trace(workload, rate_rps, seed=0, duration_s=DURATION_S)
    run = simulate(trace, workload, job.config(), duration_s=DURATION_S)

    starts = [step.start_ms for step in steps]
    first_step: dict[int, Step] = {}
    for step in steps:
        for request_id in step.first_tokens:
            found = re.match(r"r(\d+)", request_id)
            if found:
                first_step.setdefault(int(found.group(1)), step)
    replies = [r for r in run.records if r.arrival.tier == "realtime" and r.ttft_ms is not None]
    ttfts = np.array([r.ttft_ms for r in replies])
    p99 = float(np.percentile(ttfts, 99))
    parts, between = [], []
    for record in (r for r in replies if r.ttft_ms is not None and r.ttft_ms >= p99):
        arrived_ms = record.arrival.at_s * 1000
        own = first_step[record.arrival.index]
        in_progress = steps[bisect.bisect_right(starts, arrived_ms) - 1]
        after = [step for step in steps if arrived_ms <= step.start_ms < own.start_ms]
        between += after
        parts.append(
            (
                record.ttft_ms,
                record.arrival.prompt_tokens,
                in_progress.end_ms - arrived_ms,
                in_progress.end_ms - in_progress.start_ms,
                in_progress.lower_prefill,
                len(after) + 1,
                own.end_ms - own.start_ms,
                own.realtime_prefill,
                own.lower_prefill,
                own.decodes,
            )
        )
    names = (
        "TTFT ms",
        "prompt",
        "wait for the step in progress ms",
        "that step ms",
        "its lower-tier prefill",
        "steps to the first token",
        "the first token's step ms",
        "its realtime prefill",
        "its lower-tier prefill",
        "its decodes",
    )
    background = [r for r in run.records if r.arrival.tier == "background"]
    normal = [r.ttft_ms for r in run.records if r.arrival.tier == "normal" and r.ttft_ms is not None]
    durations = np.array([step.end_ms - step.start_ms for step in steps])
    lower = np.array([step.lower_prefill for step in steps])
    print(
        f"{args.spec} cap={args.cap or 'none'} at {args.load}: realtime P99 TTFT {p99:.1f} ms, P50",
        f"{np.percentile(ttfts, 50):.1f}; normal P99 TTFT {np.percentile(normal, 99):.1f} ms; background output",
        f"{sum(r.output_tokens for r in background)} tokens, {sum(r.status == 'rejected' for r in background)} refused",
    )
    step_ms = " / ".join(f"{x:.1f}" for x in np.percentile(durations, [50, 90, 99]))
    step_lower = " / ".join(f"{x:.0f}" for x in np.percentile(lower, [50, 90, 99]))
    print(f"  steps: {len(steps)}, P50 / P90 / P99 {step_ms} ms; lower-tier prefill P50 / P90 / P99 {step_lower}")
    means = np.array(parts).mean(axis=0)
    print(f"  the slowest {len(parts)}, means: " + "; ".join(f"{n} {v:.1f}" for n, v in zip(names, means, strict=True)))
    if between:
        mean = {key: np.mean([getattr(s, key) for s in between]) for key in ("budget", "used", "decodes")}
        print(
            f"  the {len(between)} steps between their arrival and their first token's step, means: budget",
            f"{mean['budget']:.0f}, used {mean['used']:.0f}, lower-tier prefill",
            f"{np.mean([s.lower_prefill for s in between]):.0f}, realtime prefill",
            f"{np.mean([s.realtime_prefill for s in between]):.0f}, decodes {mean['decodes']:.0f}",
        )


if __name__ == "__main__":
    main()
