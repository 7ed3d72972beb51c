"""Side runs of issue 12 (SIMULATOR, not shipped): one policy variant at a time on the suite's traces
(seed 0, 120 virtual s, each workload's fifo capacity as ``suite.json`` recorded it; ``SIDE_SUITE=PATH``
names another suite run's ``suite.json``, whose seed, duration, capacities and baselines are used
instead). Run from the repository root as ``.venv/bin/python docs/benchmarks/policies-suite/side_runs.py``
(below: ``SIDE``); WORKLOADS, VARIANTS, POLICIES and LOADS are comma-separated:

``SIDE floor WORKLOADS VARIANTS LOADS``
    tailcut with a larger budget floor (``floor=N``: ``BudgetConfig.min_tokens``), without shedding
    background (``noshed``), with another background waiting bound (``shed=N``), or as shipped
    (``shipped``); one line per run (``side-floor-at-100/``).

``YIELD_MODE=global YIELD_FLOOR=128 SIDE yield WORKLOADS POLICIES LOADS``
    priority-aware prefill chunks (``side-prefill-yield/``), the simulator's engine patched for every
    policy named: in a step that prefills a realtime prompt (engine priority 1 or less, waiting or
    mid-prefill), ``YIELD_MODE=global`` caps every prompt's chunk at max(YIELD_FLOOR, the longest
    pending realtime prompt's remaining tokens) for that step only (one threshold per step: what a vLLM
    plugin could do by wrapping the scheduler's ``schedule``); ``YIELD_MODE=pause`` gives lower-tier
    prompts in prefill no chunk at all in such a step (the idea's bound, not buildable on vLLM as it
    ships); ``off``, the default, leaves the engine as it is. One line per run and tier.

``SIDE grid VARIANT [VARIANT ...]``
    tailcut's adaptive sizes changed together (``side-size-grid/``), each variant on the four shipped
    workloads at 90, 100 and 120%: ``+``-joined parts ``nr=F`` (the normal tier's room times F),
    ``ch=N`` (the prefill chunk raised to at least N instead of half the budget floor), ``dm=M`` (the
    lower tiers' demand margin; ``off``: no demand term), ``drain=MS`` (``backlog_drain_ms``),
    ``gmax=N`` (``background_gate_max_waiting``), ``shed=N`` (the background waiting bound), ``nw=MS``
    (the normal tier's wait bound, ``ShedLimits.normal_wait_ms``), ``sm=X`` and ``sk=N``
    (``slow_step_margin``, 0: off, and ``slow_step_room_chunks``), ``sb`` (the slow-step rule caps
    the room but does not hold background: ``slow_steps_keep_background``), ``sr=M`` (that cap is at
    least the lower tiers' arrival rate times ``1 + M`` plus a chunk, and background is held by the
    realtime gate only: ``slow_steps_keep_pace``), ``sw=N`` (the rule's recent steps are ``N`` usual
    steps long, not ``SLOW_STEP_ROUNDS``), ``st=F`` (the rule's cap is ``F`` times the lower tiers'
    usual prompt tokens in flight, not chunks: ``slow_steps_usual_room``), ``sq=N`` (the cap is ``N``
    chunks while fewer background requests wait than the gate's bound: ``slow_steps_short_queue``),
    ``rtr`` (a realtime prompt in prefill takes the reserve before the lower tiers' room:
    ``realtime_in_reserve``; ``rtrs``: only while the steps do not run slow; ``rtrc``: only while the
    step ceiling bounds the lower tiers' room, as the policy does since c0f651e), ``bf=N``
    (the budget rule's floor, ``BudgetConfig.min_tokens``; the chunk follows half of it unless ``ch``
    is given), ``prog`` (a prompt in prefill counts what is left of it, estimated from the rounds'
    clock and the step time, instead of its whole chunk), ``pace=M`` (the lower tiers' prefill room is
    their arrival rate and backlog times ``1 + M``, one chunk at least, with no other floor), ``tb=M``
    (background admitted on a credit that grows at the lower tiers' arrival rate times ``1 + M``:
    ``token_bucket``; ``tbn``: the normal tier waits on it too; ``tbo``: so does a background prompt
    the cut-in limit lets in), ``pipe`` (the next background prompt admitted behind one on its last
    chunk), ``occ=L`` (the lower tiers' arrival rate counts each prompt's chunk for its chunks plus L
    rounds: ``count_occupancy``), ``nq=MS`` (the normal tier may go past the lower tiers' limit by its
    backlog drained over MS: ``drain_normal``), ``rv=N`` (``realtime_reserve_tokens``), ``slice=N``
    (``slice_tokens``), ``ka=MS`` (the prefix keep-alive's ``ttl_ms``, 0: none), ``kvr=KIND``
    (``kv_reservation``), ``rtfifo`` (realtime and background waiting in arrival order, not shortest
    bucket first), ``bgsp`` / ``bgsq`` / ``bgpo`` (background shortest prompt first; the same with the
    backlog counted as that order drains it; least engine time per expected output token first:
    ``background_order``), ``ci=N`` (``max_cut_ins``), ``scf=F`` with ``scq=Q`` (past F of background's
    waiting bound, a prompt longer than the Q quantile of the last 1,000 background prompts is refused:
    ``selective_shedding``), ``nbq`` / ``nbqp`` (with no background traffic, realtime prefill takes the
    reserve first; ``nbqp``:
    and a realtime request short of a slot preempts running normal ones: ``without_background``),
    ``ntb`` (a normal prompt waiting for room preempts background prompts in prefill:
    ``normal_takes_background_prefill``; ``ntbu``, ``ntbw=MS``, ``ntbh``: the same with a condition,
    ``normal_takes_background_prefill`` the function),
    ``ow=N`` (``overload_background_waiting``, 0: off), ``ov=N`` / ``ovn=N`` / ``ovb=N`` / ``ovc=N`` with
    ``ovr=N``, ``ovk=N``, ``ovx=N`` (the overload rule's forms tried before it was built:
    ``overload_room``), ``owr`` (realtime chunks take the reserve first while overloaded), ``owt=MS``
    (the rule entered only after MS of the queue at its threshold: ``overload_after``), ``ows`` (the
    slow-step rule's cap still holds while overloaded: ``overload_keeps_slow_steps``), ``owc`` (while
    overloaded only the engine's chunk is the configured one, the adaptive room kept:
    ``overload_chunk_only``; ``owm``: that room at most the budget rule's; with either, ``owk=N``:
    the slow-step rule's cap N chunks while overloaded, ``own``: no normal room then, ``owx=N``: the
    cap N tokens above the budget rule's room, ``owq``: the chunk then keeps realtime prompts whole,
    ``owl``: realtime chunks beyond the configured reserve then do not count against the room),
    ``slo=MS`` with ``slq``, ``slk``, ``slg``, ``slp``, ``sll``, ``sl0``, ``slc`` (a size learned from
    the realtime replies against a configured E2E objective of MS: ``slo_controlled_room``),
    ``noadapt``
    (the policy before issue 12), ``shipped`` (the policy as it ships now: since 10df589 with the
    slow-step rule on, so the sections of BENCHMARKS.md written before it ran ``shipped`` as ``sm=0``
    does now; on 8b1abc5–be00189 with the overload rule at 176, which is off by default since:
    ``ow=176`` turns it on).
    ``SIDE_WORKLOADS=seed-mix`` runs only the workloads named; ``SIDE_CHECKS_OUT=PATH`` appends each
    variant's targets, every one with its value, to PATH as a JSON line. One line per variant: the suite's targets
    (``bench.policies.check_targets``) with the baselines' rows of each workload's ``results.json``, the
    misses, seed-mix's figures, and (on this folder's traces) those that fell below the policy before
    issue 12's.

``SIDE timeline WORKLOAD VARIANT LOAD [BIN_S]``
    one grid variant's run of one workload at one load, per ``BIN_S`` (10) seconds of arrivals: the
    realtime replies sent then, their P99 E2E and how many are over the whole run's P99, and over the
    scheduler's rounds then, the share spent past what the worker serves (``overloaded``), background
    waiting (least and most), the lower tiers' prefill room and the step time (``timeline``).

``SIDE rows WORKLOAD VARIANT LOAD``
    one grid variant's run of one workload at one load: every tier's row of it (one JSON line each),
    and what held background back (``grid_rows``). WORKLOAD may be a workload file's path, with
    ``SIDE_CAPACITY=RPS`` its fifo capacity (as ``tailcut bench policies --workload PATH`` measured it).
"""

import bisect
import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from admission.shedding import ShedLimits
from bench import policies
from bench.simrun import simulate
from bench.stats import RequestRecord, field_of, summarize
from bench.workloads import make_trace, workload_and_cost
from queues.keys import Tier
from workers import scheduler as schedmod
from workers.budget import PrefillRate, PromptLengths, TimeAverage
from workers.engines import sim as simmod
from workers.engines.costmodel import PROFILES

# The suite run whose traces, capacities and baselines the side runs use: this folder's (seed 0, 120
# virtual s) unless ``SIDE_SUITE`` names another ``suite.json`` (its seed and duration are used too).
SUITE = Path(os.environ.get("SIDE_SUITE", Path(__file__).with_name("suite.json")))
SUITE_WORKLOADS = json.loads(SUITE.read_text())["workloads"]
SEED, DURATION_S = int(SUITE_WORKLOADS[0]["seed"]), float(SUITE_WORKLOADS[0]["duration_s"])
REALTIME_PRIORITY = 1  # TailcutPolicy.engine_priority of a realtime request (its summaries: 0)
Rows = dict[str, dict[str, Any]]


def capacities_rps() -> dict[str, float]:
    return {entry["name"]: entry["capacity_rps"] for entry in SUITE_WORKLOADS}


# The 360-second suite runs whose traces the per-seed side scripts replay (``seed_job``).
SEED_SUITES = Path(__file__).parents[1] / "policies-suite-360s-capacity-30k"


def seed_job(name: str, spec: str, seed: int, *, load: float = 0.9) -> policies.Job:
    """A grid variant's run of one shipped workload at ``load`` of seed ``seed``'s suite capacity, on that
    suite's 360-second trace (``patch_sizes(spec)`` is the caller's)."""
    entries = json.loads((SEED_SUITES / f"seed{seed}" / "suite.json").read_text())["workloads"]
    entry = next(entry for entry in entries if entry["name"] == name)
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    rate_rps = load * entry["capacity_rps"]
    return policies.Job(grid_variant(spec), load, rate_rps, seed, entry["duration_s"], workload, cost)


# --- floor: variants of the policy's configuration ---


def floor_variant(spec: str) -> policies.Variant:
    shipped = next(variant for variant in policies.variants() if variant.label == "tailcut")
    kind, _, value = spec.partition("=")
    if kind == "shipped":
        return shipped
    if kind == "floor":
        budget = replace(shipped.scheduler.budget, min_tokens=int(value))
        return replace(shipped, label=spec, scheduler=replace(shipped.scheduler, budget=budget))
    if kind in ("noshed", "shed"):  # noshed: shed=0, no bound
        return replace(shipped, label=spec, shed=ShedLimits(background=int(value or 0)))
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


# --- grid: the adaptive sizes changed together ---

GRID_NAMES = tuple(os.environ.get("SIDE_WORKLOADS", "seed-mix,bursty,sharegpt-chat,long-history").split(","))
GRID_LOADS = (0.9, 1.0, 1.2)
TOKENS = "output_tokens_per_s"
# seed-mix under the policy before issue 12 (``noadapt``, the suite's run of ea402cb): (figure, +1 if
# higher is better); a variant "keeps" a figure within 0.0006 of it.
SEED_MIX_BEFORE = {
    "realtime P99 TTFT / fifo at 90%": (0.190, -1),
    "realtime P99 E2E / floor at 90%": (1.097, -1),
    "background / fifo at 90%": (0.9945, 1),
    "realtime P99 E2E / vllm-priority at 100%": (0.839, -1),
    "background / vllm-priority at 100%": (0.927, 1),
    "realtime attainment at 100%": (0.9986, 1),
    "realtime attainment at 120%": (0.9994, 1),
}


def patch_sizes(spec: str) -> None:
    """Patch ``workers.scheduler`` for one grid variant (in the forked process that runs it)."""
    policy = schedmod.TailcutPolicy
    options = dict(part.partition("=")[::2] for part in spec.split("+"))
    for part in spec.split("+"):
        key, _, value = part.partition("=")
        if key == "nr":
            share, normal_room = float(value), policy.normal_room_tokens
            policy.normal_room_tokens = lambda self, _o=normal_room, f=share: int(_o(self) * f)  # type: ignore[method-assign,misc]
        elif key == "dm":
            schedmod.DEMAND_MARGIN = -1.0 if value == "off" else float(value)  # -1: the term is one chunk
        elif key == "ch":

            def chunk(self: Any, floor: int = int(value)) -> int:
                config = self.config
                if not config.prefill_chunk_tokens or not config.adaptive:
                    return int(config.prefill_chunk_tokens)
                seen = self._prompts["realtime"].size() or 0
                return int(max(config.prefill_chunk_tokens, min(max(seen, floor), config.budget.max_tokens // 2)))

            policy.prefill_chunk_tokens = property(chunk)  # type: ignore[assignment,method-assign]
        elif key == "prog":
            count_progress()
        elif key == "pace":
            pace_lower_tiers(float(value))
        elif key == "pipe":
            pipeline_background()
        elif key == "nq":
            drain_normal(float(value))
        elif key == "uw":
            usual_steps_warm_start()
        elif key == "occ":
            count_occupancy(float(value))
        elif key == "sb":
            slow_steps_keep_background()
        elif key == "sr":
            slow_steps_keep_pace(float(value))
        elif key == "sw":
            schedmod.SLOW_STEP_ROUNDS = int(value)
        elif key == "st":
            slow_steps_usual_room(float(value))
        elif key == "sq":
            slow_steps_short_queue(int(value))
        elif key == "rtr":
            realtime_in_reserve(unless_slow=False)
        elif key == "rtrs":
            realtime_in_reserve(unless_slow=True)
        elif key == "rtrc":
            realtime_in_reserve(unless_slow=False, at_ceiling=True)
        elif key in ("ntbu", "ntbw", "ntbh"):
            normal_takes_background_prefill(key, value)
        elif key in ("nbq", "nbqp"):
            without_background(preempt_normal=key == "nbqp")
        elif key == "rtfifo":
            # Realtime (and background) in arrival order only, not shortest bucket first.
            schedmod._urgency = lambda request: (request.arrival_ms,)
        elif key in ("bgsp", "bgpo", "bgsq"):
            background_order(key)
        elif key == "scf":
            selective_shedding(float(value), quantile=float(options.get("scq", 0.5)))
        elif key in ("ov", "ovn", "ovb", "ovc"):
            overload_room(
                key,
                int(value),
                extra=int(options.get("ovr", 0)),
                chunk_tokens=int(options.get("ovk", 0)),
                leave=int(options.get("ovx", int(value) // 2)),
            )
        elif key == "owr":
            overload_reserve_first()
        elif key == "owt":
            overload_after(int(value))
        elif key == "ows":
            overload_keeps_slow_steps()
        elif key in ("owc", "owm"):
            overload_chunk_only(
                capped=key == "owm",
                slow_chunks=int(options.get("owk", 0)),
                no_normal_room="own" in options,
                extra=int(options.get("owx", 0)),
                whole_realtime="owq" in options,
                lend_beyond_reserve="owl" in options,
            )
        elif key == "slo":
            slo_controlled_room(
                float(value),
                float(options.get("slq", 0.005)),
                float(options.get("slk", 1.0)),
                int(options.get("slg", 176)),
                project=float(options.get("slp", 0.0)),
                start=float(options.get("sl0", 0.0)),
                control_only="slc" in options,
                long_share=float(options.get("sll", 0.0)),
            )
        elif key == "tb":
            parts = spec.split("+")
            token_bucket(float(value), normal_waits="tbn" in parts, cut_ins_wait="tbo" in parts)


def budget_room(policy: Any, view: Any, now_ms: int) -> int:
    """What the budget rule leaves above the running decodes and the configured reserve (the room
    ``TailcutPolicy.room`` starts from, and the shipped overload rule's)."""
    return int(policy.current_budget(view, now_ms) - len(policy._running) - policy.config.realtime_reserve_tokens)


def past(was: bool, waiting: int, enter: int, leave: int) -> bool:
    """A gate with hysteresis: open from ``enter`` background requests waiting until ``leave`` or fewer do."""
    return waiting > leave if was else waiting >= enter


def overload_room(kind: str, threshold: int, *, extra: int, chunk_tokens: int, leave: int) -> None:
    """While ``threshold`` or more background requests wait (until ``ovx=N``, by default half as many,
    do), the worker is taken to be past what it serves: ``ov``, the room is the budget rule's alone (no normal room, no
    demand term, no realtime gate, no slow-step rule: the policy before issue 12's room, with the
    adaptive chunk and reserve); ``ovn``, only the normal tier's room goes; ``ovb``, the room is
    the budget rule's but the slow-step rule still caps it; ``ovc``, as ``ov`` with the configured
    chunk (the policy before issue 12 while it lasts), or ``ovk=N``'s; ``ovr=N`` adds N tokens to that room."""
    policy = schedmod.TailcutPolicy
    room, chunk = policy.room, policy.prefill_chunk_tokens

    def chunking(self: Any) -> int:
        if self.__dict__.get("side_over") and self.adapting:
            return chunk_tokens or int(self.config.prefill_chunk_tokens)
        return int(chunk.fget(self))  # type: ignore[attr-defined]

    if kind == "ovc":
        policy.prefill_chunk_tokens = property(chunking)  # type: ignore[assignment,method-assign]

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        waiting = background_waiting(self, view)
        over = self.side_over = past(self.__dict__.get("side_over", False), waiting, threshold, leave)
        if not over or not self.adapting or not sizes.chunk:
            return sizes
        if kind == "ovn":
            return replace(sizes, normal_room=0)
        lower = max(budget_room(self, view, now_ms) + extra, sizes.chunk)
        if kind == "ovb" and sizes.background_held:
            lower = min(lower, sizes.lower_prefill)
        return replace(sizes, lower_prefill=lower, normal_room=0, background_held=False, at_ceiling=False)

    policy.room = sizing  # type: ignore[method-assign]


def background_order(kind: str) -> None:
    """Background waits shortest prompt first (``bgsp``) or least engine time per output token first
    (``bgpo``: the prompt and the output the worker expects at the grid's cost model, in hundredths of a
    µs), arrival order among equals; realtime keeps shortest bucket first."""
    plain = schedmod._urgency
    cost = PROFILES["h100-llama3-8b"]  # the profile grid_report runs
    prompt_us, output_us = round(100 * cost.prefill_token_us), round(100 * cost.decode_seq_us)

    def urgency(request: Any) -> tuple[int, ...]:
        if request.tier != "background":
            return plain(request)
        if kind in ("bgsp", "bgsq"):
            return (schedmod.BUCKET_RANK[request.bucket], request.prompt_tokens, request.arrival_ms)
        expected = request.predicted_remaining_tokens or request.remaining_tokens
        per_token = (prompt_us * request.prompt_tokens + output_us * max(1, expected)) // max(1, expected)
        return (schedmod.BUCKET_RANK[request.bucket], per_token, request.arrival_ms)

    schedmod._urgency = urgency
    if kind != "bgsq":
        return

    def queued_tokens(self: Any, here: list[Any], num_elsewhere: int) -> int:
        # The backlog as the shortest first will drain it: the requests admitted next, not the
        # longest ones the order leaves waiting.
        if not here:
            return 0
        counted = min(len(here) + num_elsewhere, self.config.backlog_max_requests)
        lengths = sorted(request.prompt_tokens for request in here)
        first = sum(lengths[:counted])
        return first + max(0, counted - len(lengths)) * sum(lengths) // len(lengths)

    schedmod.TailcutPolicy._queued_tokens = queued_tokens  # type: ignore[method-assign]


def selective_shedding(share: float, *, quantile: float) -> None:
    """Past ``share`` of background's waiting bound, a background request whose prompt is longer than
    the ``quantile`` of the last 1,000 background prompts that came is refused (429) as at the bound:
    near the bound the costliest prompts go first, the cheap ones keep coming in."""
    from admission import admitter as admod
    from tailcut.errors import OverloadedError

    plain = admod.Admitter.admit_tokens
    lengths = PromptLengths(window=1000, quantile=quantile, grain=1, min_samples=1, shrink_tokens=1)

    def admit_tokens(self: Any, request: Any, **kwargs: Any) -> Any:
        tier = self.tier_of(request)
        depth, limit = self._queue_depth, self.config.shed.limit("background")
        if tier == "background" and depth is not None and limit > 0:
            prompt = len(request.prompt.token_ids)
            lengths.observe(prompt)
            cut = lengths.size()
            if depth.waiting(tier) >= share * limit and cut is not None and prompt > cut:
                raise OverloadedError("background queue near its bound; a costly prompt", tier=tier, retry_after_s=1)
        return plain(self, request, **kwargs)

    admod.Admitter.admit_tokens = admit_tokens  # type: ignore[method-assign]


def overload_reserve_first() -> None:
    """Past what the worker serves (``TailcutPolicy.overloaded``), realtime chunks in flight take the
    reserve before the lower tiers' room, as they do where the step ceiling bounds it (``Room.at_ceiling``)."""
    policy = schedmod.TailcutPolicy
    room = policy.room

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        return replace(sizes, at_ceiling=True) if self._overloaded else sizes

    policy.room = sizing  # type: ignore[method-assign]


def overload_keeps_slow_steps() -> None:
    """Past what the worker serves (``TailcutPolicy.overloaded``), the lower tiers' room is still at
    most ``slow_step_room_chunks`` chunks while the steps run slow (``slow_steps``): the fixed room
    then gives way to the replies decoding through a stretch of slow steps, as the adaptive room does."""
    policy = schedmod.TailcutPolicy
    room, slow_steps = policy.room, policy.slow_steps

    def slowing(self: Any, step_ms: float, now_ms: int) -> bool:
        slow = bool(slow_steps(self, step_ms, now_ms))
        self.side_slow = slow
        return slow

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        if not (self._overloaded and self.__dict__.get("side_slow") and sizes.chunk):
            return sizes
        cap = sizes.chunk * self.config.slow_step_room_chunks
        return replace(sizes, lower_prefill=min(sizes.lower_prefill, cap))

    policy.slow_steps = slowing  # type: ignore[method-assign]
    policy.room = sizing  # type: ignore[method-assign]


def overload_chunk_only(
    *,
    capped: bool,
    slow_chunks: int = 0,
    no_normal_room: bool = False,
    extra: int = 0,
    whole_realtime: bool = False,
    lend_beyond_reserve: bool = False,
) -> None:
    """Past what the worker serves (``TailcutPolicy.overloaded``), only the engine's chunk changes (to
    the configured one): the room keeps every adaptive rule (demand term, normal room, gate, slow-step
    cap), so the lower tiers fill it in several chunks a step where it is larger than one; ``capped``
    (``owm``), that room at most the budget rule's (the rule's own room while overloaded);
    ``slow_chunks`` (``owk=N``), the slow-step rule's cap then N chunks, not ``slow_step_room_chunks``;
    ``no_normal_room`` (``own``), no room held for the normal tier then; ``extra`` (``owx=N``), the cap
    N tokens above the budget rule's room; ``whole_realtime`` (``owq``), the chunk then the larger of the
    configured one and the realtime prompts' quantile (as the engine computes them), so those stay whole;
    ``lend_beyond_reserve`` (``owl``), realtime chunks in flight beyond the configured reserve then do not
    count against the lower tiers' room (the step grows for them, as it does past the budget)."""
    policy = schedmod.TailcutPolicy
    overloaded, room, chunk = policy.overloaded, policy.room, policy.prefill_chunk_tokens

    def state_only(self: Any, background_waiting: int) -> bool:
        overloaded(self, background_waiting)
        return False

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        if slow_chunks and self._overloaded:
            config = self.config
            self.config = replace(config, slow_step_room_chunks=slow_chunks)
            try:
                sizes = room(self, view, now_ms)
            finally:
                self.config = config
        else:
            sizes = room(self, view, now_ms)
        if not (self._overloaded and sizes.chunk):
            return sizes
        if no_normal_room:
            sizes = replace(sizes, normal_room=0)
        if capped:
            cap = max(budget_room(self, view, now_ms) + extra, sizes.chunk)
            sizes = replace(sizes, lower_prefill=min(sizes.lower_prefill, cap))
        if lend_beyond_reserve:
            values = {field.name: getattr(sizes, field.name) for field in fields(sizes)}
            return LendingRoom(**values, lend_beyond=self.config.realtime_reserve_tokens)
        return sizes

    def chunking(self: Any) -> int:
        configured = self.config.prefill_chunk_tokens
        if not (whole_realtime and self._overloaded and configured and self.adapting):
            return int(chunk.fget(self))  # type: ignore[attr-defined]
        seen = self._prompts["realtime"].size() or 0
        return int(max(configured, min(seen, self.config.budget.max_tokens // 2)))

    policy.overloaded = state_only  # type: ignore[method-assign]
    policy.room = sizing  # type: ignore[method-assign]
    policy.prefill_chunk_tokens = property(chunking)  # type: ignore[assignment,method-assign]


def slo_controlled_room(
    slo_ms: float,
    miss_share: float,
    gain: float,
    gate: int,
    *,
    project: float = 0.0,
    long_share: float = 0.0,
    start: float = 0.0,
    control_only: bool = False,
) -> None:
    """``slo=MS``: a worker told its operator's realtime E2E objective (MS: a setting of the worker,
    never the workload's table) spends what its realtime replies leave of it on the lower tiers. A
    size is learned from the realtime replies that finish: ``gain`` tokens up (``slk=G``, default 1)
    for each that met MS, ``gain · (1 − q) / q`` down for each that did not, so the share that misses
    settles at ``q`` (``slq=Q``, default 0.005). A reply met MS if its E2E (the scheduler's clock at
    the next round, minus its enqueue time) was within it; with ``slp=P``, if its TTFT plus its own
    pace per token times the ``P`` quantile of the last 1,000 realtime replies' lengths (the longest
    replies, which are the ones that miss) was, and with ``sll=F`` only replies at least ``F`` times
    that length count. The size acts, and learns, only while ``gate`` (``slg=N``, default 176) or more
    background requests wait, until half as many do; it starts at ``sl0=N`` (default 0). It is added
    to the lower tiers' prefill room, or with ``slc`` it is only learned, for ``side-fluid/fluid.py``'s
    ``fh=-1`` (steps of that many tokens' time past what the worker serves)."""
    policy = schedmod.TailcutPolicy
    room, finish, schedule = policy.room, policy.finish, policy.schedule
    advance, prefilled = policy.advance, policy.prefilled
    step_down = gain * (1 - miss_share) / miss_share

    def advancing(self: Any, request_id: str, num_generated: int) -> None:
        generated = self.__dict__.setdefault("side_generated", {})
        generated[request_id] = generated.get(request_id, 0) + num_generated
        advance(self, request_id, num_generated)

    def first_token(self: Any, request_id: str) -> None:
        self.__dict__.setdefault("side_first", {}).setdefault(request_id, self.__dict__.get("side_now", 0))
        prefilled(self, request_id)

    def finishing(self: Any, request_id: str, request: Any = None) -> None:
        running = self._running.get(request_id)
        num = self.__dict__.get("side_generated", {}).pop(request_id, 0)
        first = self.__dict__.get("side_first", {}).pop(request_id, None)
        if running is not None and running.tier == "realtime" and (request is None or running is request):
            self.__dict__.setdefault("side_done", []).append((running.arrival_ms, first, num))
        finish(self, request_id, request)

    def projected_miss(self: Any, now_ms: int, arrival_ms: int, first: Any, num: int) -> bool | None:
        if not project or first is None or num < 2:
            return bool(now_ms - arrival_ms > slo_ms)
        lengths = self.__dict__.get("side_lengths")
        if lengths is None:  # the replies' lengths, exactly (no blocks, no hysteresis)
            lengths = self.side_lengths = PromptLengths(
                window=1000, quantile=project, grain=1, min_samples=1, shrink_tokens=1
            )
        lengths.observe(num)
        longest = lengths.size() or num
        if num < long_share * longest:
            return None  # too short a life to say how the longest replies fare
        pace = (now_ms - first) / (num - 1)
        return bool(first - arrival_ms + pace * (max(longest, num) - 1) > slo_ms)

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        self.side_now = now_ms
        done, self.side_done = self.__dict__.get("side_done", []), []
        if self.__dict__.get("side_gated", False):
            extra = self.side_extra
            for arrival_ms, first, num in done:
                missed = projected_miss(self, now_ms, arrival_ms, first, num)
                if missed is not None:
                    extra += -step_down if missed else gain
            self.side_extra = min(max(extra, 0.0), float(self.config.budget.max_tokens))
        return schedule(self, view, now_ms)

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        gated = self.side_gated = past(
            self.__dict__.get("side_gated", False), background_waiting(self, view), gate, gate // 2
        )
        extra = int(self.__dict__.setdefault("side_extra", start))
        if control_only or not (gated and extra and sizes.chunk and self.adapting):
            return sizes
        most = sizes.ceiling - sizes.decodes - sizes.reserve
        return replace(sizes, lower_prefill=max(sizes.lower_prefill, min(sizes.lower_prefill + extra, most)))

    policy.finish = finishing  # type: ignore[method-assign]
    policy.advance = advancing  # type: ignore[method-assign]
    policy.prefilled = first_token  # type: ignore[method-assign]
    policy.schedule = scheduling  # type: ignore[method-assign]
    policy.room = sizing  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class LendingRoom(schedmod.Room):
    """``owl``'s room past what the worker serves: realtime chunks in flight beyond ``lend_beyond``
    tokens do not count against the lower tiers' room."""

    lend_beyond: int = 0

    def lower_spent(self, spent: Any) -> int:
        lent = max(0, int(spent.chunks["realtime"]) - self.lend_beyond)
        return int(schedmod.Room.lower_spent(self, spent)) - lent


def overload_after(dwell_ms: int) -> None:
    """The overload rule (``ow=N``) entered only once N or more background requests have waited for
    ``dwell_ms`` of the scheduler's clock without a break: a burst fills the queue as fast as a load
    past what the worker serves, but does not keep it full."""
    policy = schedmod.TailcutPolicy
    room = policy.room

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        self.side_now_ms = now_ms
        return room(self, view, now_ms)

    def overloaded(self: Any, background_waiting: int) -> bool:
        threshold = self.config.overload_background_waiting
        if self._overloaded:
            self._overloaded = background_waiting > threshold // 2
        elif 0 < threshold <= background_waiting:
            since = self.__dict__.get("side_above_since")
            if since is None:
                since = self.side_above_since = self.side_now_ms
            self._overloaded = self.side_now_ms - since >= dwell_ms
        else:
            self.side_above_since = None
        if self._overloaded:
            self.side_above_since = None
        return bool(self._overloaded)

    policy.room = sizing  # type: ignore[method-assign]
    policy.overloaded = overloaded  # type: ignore[method-assign]


def normal_takes_background_prefill(kind: str, value: str) -> None:
    """Variants of ``normal_takes_background_prefill`` (which ``grid_variant`` turns on for each):
    ``ntbu``, a normal prompt takes background's room only while background is not held (the realtime
    gate, the slow-step rule); ``ntbw=MS``, only once it has waited ``MS``; ``ntbh``, background then
    waits until that normal prompt's prefill is done."""
    policy = schedmod.TailcutPolicy
    victims_for = policy._background_prefill_for_normal
    fits = policy._fits

    def choosing(self: Any, slots: int, kv: int, room: Any, spent: Any, admitted: Any) -> Any:
        normal = next(self._normal(), None)
        if kind == "ntbu" and room.background_held:
            return []
        if kind == "ntbw" and normal is not None and self.side_now_ms - normal.arrival_ms < int(value):
            return []
        victims = victims_for(self, slots, kv, room, spent, admitted)
        if kind == "ntbh" and victims and normal is not None:
            self.__dict__.setdefault("side_took", set()).add(normal.id)
        return victims

    def fitting(self: Any, request: Any, kv: int, room: Any, spent: Any, first: bool, *, overdue: bool = False) -> bool:
        took = self.__dict__.get("side_took")
        if request.tier == "background" and took:
            took &= self._prefilling.keys()
            if took:
                return False
        return bool(fits(self, request, kv, room, spent, first, overdue=overdue))

    schedule = policy.schedule

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        self.side_now_ms = now_ms
        return schedule(self, view, now_ms)

    policy._background_prefill_for_normal = choosing  # type: ignore[method-assign]
    policy.schedule = scheduling  # type: ignore[method-assign]
    if kind == "ntbh":
        policy._fits = fitting  # type: ignore[method-assign]


def background_waiting(policy: Any, view: Any) -> int:
    """Background requests waiting, here and in the intake streams, as ``TailcutPolicy.room`` counts them."""
    return int(len(policy._background) + view.backlog_of(tiers=("background",)))


def record_slow_steps(*, acts: bool) -> None:
    """``slow_steps`` also keeps its answer on the policy (``side_slow``) for a variant to read; with
    ``acts`` off it answers ``False`` to ``room``, so the shipped cap and hold stay out of it."""
    slow_steps = schedmod.TailcutPolicy.slow_steps

    def slowing(self: Any, step_ms: float, now_ms: int) -> bool:
        self.side_slow = slow_steps(self, step_ms, now_ms)
        return bool(self.side_slow) and acts

    schedmod.TailcutPolicy.slow_steps = slowing  # type: ignore[method-assign]


def slow_steps_keep_background() -> None:
    """While the steps run slow (``slow_steps``) the lower tiers' room is capped as shipped, but
    background is held only by the realtime gate, as with the rule off."""
    policy = schedmod.TailcutPolicy
    room = policy.room

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        if not sizes.background_held:
            return sizes
        config = self.config
        num_realtime = sum(1 for request in self._running.values() if request.tier == "realtime")
        waiting = background_waiting(self, view)
        gated = num_realtime > self._realtime_in_flight.value * (1 + config.background_gate_margin)
        return replace(sizes, background_held=gated and waiting < config.background_gate_max_waiting)

    policy.room = sizing  # type: ignore[method-assign]


def slow_steps_keep_pace(margin: float) -> None:
    """While the steps run slow (``slow_steps``) the lower tiers' room is capped at
    ``slow_step_room_chunks`` chunks or their arrival rate at the current step time times
    ``1 + margin`` plus a chunk, whichever is more: a stretch of large steps takes no more than
    the lower tiers bring, so their backlog does not grow through it (the rule as shipped caps at the
    chunks alone)."""
    policy = schedmod.TailcutPolicy
    room = policy.room
    record_slow_steps(acts=False)

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        if not getattr(self, "side_slow", False) or not sizes.chunk:
            return sizes
        pace = view.step_ms * self._lower_rate.tokens_per_ms * (1 + margin) + sizes.chunk
        cap = max(sizes.chunk * self.config.slow_step_room_chunks, int(pace))
        return replace(sizes, lower_prefill=min(sizes.lower_prefill, cap))

    policy.room = sizing  # type: ignore[method-assign]


def slow_steps_usual_room(share: float) -> None:
    """While the steps run slow (``slow_steps``) the lower tiers' room is capped at ``share`` times
    their prompt tokens in flight averaged over ``slow_step_window_ms`` (one chunk at least), instead of
    ``slow_step_room_chunks`` chunks: a cap in the workload's own tokens, not in chunks, whose size
    follows the realtime prompts."""
    policy = schedmod.TailcutPolicy
    room = policy.room
    record_slow_steps(acts=False)

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        usual = self.__dict__.get("_side_in_flight")
        if usual is None:
            usual = self.__dict__["_side_in_flight"] = TimeAverage(window_ms=self.config.slow_step_window_ms)
        in_flight = sum(self._chunk(tokens, sizes) for tokens, tier in self._prefilling.values() if tier != "realtime")
        average = usual.update(now_ms, in_flight)
        if not getattr(self, "side_slow", False) or not sizes.chunk:
            return sizes
        cap = max(sizes.chunk, int(share * average))
        held = sizes.background_held or background_waiting(self, view) < self.config.background_gate_max_waiting
        return replace(sizes, lower_prefill=min(sizes.lower_prefill, cap), background_held=held)

    policy.room = sizing  # type: ignore[method-assign]


def slow_steps_short_queue(num_chunks: int) -> None:
    """While the steps run slow (``slow_steps``) and fewer background requests wait than the
    background gate's bound (``background_gate_max_waiting``), the lower tiers' room is capped at
    ``num_chunks`` chunks instead of ``slow_step_room_chunks``: a short queue can wait out the stretch
    without reaching the bound where background is refused, a long one cannot."""
    policy = schedmod.TailcutPolicy
    room = policy.room
    record_slow_steps(acts=True)

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        if not getattr(self, "side_slow", False) or not sizes.chunk:
            return sizes
        if background_waiting(self, view) >= self.config.background_gate_max_waiting:
            return sizes
        return replace(sizes, lower_prefill=min(sizes.lower_prefill, sizes.chunk * num_chunks))

    policy.room = sizing  # type: ignore[method-assign]


def realtime_in_reserve(*, unless_slow: bool, at_ceiling: bool = False) -> None:
    """A realtime prompt in prefill takes the realtime reserve first and the lower tiers' room only with
    what the reserve does not hold: a lower-tier prompt fits while the decodes, the lower tiers' chunks
    and the realtime chunks beyond the reserve stay within ``lower_limit`` (as shipped, every realtime
    chunk in flight counts against it, so the reserve is headroom for realtime prompts still to come).
    ``unless_slow``: only while the steps do not run slow (``slow_steps``); ``at_ceiling``: only while
    the lower tiers' room is what the step ceiling leaves above the decodes and the reserve."""
    policy = schedmod.TailcutPolicy
    fits = policy._fits
    if unless_slow:
        record_slow_steps(acts=True)

    def fitting(self: Any, request: Any, kv: int, room: Any, spent: Any, first: bool, *, overdue: bool = False) -> bool:
        held = (unless_slow and getattr(self, "side_slow", False)) or (at_ceiling and not room.at_ceiling)
        if request.tier == "realtime" or not self.adapting or held:
            return bool(fits(self, request, kv, room, spent, first, overdue=overdue))
        covered = min(spent.chunks["realtime"], room.reserve)
        lent = schedmod.Spent(spent.decodes, {**spent.chunks, "realtime": spent.chunks["realtime"] - covered})
        # The policy's own rule (at the ceiling, since c0f651e) is this one's ``rtrc``: not applied twice.
        return bool(fits(self, request, kv, replace(room, at_ceiling=False), lent, first, overdue=overdue))

    policy._fits = fitting  # type: ignore[method-assign]


def without_background(*, preempt_normal: bool) -> None:
    """While no background request came among the last ``TIER_MEMORY`` arrivals and none waits or runs,
    the normal tier is the one that yields: realtime prefill takes the reserve before the lower tiers'
    room (``rtr``, whose only purpose below the ceiling is to throttle background), and
    (``preempt_normal``) a waiting realtime request short of a slot or of KV preempts the newest running
    normal requests, as it does background ones."""
    policy = schedmod.TailcutPolicy
    fits, preemptions, observe = policy._fits, policy._preemptions, policy._observe

    def observing(self: Any, request: Any) -> None:
        seen = self.__dict__.setdefault("side_since_background", schedmod.TIER_MEMORY)
        self.side_since_background = 0 if request.tier == "background" else seen + 1
        observe(self, request)

    def quiet(self: Any) -> bool:
        if self.__dict__.get("side_since_background", 0) < schedmod.TIER_MEMORY or len(self._background):
            return False
        return not any(request.tier == "background" for request in self._running.values())

    def fitting(self: Any, request: Any, kv: int, room: Any, spent: Any, first: bool, *, overdue: bool = False) -> bool:
        if request.tier == "realtime" or not self.adapting or not quiet(self):
            return bool(fits(self, request, kv, room, spent, first, overdue=overdue))
        covered = min(spent.chunks["realtime"], room.reserve)
        lent = schedmod.Spent(spent.decodes, {**spent.chunks, "realtime": spent.chunks["realtime"] - covered})
        return bool(fits(self, request, kv, replace(room, at_ceiling=False), lent, first, overdue=overdue))

    def preempting(self: Any, slots: int, kv: int) -> Any:
        victims = preemptions(self, slots, kv)
        if victims or not preempt_normal or not self.adapting or not quiet(self) or not len(self._realtime):
            return victims
        running_normal = [request for request in self._running.values() if request.tier == "normal"]
        return self._victims(running_normal, list(self._realtime), slots, kv)

    policy._observe = observing  # type: ignore[method-assign]
    policy._fits = fitting  # type: ignore[method-assign]
    policy._preemptions = preempting  # type: ignore[method-assign]


def pace_lower_tiers(margin: float) -> None:
    """The lower tiers' prefill room follows their arrival rate and backlog (at the current step
    time, times ``1 + margin``), at least one chunk, instead of the most of that (plus a chunk), the
    budget rule's room and the normal room plus a chunk: in a stretch where documents pile up, the
    steps then grow with what the backlog term asks, not to a thousand tokens at once."""
    room = schedmod.TailcutPolicy.room

    def paced(self: Any, view: Any, now_ms: int) -> Any:
        shipped = room(self, view, now_ms)
        if not self.adapting:
            return shipped
        config = self.config
        backlog = self._queued_tokens(list(self._normal()), view.backlog_of(tiers=("normal",)))
        backlog += self._queued_tokens(list(self._background), view.backlog_of(tiers=("background",)))
        rate = self._lower_rate.tokens_per_ms  # ``room`` folded this round's arrivals in already
        demand = view.step_ms * (rate + backlog / config.backlog_drain_ms) * (1 + margin)
        ceiling = config.budget.max_tokens - shipped.decodes - shipped.reserve
        return replace(shipped, lower_prefill=min(ceiling, max(shipped.chunk, int(demand))))

    schedmod.TailcutPolicy.room = paced  # type: ignore[method-assign]


# ``tb``: the window of the lower tiers' arrival rate, and the most credit kept while no background waits.
BUCKET_WINDOW_MS = 30_000
BUCKET_CAP_TOKENS = 2_048


def token_bucket(margin: float, *, normal_waits: bool, cut_ins_wait: bool) -> None:
    """Background is admitted at the lower tiers' long-run arrival rate: a credit grows at their prompt
    tokens per ms over ``BUCKET_WINDOW_MS`` times ``1 + margin`` (at most ``BUCKET_CAP_TOKENS`` while no
    background waits), every lower-tier admission of a client's prompt spends its tokens, and background
    waits while the credit is below 0. The normal tier spends but waits on it only with ``tbn``; an
    overdue cut-in waits only with ``tbo``; a prompt into an engine with no prefill in flight never
    waits. In a stretch where documents pile up, background then waits for the stretch to pass instead
    of growing the steps."""
    gated = ("normal", "background") if normal_waits else ("background",)
    policy = schedmod.TailcutPolicy
    schedule, fits, admit, add = policy.schedule, policy._fits, policy._admit, policy.add

    def state(self: Any) -> dict[str, Any]:
        found: dict[str, Any] | None = self.__dict__.get("_tb")
        if found is None:
            found = {"credit": 0.0, "last": None, "rate": PrefillRate(window_ms=BUCKET_WINDOW_MS)}
            self.__dict__["_tb"] = found
        return found

    def adding(self: Any, request: Any) -> None:
        if request.tier != "realtime" and not request.continuation:
            state(self)["rate"].observe(request.prompt_tokens)
        add(self, request)

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        bucket = state(self)
        rate = bucket["rate"].update(now_ms)
        if bucket["last"] is not None:
            bucket["credit"] += (now_ms - bucket["last"]) * rate * (1 + margin)
            # Unspent credit is kept while background waits (the room, not the credit, held it back).
            if not len(self._background):
                bucket["credit"] = min(BUCKET_CAP_TOKENS, bucket["credit"])
        bucket["last"] = now_ms
        return schedule(self, view, now_ms)

    def fitting(self: Any, request: Any, kv: int, room: Any, spent: Any, first: bool, *, overdue: bool = False) -> bool:
        exempt = first or (overdue and not cut_ins_wait) or not self.adapting
        if request.tier in gated and not exempt and state(self)["credit"] < 0:
            return False
        return bool(fits(self, request, kv, room, spent, first, overdue=overdue))

    def admitting(self: Any, request: Any, now_ms: int) -> None:
        admit(self, request, now_ms)
        if request.tier != "realtime" and not request.continuation:
            state(self)["credit"] -= request.prompt_tokens

    policy.add = adding  # type: ignore[method-assign]
    policy.schedule = scheduling  # type: ignore[method-assign]
    policy._fits = fitting  # type: ignore[method-assign]
    policy._admit = admitting  # type: ignore[method-assign]


def pipeline_background() -> None:
    """A background prompt on its last chunk no longer counts in a round's accounting, so the next one
    may be admitted behind it: background's prefill goes one prompt at a time (the room holds a normal
    chunk and one background chunk), and each prompt counts its whole chunk until its first token is
    seen, which leaves the engine without background prefill between two prompts. A prompt's progress
    is estimated as ``count_progress`` does (``prefill_progress``); one admitted this round counts whole."""
    schedule = schedmod.TailcutPolicy.schedule

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        progress = prefill_progress(self, view, now_ms, "pipe")
        chunk = self._engine_chunk
        last_chunk = {
            request_id: entry
            for request_id, entry in self._prefilling.items()
            if entry[1] == "background"
            and progress.get(request_id, 0.0) > 0
            and entry[0] - progress[request_id] <= (chunk or entry[0])
        }
        for request_id in last_chunk:
            del self._prefilling[request_id]
        try:
            return schedule(self, view, now_ms)
        finally:
            for request_id, entry in last_chunk.items():
                if request_id in self._running:
                    self._prefilling[request_id] = entry
            forget_progress(self, progress)

    schedmod.TailcutPolicy.schedule = scheduling  # type: ignore[method-assign]


def count_occupancy(lag_rounds: float) -> None:
    """The lower tiers' arrival rate counts what a prompt holds of the room, not its tokens: its chunk
    for each round of its prefill and ``lag_rounds`` more (a prompt counts its whole chunk until its
    first token is seen, a round after its last chunk ran), so a tier of one-chunk prompts asks for
    about twice its tokens and one of many chunks for little more than them."""
    observe = schedmod.TailcutPolicy._observe

    def observing(self: Any, request: Any) -> None:
        if not self.config.adaptive or request.tier == "realtime":
            observe(self, request)
            return
        rate, tokens = self._lower_rate, request.prompt_tokens
        chunk = self._engine_chunk or tokens
        counted = min(tokens, chunk) * (-(-tokens // chunk) + lag_rounds)
        pending = rate._pending_tokens
        observe(self, request)
        rate._pending_tokens = pending + int(counted)

    schedmod.TailcutPolicy._observe = observing  # type: ignore[method-assign]


class WarmTimeAverage(TimeAverage):
    """A ``TimeAverage`` that, until a whole window has been seen, is the time-weighted mean of every
    sample so far instead of an average that starts at the first sample and forgets it slowly."""

    def __init__(self, *, window_ms: float) -> None:
        super().__init__(window_ms=window_ms)
        self._first_ms: int | None = None

    def update(self, now_ms: int, sample: float) -> float:
        if self._first_ms is None:
            self._first_ms = now_ms
        seen_ms = now_ms - self._first_ms
        if self._last_ms is not None and self._last_ms < now_ms and seen_ms < self.window_ms:
            self.value += (now_ms - self._last_ms) / seen_ms * (sample - self.value)
            self._last_ms = now_ms
            return self.value
        return super().update(now_ms, sample)


def usual_steps_warm_start() -> None:
    """The slow-step rule's usual step (``slow_step_window_ms``) is the mean of the steps seen so far until
    a whole window has been seen: as shipped it starts at the first step, which a worker's first burst
    makes large, and keeps it for about a window, so the rule does not act while the worker starts."""
    init = schedmod.TailcutPolicy.__init__

    def warm(self: Any, config: Any) -> None:
        init(self, config)
        self._usual_step = WarmTimeAverage(window_ms=config.slow_step_window_ms)

    schedmod.TailcutPolicy.__init__ = warm  # type: ignore[method-assign]


def drain_normal(drain_ms: float) -> None:
    """The normal tier may go past the lower tiers' limit by what its own backlog asks when drained
    over ``drain_ms`` (at the current step time), as far as the ceiling holds it: a burst of documents
    is prefilled within about that time instead of over ``backlog_drain_ms``. Background's limit is
    unchanged; the normal chunks in flight count against it as before."""
    policy = schedmod.TailcutPolicy
    sized, fits = policy.room, policy._fits

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = sized(self, view, now_ms)
        backlog = self._queued_tokens(list(self._normal()), view.backlog_of(tiers=("normal",)))
        self._normal_extra = int(view.step_ms * backlog / drain_ms) if self.adapting else 0
        return sizes

    def fitting(self: Any, request: Any, kv: int, room: Any, spent: Any, first: bool, *, overdue: bool = False) -> bool:
        if fits(self, request, kv, room, spent, first, overdue=overdue):
            return True
        if request.tier != "normal" or request.reserved_kv_tokens(self.config) > kv:
            return False
        limit = min(room.ceiling - room.reserve, room.lower_limit + getattr(self, "_normal_extra", 0))
        return bool(spent.total + self._chunk(request.prompt_tokens, room) <= limit)

    policy.room, policy._fits = sizing, fitting  # type: ignore[method-assign]


def prefill_progress(self: Any, view: Any, now_ms: int, variant: str) -> dict[str, float]:
    """The prompt tokens each prompt in prefill (``TailcutPolicy._prefilling``) is estimated to have
    computed, kept per ``variant`` on the policy: one chunk per ``step_ms`` since the round before."""
    progress: dict[str, float] = self.__dict__.setdefault(f"_{variant}_progress", {})
    last = self.__dict__.get(f"_{variant}_last_round_ms")
    self.__dict__[f"_{variant}_last_round_ms"] = now_ms
    if last is not None and view.step_ms > 0:
        steps = (now_ms - last) / view.step_ms
        for request_id, (tokens, _tier) in self._prefilling.items():
            chunk = min(tokens, self._engine_chunk) if self._engine_chunk else tokens
            progress[request_id] = progress.get(request_id, 0.0) + steps * chunk
    return progress


def forget_progress(self: Any, progress: dict[str, float]) -> None:
    """Drop the estimates of prompts no longer in prefill (their first token came, or they left)."""
    for request_id in [each for each in progress if each not in self._prefilling]:
        del progress[request_id]


def count_progress() -> None:
    """A prompt in prefill takes what is left of it in a round's accounting, not its whole chunk: each
    round it is taken to have advanced one chunk per ``step_ms`` since the round before (at least one
    KV block is left until its first token)."""
    schedule = schedmod.TailcutPolicy.schedule

    def counting(self: Any, view: Any, now_ms: int) -> Any:
        progress = prefill_progress(self, view, now_ms, "prog")
        whole = dict(self._prefilling)
        for request_id, (tokens, tier) in whole.items():
            left = max(self.config.kv_block_tokens, tokens - int(progress.get(request_id, 0.0)))
            self._prefilling[request_id] = (left, tier)
        try:
            return schedule(self, view, now_ms)
        finally:
            for request_id, entry in whole.items():
                if request_id in self._prefilling:
                    self._prefilling[request_id] = entry
            forget_progress(self, progress)

    schedmod.TailcutPolicy.schedule = counting  # type: ignore[method-assign]


GRID_PARTS = (
    "shipped",
    "nr",
    "dm",
    "ch",
    "prog",
    "pace",
    "tb",
    "tbn",
    "tbo",
    "pipe",
    "nq",
    "occ",
    "nw",
    "sm",
    "sk",
    "sb",
    "sr",
    "sw",
    "st",
    "sq",
    "rtr",
    "rtrs",
    "rtrc",
    "uw",
    "rtfifo",
    "bgsp",
    "bgpo",
    "bgsq",
    "scf",
    "scq",
    "ntbh",
    "ntbu",
    "ntbw",
    "ov",
    "ovn",
    "ovb",
    "ovc",
    "ovr",
    "ovk",
    "ovx",
    "ow",
    "owr",
    "ows",
    "owt",
    "owc",
    "owm",
    "owk",
    "own",
    "owx",
    "owq",
    "owl",
    "slo",
    "slq",
    "slk",
    "slg",
    "slp",
    "sl0",
    "slc",
    "sll",
)


def grid_variant(spec: str) -> policies.Variant:
    shipped = policy_variant("tailcut")
    scheduler, shed = shipped.scheduler, shipped.shed
    for part in spec.split("+"):
        key, _, value = part.partition("=")
        if key == "noadapt":
            scheduler = replace(scheduler, adaptive=False)
        elif key == "drain":
            scheduler = replace(scheduler, backlog_drain_ms=int(float(value)))
        elif key == "gmax":
            scheduler = replace(scheduler, background_gate_max_waiting=int(value))
        elif key == "bq":
            scheduler = replace(scheduler, backlog_max_requests=int(value))
        elif key == "slice":
            scheduler = replace(scheduler, slice_tokens=int(value))
        elif key == "ka":
            scheduler = replace(scheduler, keep_alive=replace(scheduler.keep_alive, ttl_ms=int(value)))
        elif key == "kvr":
            scheduler = replace(scheduler, kv_reservation=value)  # type: ignore[arg-type]
        elif key == "rv":
            scheduler = replace(scheduler, realtime_reserve_tokens=int(value))
        elif key == "ci":
            scheduler = replace(scheduler, max_cut_ins=int(value))
        elif key == "bf":
            scheduler = replace(scheduler, budget=replace(scheduler.budget, min_tokens=int(value)))
        elif key == "shed":
            shed = replace(shed or ShedLimits.never(), background=int(value))
        elif key == "nw":
            shed = replace(shed or ShedLimits.never(), normal_wait_ms=int(value))
        elif key == "sm":
            scheduler = replace(scheduler, slow_step_margin=float(value))
        elif key == "sk":
            scheduler = replace(scheduler, slow_step_room_chunks=int(value))
        elif key == "ow":
            scheduler = replace(scheduler, overload_background_waiting=int(value))
        elif key in ("ntb", "ntbu", "ntbw", "ntbh"):
            scheduler = replace(scheduler, normal_takes_background_prefill=value != "0")
        elif key in ("nbq", "nbqp"):
            pass  # patch_sizes
        elif key == "rtb":
            scheduler = replace(scheduler, realtime_takes_background_prefill=value != "0")
        elif key not in GRID_PARTS:
            raise SystemExit(f"unknown part {part!r}")
    return replace(shipped, label=spec, scheduler=scheduler, shed=shed)


def grid_report(
    name: str, results: list[policies.JobResult], baselines: list[dict[str, Any]]
) -> policies.PoliciesReport:
    """The suite's report of one workload: the baselines' rows of its ``results.json`` beside the variant's
    runs, whose rows stand in for tailcut's."""
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    ours = [replace(result, rows=[{**row, "policy": "tailcut"} for row in result.rows]) for result in results]
    theirs = replace(results[0], rows=baselines)
    return policies.PoliciesReport(workload, cost, SEED, DURATION_S, capacities_rps()[name], [theirs, *ours], [], 0.0)


def seed_mix_figures(report: policies.PoliciesReport) -> dict[str, float]:
    def ratio(load: float, tier: Tier, key: str, policy: str) -> float:
        return float(report.row("tailcut", load, tier)[key]) / float(report.row(policy, load, tier)[key])

    realtime = report.row("tailcut", 0.9, "realtime")
    return {
        "realtime P99 TTFT / fifo at 90%": ratio(0.9, "realtime", "p99_ttft_ms", "fifo"),
        "realtime P99 E2E / floor at 90%": realtime["p99_e2e_ms"] / realtime["floor_e2e_ms"],
        "background / fifo at 90%": ratio(0.9, "background", TOKENS, "fifo"),
        "realtime P99 E2E / vllm-priority at 100%": ratio(1.0, "realtime", "p99_e2e_ms", "vllm-priority"),
        "background / vllm-priority at 100%": ratio(1.0, "background", TOKENS, "vllm-priority"),
        "realtime attainment at 100%": report.row("tailcut", 1.0, "realtime")["attainment"],
        "realtime attainment at 120%": report.row("tailcut", 1.2, "realtime")["attainment"],
    }


def grid_one(job: tuple[str, str, float, float]) -> tuple[str, str, policies.JobResult]:
    name, spec, load, rate_rps = job
    patch_sizes(spec)
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    variant = grid_variant(spec)
    return name, spec, policies.run_job(policies.Job(variant, load, rate_rps, SEED, DURATION_S, workload, cost))


def run_grid(specs: list[str]) -> None:
    capacities = capacities_rps()
    baselines = {
        name: [
            row
            for row in json.loads((SUITE.parent / name / "results.json").read_text())["runs"]
            if row["policy"] in ("static-batch", "fifo", "vllm-priority")
        ]
        for name in GRID_NAMES
    }
    jobs = [(name, spec, load, load * capacities[name]) for spec in specs for name in GRID_NAMES for load in GRID_LOADS]
    done: dict[str, dict[str, list[policies.JobResult]]] = {}
    # One job per process: each patches the scheduler module for its own variant.
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        for name, spec, result in pool.imap_unordered(grid_one, jobs):
            done.setdefault(spec, {}).setdefault(name, []).append(result)
            if any(len(done[spec].get(each, [])) < len(GRID_LOADS) for each in GRID_NAMES):
                continue
            reports = {each: grid_report(each, done[spec][each], baselines[each]) for each in GRID_NAMES}
            checks = [(each, check) for each in GRID_NAMES for check in policies.check_targets(reports[each])]
            misses = [f"{each} {check.name} = {check.value or 0:.3f}" for each, check in checks if not check.met]
            line = [f"{spec}: met {len(checks) - len(misses)}/{len(checks)};", f"missed: {'; '.join(misses) or 'none'}"]
            floors = [f"{each} {check.value or 0:.3f}" for each, check in checks if "floor" in check.name]
            line.append(f"; realtime P99 E2E / floor at 90%: {', '.join(floors)}")
            if "seed-mix" in reports:
                figures = seed_mix_figures(reports["seed-mix"])
                line.append("; seed-mix: " + ", ".join(f"{figure} {value:.4f}" for figure, value in figures.items()))
                if "SIDE_SUITE" not in os.environ:  # SEED_MIX_BEFORE was measured on this folder's traces only
                    fell = [
                        f"{figure} {figures[figure]:.3f} (was {before})"
                        for figure, (before, better) in SEED_MIX_BEFORE.items()
                        if (figures[figure] - before) * better < -0.0006
                    ]
                    line.append(f"; seed-mix below the policy before issue 12: {'; '.join(fell) or 'none'}")
            print(*line, flush=True)
            if out := os.environ.get("SIDE_CHECKS_OUT"):  # every target's value, as the suite's suite.json has them
                checks_of = {each: policies.check_targets(reports[each]) for each in GRID_NAMES}
                targets = {each: [asdict(check) for check in found] for each, found in checks_of.items()}
                with Path(out).open("a") as file:
                    file.write(json.dumps({"spec": spec, "seed": SEED, "targets": targets}) + "\n")


def grid_rows(name: str, spec: str, load: float) -> None:
    """One grid variant's run of one workload at one load: every tier's row, as the suite's JSON holds
    it, and what held background back — over the scheduler's clock, the lower tiers' prefill room and
    their chunks in flight after each round, the share of the time background waited, and while it
    waited, how many background prompts were in prefill and how often the realtime gate held it."""
    patch_sizes(spec)
    policy = schedmod.TailcutPolicy
    room, schedule = policy.room, policy.schedule
    clock = {"room": 0.0, "in flight": 0.0, "all": 0.0, "waiting": 0.0, "held": 0.0}
    in_prefill: dict[int, float] = {}
    last_ms: int | None = None

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        self._last_room = room(self, view, now_ms)
        return self._last_room

    def scheduling(self: Any, view: Any, now_ms: int) -> Any:
        nonlocal last_ms
        decision = schedule(self, view, now_ms)
        if self.adapting and last_ms is not None:
            elapsed, sizes = now_ms - last_ms, self._last_room
            lower = [(tokens, tier) for tokens, tier in self._prefilling.values() if tier != "realtime"]
            clock["all"] += elapsed
            clock["room"] += elapsed * sizes.lower_prefill
            clock["in flight"] += elapsed * sum(self._chunk(tokens, sizes) for tokens, _ in lower)
            if len(self._background):
                clock["waiting"] += elapsed
                clock["held"] += elapsed if sizes.background_held else 0
                count = sum(1 for _, tier in lower if tier == "background")
                in_prefill[count] = in_prefill.get(count, 0.0) + elapsed
        last_ms = now_ms
        return decision

    policy.room, policy.schedule = sizing, scheduling  # type: ignore[method-assign]
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    capacity = float(os.environ.get("SIDE_CAPACITY") or capacities_rps()[name])
    job = policies.Job(grid_variant(spec), load, load * capacity, SEED, DURATION_S, workload, cost)
    for row in policies.run_job(job).rows:
        print(json.dumps({key: value for key, value in row.items() if not isinstance(value, (list, dict))}))
    if not clock["all"]:  # the policy never sized a room (not adapting: the configured policy)
        return
    waiting = clock["waiting"] or 1.0
    print(
        f"{name} {spec} {load}: lower tiers' prefill room {clock['room'] / clock['all']:.0f} tokens, their chunks in",
        f"flight {clock['in flight'] / clock['all']:.0f}; background waits {clock['waiting'] / clock['all']:.1%} of",
        "the time, and meanwhile has",
        ", ".join(f"{count} prompts in prefill {share / waiting:.1%}" for count, share in sorted(in_prefill.items())),
        f"of it; held by the realtime gate {clock['held'] / waiting:.1%}",
    )


def records_of(job: policies.Job) -> list[RequestRecord]:
    """Every request's record of ``job``, run on its workload's trace at its rate, seed and duration."""
    trace = make_trace(job.workload, job.rate_rps, seed=job.seed, duration_s=job.duration_s)
    return policies.records_of(simulate(trace, job.workload, job.config(), duration_s=job.duration_s))


def timeline(name: str, spec: str, load: float, bin_s: int) -> None:
    """``SIDE timeline``: where in the run a variant's realtime tail comes from, beside the overload
    rule's state, background's queue, the lower tiers' room and the step time."""
    patch_sizes(spec)
    policy = schedmod.TailcutPolicy
    room = policy.room
    rounds: list[tuple[int, bool, int, int, float]] = []

    def sizing(self: Any, view: Any, now_ms: int) -> Any:
        sizes = room(self, view, now_ms)
        if self.adapting:
            rounds.append((now_ms, self._overloaded, len(self._background), sizes.lower_prefill, view.step_ms))
        return sizes

    policy.room = sizing  # type: ignore[method-assign]
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    rate_rps = load * capacities_rps()[name]
    job = policies.Job(grid_variant(spec), load, rate_rps, SEED, DURATION_S, workload, cost)
    replies = [(r.sent_s, r.e2e_ms) for r in records_of(job) if r.tier == "realtime" and r.e2e_ms is not None]
    whole = percentile([e2e_ms for _, e2e_ms in replies])
    print(f"{name} {spec} at {load:.0%}, seed {SEED}: realtime P99 E2E {whole:.0f} ms over {len(replies)} replies")
    times = [round_[0] for round_ in rounds]
    for start in range(0, int(DURATION_S) + 2 * bin_s, bin_s):
        e2e = [e2e_ms for sent_s, e2e_ms in replies if start <= sent_s < start + bin_s]
        lo, hi = bisect.bisect_left(times, start * 1000), bisect.bisect_left(times, (start + bin_s) * 1000)
        mine = rounds[lo:hi]
        if not e2e and not mine:
            continue
        n = max(len(mine), 1)
        print(
            f"  [{start:3d}, {start + bin_s:3d}) s: {len(e2e):5d} replies,",
            f"P99 {percentile(e2e) if e2e else 0:6.0f} ms,",
            f"{sum(1 for value in e2e if value > whole):3d} over the run's;",
            f"overloaded {sum(1 for r in mine if r[1]) / n:4.0%}, background waiting",
            f"{min((r[2] for r in mine), default=0):3d}-{max((r[2] for r in mine), default=0):3d},",
            f"room {sum(r[3] for r in mine) / n:5.0f} tokens, step {sum(r[4] for r in mine) / n:5.1f} ms",
        )


# --- floor and yield ---

EXPERIMENTS: dict[str, tuple[Callable[[str], policies.Variant], Callable[[str, str, float, Rows], None]]] = {
    "floor": (floor_variant, print_floor),
    "yield": (policy_variant, print_yield),
}


def one(job: tuple[str, str, str, float, float]) -> tuple[str, str, float, Rows]:
    experiment, name, spec, load, rate_rps = job
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    variant = EXPERIMENTS[experiment][0](spec)
    result = policies.run_job(policies.Job(variant, load, rate_rps, SEED, DURATION_S, workload, cost))
    return name, spec, load, {row["tier"]: row for row in result.rows}


# --- bursts: where a run's realtime P99 TTFT comes from ---

BURST_BIN_S = 30


def bursts(job: tuple[str, str, float]) -> list[str]:
    """A policy's realtime TTFT at 90% on the suite's trace, per ``BURST_BIN_S`` of arrivals: the P99 of the
    whole run (as the suite computes it) beside each bin's P99 and max, so one burst's share shows."""
    name, label, rate_rps = job
    workload, cost = workload_and_cost(name, "h100-llama3-8b")
    at_90 = policies.Job(policy_variant(label), 0.9, rate_rps, SEED, DURATION_S, workload, cost)
    ttft = [(r.sent_s, r.ttft_ms) for r in records_of(at_90) if r.tier == "realtime" and r.ttft_ms is not None]
    lines = [
        f"{name} {label} seed {SEED}, {DURATION_S:g} s: realtime P99 TTFT {percentile([t for _, t in ttft]):.1f} ms"
    ]
    for start in range(0, int(DURATION_S), BURST_BIN_S):
        mine = [t for sent, t in ttft if start <= sent < start + BURST_BIN_S]
        if mine:
            lines.append(
                f"  [{start:3d}, {start + BURST_BIN_S:3d}) s: {len(mine):5d} requests, "
                f"P99 {percentile(mine):6.1f} ms, max {max(mine):6.1f} ms"
            )
    return lines


def percentile(values: list[float]) -> float:
    """The P99 as the suite reports it (``bench.stats.summarize``)."""
    return float(field_of(summarize(values), "p99") or 0.0)


if __name__ == "__main__":
    if sys.argv[1] == "grid":
        for spec in sys.argv[2:]:
            grid_variant(spec)  # an unknown part stops here, not in every worker process
        run_grid(sys.argv[2:])
        raise SystemExit(0)
    if sys.argv[1] == "rows":
        grid_rows(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        raise SystemExit(0)
    if sys.argv[1] == "timeline":
        timeline(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 10)
        raise SystemExit(0)
    if sys.argv[1] == "bursts":
        capacities = capacities_rps()
        burst_jobs = [(sys.argv[2], label, 0.9 * capacities[sys.argv[2]]) for label in sys.argv[3].split(",")]
        with ProcessPoolExecutor(2) as pool:
            for lines in pool.map(bursts, burst_jobs):
                print("\n".join(lines), flush=True)
        raise SystemExit(0)
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
