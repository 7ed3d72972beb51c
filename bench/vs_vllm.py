"""``tailcut bench vs-vllm``: tailcut in front of vLLM against vLLM's own OpenAI server, one at a time.

Both run the same model with the engine options tailcut's worker gives vLLM (``bench.vllm_server``: on CPU
block size 32, float32, eager, an explicit KV cache size, the same context length, prefix caching and
priority scheduling). They run one after the other (two shared cores cannot host both) under the same
closed-loop load from the same client: TTFT at concurrency 1 gives tailcut's added latency, output
tokens per second at concurrency 16 the throughput ratio. Every child process is stopped, its process
group killed, whatever happens. The tables and files are written by ``bench.vs_vllm_report``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen, stats
from bench.cpu import cpu_delta, cpu_snapshot, group_cpu_seconds
from bench.levels import LevelResult, fixed_requests, fixed_workload, summarize_level
from bench.rawclient import run_async
from bench.records import records_path
from bench.stack import log_folder, tailcut_stack
from bench.stats import RequestRecord, TargetCheck
from bench.vllm_server import (
    engine_env,
    shared_engine_args,
    tailcut_env,
    vllm_on_cpu,
    vllm_server,
    vllm_server_command,
)
from bench.vs_vllm_report import print_report, write_outputs
from bench.workloads import Workload
from tailcut.errors import FatalError
from tailcut.processes import Progress

SYSTEMS = ("tailcut", "vllm")
TARGET_TTFT_OVERHEAD_P50_MS = 2.0
TARGET_THROUGHPUT_RATIO = 0.9
WARMUP_C1 = 2


@dataclass(frozen=True, slots=True)
class Level:
    """One closed-loop level of one system, with its output tokens per second and raw records."""

    result: LevelResult
    output_tokens_per_s: float
    records: list[RequestRecord]

    @property
    def concurrency(self) -> int:
        return self.result.streams


@dataclass
class SystemRun:
    system: str
    start_s: float
    levels: list[Level] = field(default_factory=list)
    round: int = 0  # from 0; ``pool`` gives -1 (every round)

    def level(self, concurrency: int) -> Level | None:
        return next((level for level in self.levels if level.concurrency == concurrency), None)


def pool(runs: Sequence[SystemRun], *, expected_tokens: int) -> SystemRun:
    """One system's rounds as one run: records pooled per level, durations and CPU added up (so rates are
    totals over the time measured)."""
    levels = []
    for concurrency in sorted({level.concurrency for run in runs for level in run.levels}):
        parts = [level for run in runs if (level := run.level(concurrency)) is not None]
        records = [record for part in parts for record in part.records]
        duration_s = sum(part.result.duration_s for part in parts)
        cpu_s: dict[str, float] = {}
        for part in parts:
            for name, seconds in part.result.cpu_s.items():
                cpu_s[name] = cpu_s.get(name, 0.0) + seconds
        result = summarize_level(concurrency, records, duration_s, expected_tokens=expected_tokens, cpu_s=cpu_s)
        levels.append(Level(result, stats.output_tokens_per_s(records, duration_s), records))
    start_s = sum(run.start_s for run in runs) / len(runs) if runs else 0.0
    return SystemRun(runs[0].system if runs else "", start_s, levels, round=-1)


def round_orders(systems: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the systems in each round: reversed every other round (A B, B A, ...), so a machine
    that slows down or speeds up during the command does not favour whichever runs first."""
    return [list(systems) if index % 2 == 0 else list(reversed(systems)) for index in range(rounds)]


@dataclass(frozen=True, slots=True)
class Comparison:
    ttft_p50_overhead_ms: float | None
    ttft_p99_overhead_ms: float | None
    throughput_ratio: float | None
    concurrency: int


def compare(tailcut: SystemRun, vllm: SystemRun, *, concurrency: int) -> Comparison:
    """tailcut − vLLM TTFT (P50, P99) at concurrency 1; tailcut / vLLM output tokens/s at ``concurrency``."""

    def ttft(run: SystemRun, attribute: str) -> float | None:
        level = run.level(1)
        summary = level.result.ttft_ms if level else None
        return None if summary is None else float(getattr(summary, attribute))

    def difference(attribute: str) -> float | None:
        ours, theirs = ttft(tailcut, attribute), ttft(vllm, attribute)
        return None if ours is None or theirs is None else ours - theirs

    ours, theirs = tailcut.level(concurrency), vllm.level(concurrency)
    ratio = None
    if ours is not None and theirs is not None and theirs.output_tokens_per_s > 0:
        ratio = ours.output_tokens_per_s / theirs.output_tokens_per_s
    return Comparison(difference("p50"), difference("p99"), ratio, concurrency)


def round_spread(runs: Sequence[SystemRun], system: str, *, concurrency: int) -> float | None:
    """``system``'s lowest round ÷ its highest in output tokens/s at ``concurrency``: how far the same server
    moved against itself from one round to the next (1.0: not at all); a round's ratio between the two
    systems cannot be read more finely than that. None with fewer than two rounds."""
    rates = [level.output_tokens_per_s for run in runs if run.system == system and (level := run.level(concurrency))]
    if len(rates) < 2 or max(rates) <= 0:
        return None
    return min(rates) / max(rates)


def check_targets(comparison: Comparison) -> list[TargetCheck]:
    p50, ratio = comparison.ttft_p50_overhead_ms, comparison.throughput_ratio
    return [
        TargetCheck(
            "TTFT P50 overhead at c=1 (ms)",
            p50,
            f"≤ {TARGET_TTFT_OVERHEAD_P50_MS:g}",
            p50 is not None and p50 <= TARGET_TTFT_OVERHEAD_P50_MS,
        ),
        TargetCheck(
            f"throughput ratio at c={comparison.concurrency}",
            ratio,
            f"≥ {TARGET_THROUGHPUT_RATIO:.0%}",
            ratio is not None and ratio >= TARGET_THROUGHPUT_RATIO,
        ),
    ]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The same load for both systems."""

    workload: Workload
    output_tokens: int
    requests_c1: int
    concurrency: int
    requests_cn: int
    timeout_s: float


def cpu_now(groups: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each process group of the system under test, of this process (the client) and of the
    whole machine (``MACHINE``): what is left is CPU that processes outside the benchmark took."""
    snapshot = group_cpu_seconds(groups)
    snapshot.update(cpu_snapshot({"client": os.getpid()}))
    return snapshot


def measure(url: str, model: str, plan: LoadPlan, groups: Mapping[str, int], progress: Progress) -> list[Level]:
    """Warm up (not recorded), then concurrency 1, then the throughput level. ``groups``: the process
    groups of the system under test, by name, for CPU accounting."""

    async def levels() -> list[Level]:
        progress("warming up")
        for concurrency, count in ((1, WARMUP_C1), (plan.concurrency, plan.concurrency)):
            await loadgen.run_closed_loop(
                url, model, fixed_requests(plan.workload, count), concurrency=concurrency, timeout_s=plan.timeout_s
            )
        measured = []
        for concurrency, count in ((1, plan.requests_c1), (plan.concurrency, plan.requests_cn)):
            progress(f"concurrency {concurrency}: {count} requests of {plan.output_tokens} tokens")
            before = cpu_now(groups)
            result = await loadgen.run_closed_loop(
                url,
                model,
                fixed_requests(plan.workload, count),
                concurrency=concurrency,
                timeout_s=plan.timeout_s,
                show_progress=True,
            )
            cpu_s = cpu_delta(before, cpu_now(groups))
            summary = summarize_level(
                concurrency, result.records, result.duration_s, expected_tokens=plan.output_tokens, cpu_s=cpu_s
            )
            tokens_per_s = stats.output_tokens_per_s(result.records, result.duration_s)
            measured.append(Level(summary, tokens_per_s, result.records))
        return measured

    return run_async(levels())


@dataclass
class VsReport:
    model: str
    model_dir: str
    engine_args: dict[str, Any]
    server_command: list[str]
    plan: LoadPlan
    runs: list[SystemRun]
    pooled: list[SystemRun]  # with more than one round: each system's rounds together
    comparison: Comparison | None  # of the pooled runs (of the only round's)
    per_round: list[Comparison]
    targets: list[TargetCheck]
    wall_s: float
    engine_cores: int | None = None  # None: every core

    @property
    def round_spread(self) -> dict[str, float | None]:
        """Each system's lowest round ÷ its highest at the throughput level (``round_spread``; None with
        one round)."""
        systems = dict.fromkeys(run.system for run in self.runs)
        return {system: round_spread(self.runs, system, concurrency=self.plan.concurrency) for system in systems}


def run(
    *,
    model_dir: Path,
    plan: LoadPlan,
    max_model_len: int,
    systems: Sequence[str],
    start_timeout_s: float,
    log_dir: Path,
    progress: Progress,
    rounds: int = 1,
    engine_cores: int | None = None,
    on_system: Callable[[SystemRun], None] | None = None,
) -> VsReport:
    from tailcut.models import served_name

    started = time.monotonic()
    on_cpu = vllm_on_cpu()
    args = shared_engine_args(model_dir, on_cpu=on_cpu, max_model_len=max_model_len)
    name = served_name(model_dir, None)
    command = vllm_server_command(sys.executable, args, port=0, served_name=name)
    runs: list[SystemRun] = []
    for round_index, order in enumerate(round_orders(systems, rounds)):
        for system in order:
            progress(f"round {round_index + 1} of {rounds}: {system}")
            system_run = run_system(
                system,
                model_dir,
                args,
                plan,
                name=name,
                on_cpu=on_cpu,
                max_model_len=max_model_len,
                start_timeout_s=start_timeout_s,
                log_dir=log_dir / f"round-{round_index + 1}",
                progress=progress,
                engine_cores=engine_cores,
            )
            system_run.round = round_index
            runs.append(system_run)
            if on_system is not None:
                on_system(system_run)
    pooled = {
        system: pool([r for r in runs if r.system == system], expected_tokens=plan.output_tokens) for system in systems
    }
    comparison = None
    per_round: list[Comparison] = []
    if "tailcut" in pooled and "vllm" in pooled:
        comparison = compare(pooled["tailcut"], pooled["vllm"], concurrency=plan.concurrency)
        for round_index in range(rounds):
            ours, theirs = (next(r for r in runs if r.system == s and r.round == round_index) for s in SYSTEMS)
            per_round.append(compare(ours, theirs, concurrency=plan.concurrency))
    return VsReport(
        model=name,
        model_dir=str(model_dir),
        engine_args=args,
        server_command=command,
        plan=plan,
        runs=runs,
        pooled=[pooled[system] for system in systems] if rounds > 1 else [],
        comparison=comparison,
        per_round=per_round,
        targets=check_targets(comparison) if comparison else [],
        wall_s=time.monotonic() - started,
        engine_cores=engine_cores,
    )


def run_system(
    system: str,
    model_dir: Path,
    args: Mapping[str, Any],
    plan: LoadPlan,
    *,
    name: str,
    on_cpu: bool,
    max_model_len: int,
    start_timeout_s: float,
    log_dir: Path,
    progress: Progress,
    engine_cores: int | None = None,
) -> SystemRun:
    """Start one system, measure it, stop it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if system == "tailcut":
        env, worker_env = tailcut_env(on_cpu=on_cpu, max_model_len=max_model_len, engine_cores=engine_cores)
        progress("starting tailcut: a private redis-server, the API and one vLLM worker (loads the model)")
        with tailcut_stack(
            model_dir, log_dir, env=env, worker_env=worker_env, ready_timeout_s=start_timeout_s, progress=progress
        ) as stack:
            progress(f"tailcut ready in {stack.ready_s:.0f} s")
            # Each child leads its own process group (the worker's holds vLLM's engine process too).
            groups = {child.name: child.pid for child in stack.children}
            if "redis" in stack.pids:
                groups["redis"] = stack.pids["redis"]
            return SystemRun(system, stack.ready_s, measure(stack.url, name, plan, groups, progress))
    with vllm_server(
        model_dir,
        args,
        log_dir,
        served_name=name,
        timeout_s=start_timeout_s,
        progress=progress,
        engine_cores=engine_cores,
    ) as (url, ready_s, pid):
        progress(f"vLLM's server ready in {ready_s:.0f} s")
        return SystemRun(system, ready_s, measure(url, name, plan, {"vllm-server": pid}, progress))


# --- the command ----------------------------------------------------------------------------------------


def command(args: Any) -> None:
    """``tailcut bench vs-vllm`` (``args`` from ``bench.cli``)."""
    from rich.console import Console

    from tailcut.models import resolve_model
    from tailcut.settings import CommonSettings

    if args.tokens < 2 or args.prompt_tokens < 1 or args.concurrency < 2:
        raise FatalError("--tokens must be at least 2, --prompt-tokens at least 1 and --concurrency at least 2")
    if args.rounds < 1:
        raise FatalError("--rounds must be at least 1")
    if min(args.requests_c1, args.requests_cn) < 1:
        raise FatalError("--requests-c1 and --requests-cn must be at least 1")
    if args.prompt_tokens + args.tokens > args.max_model_len:
        raise FatalError("--prompt-tokens + --tokens must fit in --max-model-len")
    engine_env(args.engine_cores)  # refuses a core count this machine cannot give
    status_console = Console(stderr=True, highlight=False)
    console = Console(width=None if sys.stdout.isatty() else 160)
    with status_console.status("preparing the model"):
        model_dir = resolve_model(args.model, CommonSettings().cache_dir, progress=status_console.log)
    plan = LoadPlan(
        workload=fixed_workload(args.prompt_tokens, args.tokens),
        output_tokens=args.tokens,
        requests_c1=args.requests_c1,
        concurrency=args.concurrency,
        requests_cn=args.requests_cn,
        timeout_s=args.timeout_s,
    )
    systems = [args.only] if args.only else list(SYSTEMS)
    with log_folder(args.out, "tailcut-vs-vllm-") as log_dir:
        report = run(
            model_dir=model_dir,
            plan=plan,
            max_model_len=args.max_model_len,
            systems=systems,
            start_timeout_s=args.start_timeout_s,
            log_dir=log_dir,
            progress=status_console.log,
            rounds=args.rounds,
            engine_cores=args.engine_cores,
        )
    print_report(console, report)
    if args.out:
        arguments = {name: value for name, value in vars(args).items() if name != "func"}
        path = write_outputs(report, Path(args.out), command=sys.argv, arguments=arguments)
        records = records_path(path.parent, "vs_vllm")
        console.print(f"wrote {path}, {records} and {path.with_name('vs_vllm_cdf_ttft.png')}")
