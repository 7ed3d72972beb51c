"""Side experiment for issue 12 (SIMULATOR, not shipped): priority-aware prefill chunks.

In an engine step that prefills a realtime prompt (engine priority 1 or less, waiting or mid-prefill),
``YIELD_MODE=global`` caps every prompt's chunk at max(YIELD_FLOOR, the longest pending realtime
prompt's remaining tokens) for that step only (one threshold per step: what a vLLM plugin could do by
wrapping the scheduler's ``schedule``); ``YIELD_MODE=pause`` gives lower-tier prompts in prefill no
chunk at all in such a step (the idea's bound, not buildable on vLLM as it ships). Run from the
repository root: ``YIELD_MODE=global YIELD_FLOOR=128 .venv/bin/python PATH sharegpt-chat fifo,tailcut 0.9``.
The capacities are the suite's (``suite.json``)."""

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench import policies
from bench.workloads import workload_and_cost
from workers.engines import sim as simmod

MODE = os.environ.get("YIELD_MODE", "off")
FLOOR = int(os.environ.get("YIELD_FLOOR", "64"))
REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of a realtime request (its summaries: 0)
_step = simmod.SimEngine.step


def step(self: Any) -> Any:
    cap = self.long_prefill_token_threshold
    if MODE == "off" or cap <= 0:
        return _step(self)
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
        return _step(self)
    if MODE == "global":
        longest = max(request.num_tokens - request.num_computed_tokens for request in pending)
        self.long_prefill_token_threshold = min(cap, max(FLOOR, longest))
        try:
            return _step(self)
        finally:
            self.long_prefill_token_threshold = cap
    if MODE == "pause":
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
            return _step(self)
        finally:
            for request in paused:
                if request.state == "paused":
                    request.state = "running"
    raise SystemExit(f"unknown YIELD_MODE {MODE!r}")


simmod.SimEngine.step = step  # type: ignore[method-assign]

CAPACITY_RPS = {
    "bursty": 101.32557066878044,
    "long-history": 55.87452244525838,
    "seed-mix": 101.32557066878044,
    "sharegpt-chat": 67.0454965361887,
}


def one(args: tuple[str, str, float]) -> tuple[str, str, float, list[dict[str, Any]]]:
    name, label, load = args
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    variant = next(variant for variant in policies.variants() if variant.label == label)
    job = policies.Job(variant, load, load * CAPACITY_RPS[name], 0, 120.0, workload, cost)
    return name, label, load, policies.run_job(job).rows


if __name__ == "__main__":
    jobs = [
        (name, label, float(load))
        for name in sys.argv[1].split(",")
        for label in sys.argv[2].split(",")
        for load in sys.argv[3].split(",")
    ]
    out = []
    with ProcessPoolExecutor(2) as pool:
        for name, label, load, rows in pool.map(one, jobs):
            for row in rows:
                print(
                    name,
                    label,
                    load,
                    row["tier"],
                    f"p99ttft {row['p99_ttft_ms']:.1f} p99e2e {row['p99_e2e_ms']:.0f} att {row['attainment']:.4f}",
                    f"tok/s {row['output_tokens_per_s']:.0f} rej {row['rejected']}",
                    flush=True,
                )
            out.append((name, label, load, rows))
    with open(os.environ.get("OUT", "yield.json"), "w") as file:
        json.dump(out, file)
