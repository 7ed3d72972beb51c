"""``tailcut bench overhead``: what tailcut's own pipeline costs, measured with the zero-cost ``null`` engine.

Starts a private redis-server, the API and one worker running the ``null`` engine as child processes, then
runs a closed loop of fixed-length requests at each concurrency level. The engine costs nothing, so TTFT is
the latency tailcut adds before the first token (HTTP → Redis → worker → Redis → HTTP), and the rate of
content chunks the clients receive at the highest level is what one API process sustains. ``--step-ms``
gives the engine steps like a real one (one token per running request per step), so chunks reach the API
one per request per step instead of in bursts.

Every level runs twice: with ``bench.client`` (the httpx client of every other benchmark, which parses each
event and tops out near 8,000 chunks/s on one core) and with the raw client of ``bench.rawclient``, which
counts chunks on the wire, so the server side can be saturated. The CPU time of every process (API,
worker, Redis, the client itself, and whatever else runs on the machine) is read from ``/proc`` for each
level (``bench.cpu``), so the report says where the time goes; a canned SSE server measures each client's
own ceiling. The tables and files are written by ``bench.overhead_report``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.cpu import cpu_delta, cpu_snapshot, interpreter_ns_per_iteration
from bench.levels import (
    CLIENTS,
    DEFAULT_TIER,
    ClientKind,
    LevelResult,
    PromptKind,
    fixed_requests,
    fixed_workload,
    summarize_level,
)
from bench.overhead_report import print_report, write_outputs
from bench.rawclient import CANNED_SERVER, run_async, run_raw_closed_loop
from bench.stack import log_folder, tailcut_stack
from bench.stats import TargetCheck
from bench.workloads import Arrival, Workload
from queues.keys import Tier
from tailcut.errors import FatalError
from tailcut.processes import Progress, free_port, start_child, stop_child, wait_for_port

DEFAULT_STREAMS = (1, 50, 200, 1000)
DEFAULT_OUTPUT_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 16
# The targets, against the canned SSE server with the same (raw) client in the same run: at one stream,
# TTFT at most this far above the canned server's; at TARGET_STREAMS, at least this share of its token
# rate, with the API and the worker each spending at most TARGET_CPU_US_PER_TOKEN per token.
TARGET_TTFT_ABOVE_CANNED_MS = 1.0
TARGET_CANNED_SHARE = 0.5
TARGET_CPU_US_PER_TOKEN = 10.0
TARGET_STREAMS = 200
WARMUP_REQUESTS = 20
LEVEL_BUDGET_S = 20.0  # the default request count at one stream keeps a level with engine steps about this long


def default_num_requests(streams: int, *, request_s: float = 0.0) -> int:
    """Enough requests that each stream sends several (ramp up and down stay small) and P99 has samples;
    at one stream, when each request takes ``request_s`` of engine time, no more than about 20 s of them."""
    single = 200 if request_s <= 0 else max(20, min(200, int(LEVEL_BUDGET_S / request_s)))
    return max(single, 5 * streams)


def parse_streams(text: str) -> list[int]:
    """``"1,50,200"`` → ``[1, 50, 200]`` (sorted, distinct, each at least 1)."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise FatalError(f"--streams must be whole numbers separated by commas, got {text!r}") from exc
    if not levels or levels[0] < 1:
        raise FatalError(f"--streams needs at least one level, each at least 1, got {text!r}")
    return levels


def check_targets(
    levels: Sequence[LevelResult], ceilings: Sequence[LevelResult] = (), *, step_ms: float = 0.0
) -> list[TargetCheck]:
    """The targets, with the raw client (the httpx client's own ceiling is below them): P50 TTFT at one
    stream against the canned server's (only with a zero-cost engine: with engine steps, the first
    token waits for a step), and at ``TARGET_STREAMS`` (else the highest level) the steady token rate
    against the canned server's at the same level and the API's and the worker's CPU per token."""
    raw = {level.streams: level for level in levels if level.client == "raw"}
    canned = {level.streams: level for level in ceilings if level.client == "raw"}
    checks = []
    single, single_canned = raw.get(1), canned.get(1)
    if single is not None and single_canned is not None and step_ms == 0:
        above = (
            single.ttft_ms.p50 - single_canned.ttft_ms.p50
            if single.ttft_ms is not None and single_canned.ttft_ms is not None
            else None
        )
        checks.append(
            TargetCheck(
                "P50 TTFT at 1 stream above the canned server's (ms)",
                above,
                f"≤ {TARGET_TTFT_ABOVE_CANNED_MS:g}",
                above is not None and above <= TARGET_TTFT_ABOVE_CANNED_MS,
            )
        )
    if not raw:
        return checks
    at = raw.get(TARGET_STREAMS) or raw[max(raw)]
    rate = at.steady_tokens_per_s or at.tokens_per_s
    against = canned.get(at.streams)
    if against is not None:
        share = rate / (against.steady_tokens_per_s or against.tokens_per_s or 1.0)
        checks.append(
            TargetCheck(
                f"tokens/s at {at.streams} streams (steady) ÷ the canned server's",
                share,
                f"≥ {TARGET_CANNED_SHARE:g}",
                share >= TARGET_CANNED_SHARE,
            )
        )
    for process in ("api", "worker"):
        per_token = at.cpu_us_per_token(process)
        checks.append(
            TargetCheck(
                f"{process} CPU per token at {at.streams} streams (µs)",
                per_token,
                f"≤ {TARGET_CPU_US_PER_TOKEN:g}",
                per_token is not None and per_token <= TARGET_CPU_US_PER_TOKEN,
            )
        )
    return checks


# --- the benchmark ------------------------------------------------------------------------------------


async def measure_level(
    url: str,
    model: str,
    requests: Sequence[Arrival],
    *,
    streams: int,
    pids: Mapping[str, int],
    expected_tokens: int,
    timeout_s: float,
    client: ClientKind = "httpx",
) -> LevelResult:
    """One closed-loop level; CPU is counted for ``pids`` and for this process (``client``)."""
    watched = {**pids, "client": os.getpid()}
    before = cpu_snapshot(watched)
    if client == "httpx":
        result = await loadgen.run_closed_loop(
            url, model, requests, concurrency=streams, timeout_s=timeout_s, show_progress=True
        )
    else:
        result = await run_raw_closed_loop(url, model, requests, concurrency=streams, timeout_s=timeout_s)
    cpu_s = cpu_delta(before, cpu_snapshot(watched))
    return summarize_level(
        streams, result.records, result.duration_s, expected_tokens=expected_tokens, cpu_s=cpu_s, client=client
    )


async def warm_up(
    url: str, model: str, workload: Workload, *, concurrency: int, count: int, prompt: PromptKind = "ids"
) -> None:
    """Requests not recorded: connection pools, first-call paths and the worker's read loop get going."""
    requests = fixed_requests(workload, count, prompt=prompt)
    await loadgen.run_closed_loop(url, model, requests, concurrency=concurrency, timeout_s=60.0)


def measure_client_ceilings(
    workload: Workload,
    *,
    streams: Sequence[int],
    num_requests: Callable[[int], int],
    output_tokens: int,
    timeout_s: float,
    clients: Sequence[ClientKind] = CLIENTS,
) -> list[LevelResult]:
    """The clients with the same load against the canned SSE server (a separate process): the raw client
    at every level (what the targets compare with), the httpx client at the highest (when measured)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tailcut-canned-") as folder:
        argv = [sys.executable, "-c", CANNED_SERVER, str(port), str(output_tokens)]
        child = start_child("the canned SSE server", argv, log_path=Path(folder) / "canned-sse.log")
        try:
            wait_for_port(port, child)
            url = f"http://127.0.0.1:{port}"
            plan: list[tuple[ClientKind, int]] = [("raw", level) for level in streams]
            if "httpx" in clients:
                plan.append(("httpx", max(streams)))

            async def measure() -> list[LevelResult]:
                await warm_up(url, "canned", workload, concurrency=min(max(streams), 8), count=WARMUP_REQUESTS)
                return [
                    await measure_level(
                        url,
                        "canned",
                        fixed_requests(workload, num_requests(level)),
                        streams=level,
                        pids={"server": child.pid},
                        expected_tokens=output_tokens,
                        timeout_s=timeout_s,
                        client=client,
                    )
                    for client, level in plan
                ]

            return run_async(measure())
        finally:
            stop_child(child, timeout_s=5)


@dataclass
class OverheadReport:
    model: str
    model_dir: str
    prompt_tokens: int
    output_tokens: int
    tier: Tier
    step_ms: float
    policy: str
    stack_ready_s: float
    levels: list[LevelResult]
    client_ceilings: list[LevelResult]
    wall_s: float
    targets: list[TargetCheck] = field(default_factory=list)
    prompt: PromptKind = "ids"
    # ``bench.cpu.interpreter_ns_per_iteration`` before the stack started: compare runs by it.
    python_loop_ns: float | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": "null (one token per running request per step)",
            "step_ms": self.step_ms,
            "policy": self.policy,
            "machine": {
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "platform": sys.platform,
                "python_loop_ns": self.python_loop_ns,
            },
            "model": self.model,
            "model_dir": self.model_dir,
            "prompt_tokens": self.prompt_tokens,
            "prompt": self.prompt,
            "output_tokens": self.output_tokens,
            "tier": self.tier,
            "stack_ready_s": self.stack_ready_s,
            "wall_s": self.wall_s,
            "levels": [level.as_dict() for level in self.levels],
            "client_ceilings": [level.as_dict() for level in self.client_ceilings],
            "targets": [asdict(check) for check in self.targets],
        }
        return data


def run(
    *,
    model_dir: Path,
    streams: Sequence[int],
    output_tokens: int,
    prompt_tokens: int,
    requests_per_level: int | None,
    timeout_s: float,
    client_ceiling: bool,
    log_dir: Path,
    clients: Sequence[ClientKind] = CLIENTS,
    progress: Progress,
    step_ms: float = 0.0,
    policy: str = "tailcut",
    prompt: PromptKind = "ids",
    on_level: Callable[[LevelResult], None] | None = None,
) -> OverheadReport:
    """Start the stack, measure every level with each client, stop the stack, then (optionally) measure the
    clients' ceilings against the canned server."""
    from tailcut.models import served_name

    started = time.monotonic()
    python_loop_ns = interpreter_ns_per_iteration()
    workload = fixed_workload(prompt_tokens, output_tokens)
    top = max(streams)
    worker_env = {
        "TAILCUT_ENGINE__KIND": "null",
        "TAILCUT_ENGINE__MAX_NUM_SEQS": str(max(top, 1)),
        "TAILCUT_MAX_RUNNING": str(max(top, 1)),
        "TAILCUT_ENGINE__NULL_STEP_MS": f"{step_ms:g}",
        "TAILCUT_SCHEDULER__POLICY": policy,
    }
    # A closed loop bounds the queue by the stream count; shedding (a 429 past the tier's queue bound, which
    # counts requests admitted since its last probe) is not what this measures.
    env = {"TAILCUT_SHED_NORMAL_WAITING": "0"}
    model = served_name(model_dir, None)
    request_s = output_tokens * step_ms / 1000  # the least time one request takes in the engine
    levels: list[LevelResult] = []
    progress(f"starting a private redis-server, the API and one null-engine worker ({model_dir})")
    with tailcut_stack(model_dir, log_dir, env=env, worker_env=worker_env, progress=progress) as stack:
        progress(f"tailcut ready at {stack.url} in {stack.ready_s:.1f} s")

        async def measure_all() -> None:
            await warm_up(stack.url, model, workload, concurrency=min(top, 8), count=WARMUP_REQUESTS, prompt=prompt)
            for client in clients:
                for level in streams:
                    count = requests_per_level or default_num_requests(level, request_s=request_s)
                    progress(f"{client} client, {level} concurrent streams, {count} requests of {output_tokens} tokens")
                    result = await measure_level(
                        stack.url,
                        model,
                        fixed_requests(workload, count, prompt=prompt),
                        streams=level,
                        pids=stack.pids,
                        expected_tokens=output_tokens,
                        timeout_s=timeout_s,
                        client=client,
                    )
                    levels.append(result)
                    if on_level is not None:
                        on_level(result)

        run_async(measure_all())
        ready_s = stack.ready_s
    ceilings = []
    if client_ceiling:
        httpx = f", httpx at {top}" if "httpx" in clients else ""
        progress(f"clients' ceilings against a canned SSE server: raw at {list(streams)} streams{httpx}")
        ceilings = measure_client_ceilings(
            workload,
            streams=streams,
            num_requests=lambda level: requests_per_level or default_num_requests(level, request_s=request_s),
            output_tokens=output_tokens,
            timeout_s=timeout_s,
            clients=clients,
        )
    report = OverheadReport(
        model=model,
        model_dir=str(model_dir),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tier=DEFAULT_TIER,
        step_ms=step_ms,
        policy=policy,
        stack_ready_s=ready_s,
        levels=levels,
        client_ceilings=ceilings,
        wall_s=time.monotonic() - started,
        prompt=prompt,
        python_loop_ns=python_loop_ns,
    )
    report.targets = check_targets(levels, ceilings, step_ms=step_ms)
    return report


# --- the command ----------------------------------------------------------------------------------------


def parse_clients(text: str) -> list[ClientKind]:
    """``--clients``: a comma-separated subset of ``CLIENTS``, in the order measured."""
    clients = [client for client in CLIENTS if client in text.split(",")]
    unknown = set(text.split(",")) - set(CLIENTS)
    if unknown or not clients:
        raise FatalError(f"--clients takes a comma-separated subset of {','.join(CLIENTS)}, got {text!r}")
    return clients


def command(args: Any) -> None:
    """``tailcut bench overhead`` (``args`` from ``bench.cli``)."""
    from rich.console import Console

    from tailcut.models import prepare_tiny, resolve_model
    from tailcut.settings import CommonSettings

    streams = parse_streams(args.streams) if args.streams else list(DEFAULT_STREAMS)
    if args.tokens < 2 or args.prompt_tokens < 1:
        raise FatalError("--tokens must be at least 2 (gaps need two chunks) and --prompt-tokens at least 1")
    if args.step_ms < 0:
        raise FatalError("--step-ms must not be negative")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise FatalError("--requests-per-level must be at least 1")
    status_console = Console(stderr=True, highlight=False)
    console = Console(width=None if sys.stdout.isatty() else 160)
    settings = CommonSettings()
    if args.model:
        model_dir = resolve_model(args.model, settings.cache_dir, progress=status_console.log)
    else:
        model_dir = prepare_tiny(settings.cache_dir, progress=status_console.log)
    with log_folder(args.out, "tailcut-overhead-") as log_dir:
        report = run(
            model_dir=model_dir,
            streams=streams,
            output_tokens=args.tokens,
            prompt_tokens=args.prompt_tokens,
            requests_per_level=args.requests_per_level,
            timeout_s=args.timeout_s,
            client_ceiling=args.client_ceiling,
            clients=parse_clients(args.clients),
            log_dir=log_dir,
            progress=status_console.log,
            step_ms=args.step_ms,
            policy=args.policy,
            prompt=args.prompt,
        )
    print_report(console, report)
    if args.out:
        arguments = {name: value for name, value in vars(args).items() if name != "func"}
        path = write_outputs(report, Path(args.out), command=sys.argv, arguments=arguments)
        console.print(f"wrote {path} and {path.with_name('overhead_latency.png')}")
