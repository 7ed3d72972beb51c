"""Lower-tier prefill as a flow instead of whole chunks (SIMULATOR; a side run of issue 12, not shipped).

At 100% on seed-mix the slowest 1% of realtime replies decode through steps 11% longer than the mean,
and most of the difference is background prefill (``slow_realtime_steps.py``): background is admitted
one prompt at a time in whole chunks, none is in prefill in a third of the steps although 160 wait on
average, and what it computes per step is uncorrelated with what the normal tier does. This variant
replaces the policy's admission by a flow: every round the lower tiers get ``L`` prompt tokens of the
step, ``L`` being their arrival rate and backlog at the current step time (the demand term of
``TailcutPolicy.room``) times ``1 + M``, optionally smoothed over ``fw`` ms and scaled by ``fs``
while the steps run slow; the engine's prefill chunk is ``L`` shared among the lower-tier prompts in
prefill (at least a realtime prompt of the quantile, so those still go in one step), and the step's
token budget is the decodes, the realtime prompts in prefill and ``L``. Lower-tier prompts are admitted
by count (``fn`` in prefill, ``fb`` of them background), realtime whenever its KV fits; the background
gate, the slow-step rule's hold and the KV preemptions are the shipped policy's.

Spec parts, ``+``-joined with any ``side_runs.py grid`` part: ``fluid=M`` (on, with margin M),
``fw=MS``, ``fs=F``, ``fn=N``, ``fb=N``, and ``gm=X`` (``background_gate_margin``, with or
without the flow: 1000 turns the realtime gate off). Constant sizes instead of the demand (each turns the
flow on by itself): ``fc=N``, the lower tiers get N prompt tokens every step; ``ft=C``, steps of one
time: they get what the step's decodes (``DECODE_SHARE`` of a prompt token each) and realtime prompts
leave of C tokens; ``ff``, the engine's chunk is the whole of ``L`` instead of its share per prompt (the
step's budget then cuts what the next prompt gets, so a step stays full when a prompt ends in it);
``fh=C``, steps of C tokens' time instead of ``ft``'s past what the worker serves (with ``ow=N``;
``fh=-1``: C is what ``side_runs.py``'s ``slo`` part learned, from its ``sl0=N``);
``fo``, the flow only past what the worker serves (``TailcutPolicy.overloaded``, with ``ow=N``), the
shipped policy otherwise; ``fd``, steps of one time at the demand: the flow's ``L`` plus the step's
decodes and realtime prompts, smoothed over ``fw``, is the step's whole time, and the lower tiers get
what the decodes and realtime prompts leave of it. From the repository root:

    SIDE_WORKLOADS=seed-mix SIDE_SUITE=docs/benchmarks/policies-suite-360s-capacity-30k/seed0/suite.json \\
      .venv/bin/python docs/benchmarks/policies-suite/side-fluid/fluid.py fluid=0.3 fluid=0.3+fw=30000

or ``fluid.py rows WORKLOAD VARIANT LOAD`` for one run's rows, as ``side_runs.py rows`` prints them, or
``fluid.py steps WORKLOAD VARIANT LOAD`` for the steps its slowest realtime replies decode through.
"""

import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import policies
from bench.workloads import workload_and_cost
from workers.scheduling import Decision

sys.path.insert(0, str(Path(__file__).parents[1]))
import side_runs  # type: ignore[import-not-found]

PARTS = ("fluid", "fw", "fs", "fn", "fb", "gm", "fc", "ff", "ft", "fo", "fd", "fx", "fh")
# A decode's share of a prompt token's step time in the cost model (h100-llama3-8b: 6.00 against 17.25 µs).
DECODE_SHARE = 6.00 / 17.25


@dataclass(frozen=True)
class Flow:
    margin: float
    window_ms: float = 0.0
    slow_factor: float = 0.0
    max_lower: int = 3
    max_background: int = 2
    constant: int = 0
    whole_chunk: bool = False
    step_tokens: int = 0
    only_overloaded: bool = False
    demand_time: bool = False
    exact_budget: bool = False
    overloaded_step_tokens: int = 0


def flow_of(spec: str) -> Flow | None:
    values = {key: value for key, _, value in (part.partition("=") for part in spec.split("+")) if key in PARTS}
    flags = set(spec.split("+"))
    if "fluid" not in values and "fc" not in values and "ft" not in values:
        return None
    return Flow(
        margin=float(values.get("fluid", 0)),
        window_ms=float(values.get("fw", 0)),
        slow_factor=float(values.get("fs", 0)),
        max_lower=int(values.get("fn", 3)),
        max_background=int(values.get("fb", 2)),
        constant=int(values.get("fc", 0)),
        whole_chunk="ff" in flags,
        step_tokens=int(values.get("ft", 0)),
        only_overloaded="fo" in flags,
        demand_time="fd" in flags,
        exact_budget="fx" in flags,
        overloaded_step_tokens=int(values.get("fh", 0)),
    )


def rest_of(spec: str) -> str:
    rest = [part for part in spec.split("+") if part.partition("=")[0] not in PARTS]
    return "+".join(rest) or "shipped"


def install(flow: Flow) -> None:
    policy = side_runs.schedmod.TailcutPolicy
    room, slow_steps = policy.room, policy.slow_steps

    def flow_room(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        config = self.config
        backlog = self._queued_tokens(list(self._normal()), view.backlog_of(tiers=("normal",)))
        backlog += self._queued_tokens(list(self._background), view.backlog_of(tiers=("background",)))
        rate = self._lower_rate.tokens_per_ms + backlog / config.backlog_drain_ms
        tokens = min(view.step_ms * rate * (1 + flow.margin), config.budget.max_tokens - sizes.decodes - sizes.reserve)
        if flow.constant:
            tokens = flow.constant
        if flow.demand_time:  # smooth the step's whole time (``fd``), not the lower tiers' share of it
            in_prefill = sum(count for count, tier in self._prefilling.values() if tier == "realtime")
            tokens += sizes.decodes * DECODE_SHARE + in_prefill
        if sizes.reserve == 0:  # realtime quiet: the lower tiers may fill the step
            tokens = config.budget.max_tokens - sizes.decodes
        if flow.window_ms:
            last = getattr(self, "side_flow_ms", None)
            if last is None:
                self.side_flow = tokens
            elif now_ms > last:
                self.side_flow += (1 - math.exp(-(now_ms - last) / flow.window_ms)) * (tokens - self.side_flow)
            self.side_flow_ms = now_ms
            tokens = self.side_flow
        if flow.slow_factor and getattr(self, "side_slow", False):
            tokens *= flow.slow_factor
        self.side_lower_tokens = max(int(tokens), 64)
        return sizes

    def flow_slow_steps(self: Any, step_ms: float, now_ms: int) -> bool:
        self.side_slow = slow_steps(self, step_ms, now_ms)
        return bool(self.side_slow)

    def flow_schedule(self: Any, view: Any, now_ms: int) -> Decision:
        self._admit_background = view.admit_background
        sizes = self.room(view, now_ms)
        tokens = self.side_lower_tokens
        slots, kv = view.free_slots, view.free_kv_tokens
        tiers = [tier for _, tier in self._prefilling.values()]
        num_lower = sum(1 for tier in tiers if tier != "realtime")
        num_background = tiers.count("background")
        realtime_tokens = sum(tokens for tokens, tier in self._prefilling.values() if tier == "realtime")
        admitted = []
        while slots > 0:
            if self._realtime.peek() is not None:
                if self._realtime.peek().reserved_kv_tokens(self.config) > kv:
                    break
                pick = self._realtime.pop()
            elif (normal := self._pick_normal()) is not None:
                if num_lower >= flow.max_lower or normal.reserved_kv_tokens(self.config) > kv:
                    self._normal_by_bucket[normal.bucket].push_front(
                        normal.tenant, normal, side_runs.schedmod._cost(normal)
                    )
                    break
                pick = normal
            else:
                background = self._background.peek() if self._admit_background else None
                if (
                    background is None
                    or sizes.background_held
                    or num_background >= flow.max_background
                    or num_lower >= flow.max_lower
                    or background.reserved_kv_tokens(self.config) > kv
                ):
                    break
                pick = self._background.pop()
            self._admit(pick, now_ms)
            admitted.append(pick)
            slots -= 1
            kv -= pick.reserved_kv_tokens(self.config)
            if pick.tier == "realtime":
                realtime_tokens += pick.prompt_tokens
            else:
                num_lower += 1
                num_background += pick.tier == "background"
        ceiling = self.config.budget.max_tokens
        if flow.demand_time and sizes.reserve:
            tokens = max(64, int(tokens - len(self._running) * DECODE_SHARE - realtime_tokens))
        step_tokens = flow.step_tokens
        if flow.overloaded_step_tokens and self._overloaded:
            step_tokens = flow.overloaded_step_tokens
            if step_tokens < 0:  # ``fh=-1``: the size ``side_runs.py``'s ``slo`` part learned
                step_tokens = max(1, int(self.side_extra))
        if step_tokens and sizes.reserve:
            # Steps of one time, not one prefill: the lower tiers get what the decodes and the realtime
            # prompts leave of ``ft`` prompt tokens' worth of step.
            tokens = max(64, int(step_tokens - len(self._running) * DECODE_SHARE - realtime_tokens))
        share = tokens if flow.whole_chunk else math.ceil(tokens / max(1, num_lower))
        chunk = min(ceiling, max(self._prompts["realtime"].size() or 0, share))
        # The engine runs the prompts in prefill before it admits the new realtime ones, so with one
        # token a prompt in prefill counted as a decode, the last lower-tier prompt takes the realtime
        # prompts' share when its chunk is the whole flow (``ff``); ``fx`` counts the decodes alone.
        decodes = len(self._running) - (len(self._prefilling) if flow.exact_budget else 0)
        budget = min(ceiling, decodes + realtime_tokens + tokens)
        decision = Decision(admit=admitted, token_budget=max(1, budget), prefill_chunk_tokens=chunk)
        decision.preempt = self._preemptions(slots, kv)
        for victim in decision.preempt:
            self._running.pop(victim.id, None)
            self._prefilling.pop(victim.id, None)
        return decision

    def schedule(self: Any, view: Any, now_ms: int, _shipped: Any = policy.schedule) -> Decision:
        if self.adapting and (self._overloaded or not flow.only_overloaded):
            return flow_schedule(self, view, now_ms)
        return _shipped(self, view, now_ms)

    policy.room = flow_room
    policy.slow_steps = flow_slow_steps
    policy.schedule = schedule


def steps(name: str, spec: str, load: float) -> None:
    """``slow_realtime_steps.py``'s report of one variant's run (the steps the slowest realtime replies
    decode through), on the suite's trace of ``name``; with the step time's and the lower tiers' prefill's
    spread over every busy step."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "policies-suite-360s-capacity-30k"))
    import slow_realtime_steps as report  # type: ignore[import-not-found]

    side_runs.patch_sizes(spec)
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    job = policies.Job(
        side_runs.grid_variant(spec),
        load,
        load * side_runs.capacities_rps()[name],
        side_runs.SEED,
        side_runs.DURATION_S,
        workload,
        cost,
    )
    replies, lines = report.run_with_steps(job)
    busy = [line["ms"] for line in lines if line["ms"] > 0]
    lower = [line["lower_prefill"] for line in lines if line["ms"] > 0]
    print(f"{name}, seed {job.seed}, {spec} at {load:.0%}:")
    print(report.report("top 1%", replies[len(replies) * 99 // 100 :], lines))
    print(report.report("all", replies, lines))
    print(
        f"  busy steps {statistics.mean(busy):.2f} ms (sd {statistics.stdev(busy):.2f}),",
        f"lower-tier prefill sd {statistics.stdev(lower):.0f} tokens",
    )


def main(specs: list[str]) -> None:
    patch_sizes, grid_variant = side_runs.patch_sizes, side_runs.grid_variant

    def patch(spec: str) -> None:
        flow = flow_of(spec)
        if flow is not None:
            install(flow)
        patch_sizes(rest_of(spec))

    def variant(spec: str) -> policies.Variant:
        shipped = grid_variant(rest_of(spec))
        scheduler = shipped.scheduler
        for key, _, value in (part.partition("=") for part in spec.split("+")):
            if key == "gm":
                scheduler = replace(scheduler, background_gate_margin=float(value))
        return replace(shipped, label=spec, scheduler=scheduler)

    side_runs.patch_sizes, side_runs.grid_variant = patch, variant
    if specs[0] == "rows":  # as ``side_runs.py rows WORKLOAD VARIANT LOAD``
        side_runs.grid_rows(specs[1], specs[2], float(specs[3]))
    elif specs[0] == "steps":
        steps(specs[1], specs[2], float(specs[3]))
    else:
        side_runs.run_grid(specs)


if __name__ == "__main__":
    main(sys.argv[1:])
