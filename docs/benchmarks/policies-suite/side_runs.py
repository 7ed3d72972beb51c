"""Side runs of issue 12 (SIMULATOR, not shipped): one policy variant at a time on the suite's traces
(seed 0, 120 virtual s, each workload's fifo capacity as ``suite.json`` recorded it). Run from the
repository root as ``.venv/bin/python docs/benchmarks/policies-suite/side_runs.py`` (below: ``SIDE``);
WORKLOADS, VARIANTS, POLICIES and LOADS are comma-separated:

``SIDE floor WORKLOADS VARIANTS LOADS``
    tailcut with a larger budget floor (``floor=N``: ``BudgetConfig.min_tokens``), without shedding
    background (``noshed``), or as shipped (``shipped``); one line per run (``side-floor-at-100/``).

``YIELD_MODE=global YIELD_FLOOR=128 SIDE yield WORKLOADS POLICIES LOADS``
    priority-aware prefill chunks (``side-prefill-yield/``), the simulator's engine patched for every
    policy named: in a step that prefills a realtime prompt (engine priority 1 or less, waiting or
    mid-prefill), ``YIELD_MODE=global`` caps every prompt's chunk at max(YIELD_FLOOR, the longest
    pending realtime prompt's remaining tokens) for that step only (one threshold per step: what a vLLM
    plugin could do by wrapping the scheduler's ``schedule``); ``YIELD_MODE=pause`` gives lower-tier
    prompts in prefill no chunk at all in such a step (the idea's bound, not buildable on vLLM as it
    ships); ``off``, the default, leaves the engine as it is. One line per run and tier.
"""

import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from admission.shedding import ShedLimits
from bench import policies
from bench.workloads import workload_and_cost
from workers.engines import sim as simmod

SUITE = Path(__file__).with_name("suite.json")
REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of a realtime request (its summaries: 0)
Rows = dict[str, dict[str, Any]]


def capacities_rps() -> dict[str, float]:
    return {entry["name"]: entry["capacity_rps"] for entry in json.loads(SUITE.read_text())["workloads"]}


# --- floor: variants of the policy's configuration ---


def floor_variant(spec: str) -> policies.Variant:
    shipped = next(variant for variant in policies.variants() if variant.label == "tailcut")
    kind, _, value = spec.partition("=")
    if kind == "shipped":
        return shipped
    if kind == "floor":
        budget = replace(shipped.scheduler.budget, min_tokens=int(value))
        return replace(shipped, label=spec, scheduler=replace(shipped.scheduler, budget=budget))
    if kind == "noshed":
        return replace(shipped, label=spec, shed=ShedLimits(background=0))
    raise SystemExit(f"unknown variant {spec!r}")


def print_floor(name: str, spec: str, load: float, rows: Rows) -> None:
    realtime, background = rows["realtime"], rows["background"]
    print(
        f"{name} {spec} {load}: realtime P99 E2E {realtime['p99_e2e_ms']:.0f} ms",
        f"attainment {realtime['attainment']:.4f}; background {background['output_tokens_per_s']:.0f}",
        f"tokens/s, refused {background['rejected']}; normal P99 TTFT {rows['normal']['p99_ttft_ms']:.0f} ms",
        flush=True,
    )


# --- yield: the simulator's engine patched ---


def patch_engine(mode: str, floor: int) -> None:
    step = simmod.SimEngine.step

    def yielding_step(self: Any) -> Any:
        cap = self.long_prefill_token_threshold
        if mode == "off" or cap <= 0:
            return step(self)
        pending = [
            request
            for request in self._running
            if request.priority <= REALTIME_PRIORITY
            and not request.decoding
            and request.num_computed_tokens < request.num_tokens
        ]
        pending += [
            request
            for _, _, request in getattr(self._waiting, "_heap", [])
            if request.state == "waiting" and request.priority <= REALTIME_PRIORITY and request.max_tokens > 1
        ]
        if not pending:
            return step(self)
        if mode == "global":
            longest = max(request.num_tokens - request.num_computed_tokens for request in pending)
            self.long_prefill_token_threshold = min(cap, max(floor, longest))
            try:
                return step(self)
            finally:
                self.long_prefill_token_threshold = cap
        paused = [
            request
            for request in self._running
            if request.priority > REALTIME_PRIORITY
            and not request.decoding
            and request.num_computed_tokens < request.num_tokens
            and request.state == "running"
        ]
        for request in paused:
            request.state = "paused"  # the step's loop passes over a request that is not "running"
        try:
            return step(self)
        finally:
            for request in paused:
                if request.state == "paused":
                    request.state = "running"

    if mode not in ("off", "global", "pause"):
        raise SystemExit(f"unknown YIELD_MODE {mode!r}")
    simmod.SimEngine.step = yielding_step  # type: ignore[method-assign]


def policy_variant(label: str) -> policies.Variant:
    return next(variant for variant in policies.variants() if variant.label == label)


def print_yield(name: str, label: str, load: float, rows: Rows) -> None:
    for tier, row in rows.items():
        print(
            name,
            label,
            load,
            tier,
            f"p99ttft {row['p99_ttft_ms']:.1f} p99e2e {row['p99_e2e_ms']:.0f} att {row['attainment']:.4f}",
            f"tok/s {row['output_tokens_per_s']:.0f} rej {row['rejected']}",
            flush=True,
        )


# --- both ---

EXPERIMENTS: dict[str, tuple[Callable[[str], policies.Variant], Callable[[str, str, float, Rows], None]]] = {
    "floor": (floor_variant, print_floor),
    "yield": (policy_variant, print_yield),
}


def one(job: tuple[str, str, str, float, float]) -> tuple[str, str, float, Rows]:
    experiment, name, spec, load, rate_rps = job
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    variant = EXPERIMENTS[experiment][0](spec)
    result = policies.run_job(policies.Job(variant, load, rate_rps, 0, 120.0, workload, cost))
    return name, spec, load, {row["tier"]: row for row in result.rows}


if __name__ == "__main__":
    experiment, names, specs, loads = sys.argv[1:5]
    if experiment == "yield":
        patch_engine(os.environ.get("YIELD_MODE", "off"), int(os.environ.get("YIELD_FLOOR", "64")))
    capacities = capacities_rps()
    jobs = [
        (experiment, name, spec, float(load), float(load) * capacities[name])
        for name in names.split(",")
        for spec in specs.split(",")
        for load in loads.split(",")
    ]
    # Forked, so the pool's processes run the patched engine.
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        for outcome in pool.map(one, jobs):
            EXPERIMENTS[experiment][1](*outcome)
