"""What the slow-step rule costs a scheduling round (SIMULATOR for the engine; the policy's own CPU time
is real). Runs tailcut on one workload's 90% trace with ``slow_step_margin`` off and at the shipped
margin, alternated ``ROUNDS`` times, and times every ``TailcutPolicy.schedule`` call and, with the rule
on, every ``slow_steps`` call inside it (``time.perf_counter_ns``). Prints, per run, the rounds, those in
which the rule found the steps slow, the mean CPU of a round and of the rule's part of it. Run from the
repository root:

    .venv/bin/python docs/benchmarks/policies-suite/side-slow-steps/round_cost.py [WORKLOAD] [SECONDS] [ROUNDS]

(defaults: seed-mix, 360 virtual seconds (the rule's usual steps are averaged over 30 s, and on
seed-mix's trace it first acts a minute in), 3 alternations; the load is 90% of the capacity recorded in
``policies-suite-360s-capacity-30k/seed0/suite.json``).
"""

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench import policies
from bench.workloads import workload_and_cost
from workers import scheduler as schedmod
from workers.scheduling import Decision, EngineView, SchedulerConfig

SUITE = Path(__file__).parents[2] / "policies-suite-360s-capacity-30k" / "seed0" / "suite.json"


def timed_run(name: str, duration_s: float, margin: float) -> tuple[int, int, float, float]:
    """One run; (rounds, rounds with slow steps, mean ns of a round, mean ns of ``slow_steps`` per round)."""
    policy = schedmod.TailcutPolicy
    schedule, slow_steps = policy.schedule, policy.slow_steps
    spent = {"rounds": 0, "slow": 0, "round_ns": 0, "rule_ns": 0}

    def timed_schedule(self: schedmod.TailcutPolicy, view: EngineView, now_ms: int) -> Decision:
        start = time.perf_counter_ns()
        try:
            return schedule(self, view, now_ms)
        finally:
            spent["rounds"] += 1
            spent["round_ns"] += time.perf_counter_ns() - start

    def timed_slow_steps(self: schedmod.TailcutPolicy, step_ms: float, now_ms: int) -> bool:
        start = time.perf_counter_ns()
        slow = slow_steps(self, step_ms, now_ms)
        spent["rule_ns"] += time.perf_counter_ns() - start
        spent["slow"] += slow
        return slow

    policy.schedule, policy.slow_steps = timed_schedule, timed_slow_steps  # type: ignore[method-assign]
    try:
        entries = json.loads(SUITE.read_text())["workloads"]
        capacity = next(entry["capacity_rps"] for entry in entries if entry["name"] == name)
        workload, cost = workload_and_cost(name, "h100-llama3-8b")
        shipped = next(variant for variant in policies.variants() if variant.label == "tailcut")
        variant = replace(shipped, scheduler=replace(shipped.scheduler, slow_step_margin=margin))
        policies.run_job(policies.Job(variant, 0.9, 0.9 * capacity, 0, duration_s, workload, cost))
    finally:
        policy.schedule, policy.slow_steps = schedule, slow_steps  # type: ignore[method-assign]
    rounds = max(1, spent["rounds"])
    return spent["rounds"], spent["slow"], spent["round_ns"] / rounds, spent["rule_ns"] / rounds


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "seed-mix"
    duration_s = float(sys.argv[2]) if len(sys.argv) > 2 else 360.0
    alternations = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    margin = SchedulerConfig().slow_step_margin
    for index in range(alternations):
        for label, value in (("off", 0.0), (f"on ({margin})", margin)):
            rounds, slow, round_ns, rule_ns = timed_run(name, duration_s, value)
            print(
                f"{name} {index + 1} rule {label}: {rounds} rounds ({slow} with slow steps),",
                f"{round_ns / 1000:.2f} µs a round,",
                f"of which slow_steps {rule_ns / 1000:.3f} µs",
                flush=True,
            )


if __name__ == "__main__":
    main()
