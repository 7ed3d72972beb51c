"""``tailcut bench ...``: every benchmark prints a table and, with ``--out DIR``, writes JSON there."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from bench import policies as policies_module
    from bench.stats import TargetCheck


def starts_servers(command: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """For a benchmark that starts servers: SIGTERM (a `timeout`, a CI runner) stops it like Ctrl-C, so
    its servers are stopped on the way out, not orphaned."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> None:
        from tailcut.up import interrupt_on_signals

        interrupt_on_signals()
        command(args)

    return run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks (each compares two things in one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    predictor = bench_sub.add_parser("predictor", help="output-length predictor: cost per call and error")
    predictor.add_argument("--calls", type=int, default=100_000)
    predictor.add_argument("--seed", type=int, default=0)
    predictor.add_argument("--out", help="folder for predictor.json")
    predictor.set_defaults(func=cmd_predictor)
    _add_policies_parser(bench_sub)
    _add_load_parser(bench_sub)
    _add_overhead_parser(bench_sub)
    _add_vs_vllm_parser(bench_sub)
    _add_live_parser(bench_sub)


def cmd_predictor(args: argparse.Namespace) -> None:
    from bench.predictor import as_dict, run

    report = run(calls=args.calls, seed=args.seed)
    table = Table(title=f"output-length predictor, {report.calls:,} admissions (seed-mix lengths)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("cost per predict, mean", f"{report.mean_us:.2f} µs")
    table.add_row(
        "cost per predict, p50 / p99 / max", f"{report.p50_us:.2f} / {report.p99_us:.2f} / {report.max_us:.1f} µs"
    )
    table.add_row("budget", f"{report.budget_us:.0f} µs")
    table.add_row("mean abs error, learned", f"{report.mae_learned_tokens:.1f} tokens")
    table.add_row("mean abs error, per-tier prior", f"{report.mae_prior_tokens:.1f} tokens")
    table.add_row("error ratio learned / prior", f"{report.mae_learned_tokens / report.mae_prior_tokens:.2f}")
    Console().print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "predictor.json").write_bytes(orjson.dumps(as_dict(report), option=orjson.OPT_INDENT_2))


def _add_load_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    load = bench_sub.add_parser(
        "load",
        help="send a workload to a server: open-loop Poisson (--rate) or closed loop (-c)",
        description="Open loop: --rate R with --duration S or -n N. Closed loop (like ab): -c C with -n N.",
    )
    load.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (tailcut or vllm serve)")
    load.add_argument("--workload", default="seed-mix", help="shipped workload name or a .json path")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    load.add_argument("--duration", type=float, help="open loop: seconds of arrivals")
    load.add_argument("-c", "--concurrency", type=int, help="closed loop: concurrent requests")
    load.add_argument("-n", "--num-requests", dest="num_requests", type=int, help="number of requests")
    load.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same requests)")
    load.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    load.add_argument("--label", help="name of this run in plots (default: the URL)")
    load.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0, help="hard limit of the run")
    load.add_argument("--out", help="folder for load.json and the CDF plots")
    load.set_defaults(func=cmd_load)


def cmd_load(args: argparse.Namespace) -> None:
    import asyncio
    import sys
    from collections import Counter
    from dataclasses import asdict

    from bench import client, loadgen, plots, stats
    from bench.workloads import WorkloadError, load_workload, poisson_trace
    from tailcut.errors import FatalError

    open_loop = args.rate is not None and (args.duration is None) != (args.num_requests is None)
    closed_loop = args.concurrency is not None and args.num_requests is not None and args.duration is None
    if open_loop == closed_loop or (args.rate is not None and args.concurrency is not None):
        raise FatalError("give --rate R with --duration S or -n N (open loop), or -c C with -n N (closed loop)")
    try:
        workload = load_workload(args.workload)
    except WorkloadError as exc:
        raise FatalError(str(exc)) from exc
    model = args.model or asyncio.run(client.fetch_model(args.url))
    if open_loop:
        trace = poisson_trace(workload, args.rate, seed=args.seed, duration_s=args.duration, count=args.num_requests)
        mode = f"open loop, Poisson {args.rate:g} req/s"
        run = loadgen.run_open_loop(args.url, model, trace, timeout_s=args.timeout_s, show_progress=True)
    else:
        trace = loadgen.closed_loop_requests(workload, args.num_requests, seed=args.seed)
        mode = f"closed loop, {args.concurrency} concurrent"
        run = loadgen.run_closed_loop(
            args.url, model, trace, concurrency=args.concurrency, timeout_s=args.timeout_s, show_progress=True
        )
    result = asyncio.run(run)
    slos = {mix.tier: mix.slo for mix in workload.tiers}
    tier_rows, bucket_rows = stats.report_rows(result.records, slos, result.duration_s)
    title = f"{workload.name} → {args.url} ({model}), {mode}, {len(trace)} requests in {result.duration_s:.1f} s"
    console = Console()
    console.print(title)
    console.print(*stats.report_tables(tier_rows, "per tier"))
    console.print(*stats.report_tables(bucket_rows, "per tier × bucket (client-side buckets)"))
    console.print(
        f"goodput {stats.goodput_rps(result.records, slos, result.duration_s):.2f} req/s, "
        f"output {stats.output_tokens_per_s(result.records, result.duration_s):.1f} tok/s"
    )
    failures = Counter(record.error for record in result.records if record.error)
    if failures:
        console.print("failures: " + ", ".join(f"{count}× {error}" for error, count in failures.most_common(5)))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "command": sys.argv,
            "arguments": {name: value for name, value in vars(args).items() if name != "func"},
            "workload": workload.name,
            "url": args.url,
            "model": model,
            "label": args.label or args.url,
            "mode": mode,
            "seed": args.seed,
            "timeout_s": args.timeout_s,
            "prompt_salt": result.prompt_salt,
            "duration_s": result.duration_s,
            "tiers": [asdict(row) for row in tier_rows],
            "buckets": [asdict(row) for row in bucket_rows],
            "records": [asdict(record) for record in result.records],
        }
        (out / "load.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        note = f"LIVE: {mode}, {workload.name}, {len(trace)} requests, {args.url}"
        cdf_metrics: dict[str, stats.Metric] = {"e2e": "e2e_ms", "ttft": "ttft_ms"}
        for name, metric in cdf_metrics.items():
            series = {args.label or args.url: stats.by_tier(result.records, metric)}
            plots.plot_cdf(series, name.upper(), out / f"load_cdf_{name}.png", note=note)
        console.print(f"wrote {out / 'load.json'} and the CDF plots")


def _add_policies_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policies = bench_sub.add_parser(
        "policies",
        help="SIMULATOR: every policy at 50-120%% of fifo capacity on one trace (virtual clock)",
        description="Replays one seeded Poisson trace per load through static-batch, fifo, vllm-priority and "
        "tailcut (and tailcut's other budget rules) on the sim engine's virtual clock, then checks the targets "
        "of WORKLOADS.md. No model runs: step times come from a published GPU cost model.",
    )
    policies.add_argument("--workload", default="seed-mix", help="shipped workload name or a .json path")
    policies.add_argument("--cost-model", default="h100-llama3-8b", help="h100-llama3-8b or a100-llama3-8b")
    policies.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same figures)")
    policies.add_argument("--duration", type=float, default=120.0, help="virtual seconds of arrivals per run")
    policies.add_argument(
        "--loads",
        default="0.5,0.7,0.9,1.0,1.2",
        help="shares of fifo capacity, comma-separated (must hold 0.9, 1.0, 1.2)",
    )
    policies.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    policies.add_argument("--out", help="folder for results.json and the plots")
    policies.set_defaults(func=cmd_policies)


def cmd_policies(args: argparse.Namespace) -> None:
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import policies
    from bench.workloads import workload_and_cost
    from tailcut.errors import FatalError

    workload, cost = workload_and_cost(args.workload, args.cost_model)
    try:
        loads = tuple(float(value) for value in args.loads.split(","))
    except ValueError as exc:
        raise FatalError(f"--loads must be numbers separated by commas, got {args.loads!r}") from exc
    if not {0.9, 1.0, 1.2} <= set(loads) or min(loads) <= 0:
        raise FatalError("--loads must be positive and hold 0.9, 1.0 and 1.2 (the targets are checked there)")
    if args.duration <= 0:
        raise FatalError("--duration must be positive")
    # Wide enough for the tables when the output goes to a file or a pipe.
    console = Console(width=None if sys.stdout.isatty() else 150)
    note = policies.note(cost)
    console.print(f"[bold]{note}[/bold]")
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    ) as progress:
        task = progress.add_task("measuring fifo capacity", total=None)

        def started(total: int) -> None:
            progress.update(task, total=total, description="")

        def done(result: policies.JobResult) -> None:
            progress.update(task, advance=1, description=f"{result.job.variant.label} at {result.job.load:.0%}")

        report = policies.run(
            workload,
            cost,
            seed=args.seed,
            duration_s=args.duration,
            loads=loads,
            jobs=args.jobs,
            on_start=started,
            on_done=done,
        )
    checks = policies.check_targets(report)
    _print_policies(console, report, checks)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        results = {
            "simulated": True,
            "note": note,
            "command": sys.argv,
            "cost_model": {
                "name": cost.name,
                "base_us": cost.base_us,
                "prefill_token_us": cost.prefill_token_us,
                "decode_seq_us": cost.decode_seq_us,
            },
            "workload": workload.model_dump(),
            "seed": args.seed,
            "duration_s": args.duration,
            "capacity_rps": report.capacity_rps,
            "wall_s": report.wall_s,
            "runs": [row for result in report.results for row in result.rows],
            "run_stats": [result.run for result in report.results],
            "kv": [result.run | {"rows": result.rows} for result in report.kv_results],
            "targets": [{"name": c.name, "value": c.value, "target": c.target, "met": c.met} for c in checks],
        }
        (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
        _plot_policies(report, out, note)
        console.print(f"wrote {out / 'results.json'} and the plots in {out}")


def _print_policies(console: Console, report: policies_module.PoliciesReport, checks: list[TargetCheck]) -> None:
    console.print(
        f"workload {report.workload.name}, seed {report.seed}, {report.duration_s:g} virtual s per run; "
        f"fifo capacity {report.capacity_rps:.1f} req/s; {len(report.results) + len(report.kv_results)} runs "
        f"in {report.wall_s:.0f} s wall"
    )
    for tier in ("realtime", "normal"):
        table = Table(title=f"{tier}: latency beside the floor and the background throughput left (SIMULATOR)")
        for column in (
            "policy",
            "load",
            "P99 TTFT",
            "P50 E2E",
            "P99 E2E",
            "floor",
            "E2E/floor",
            "attain.",
            "bg tok/s",
            "offered",
            "429s",
        ):
            table.add_column(column, justify="left" if column == "policy" else "right")
        for result in report.results:
            row = next((row for row in result.rows if row["tier"] == tier), None)
            if row is None:
                continue
            background = next(row for row in result.rows if row["tier"] == "background")
            rejected = sum(r["rejected"] for r in result.rows)
            table.add_row(
                row["policy"],
                f"{row['load']:.0%}",
                _ms(row["p99_ttft_ms"]),
                _ms(row["p50_e2e_ms"]),
                _ms(row["p99_e2e_ms"]),
                _ms(row["floor_e2e_ms"]),
                f"{row['p99_e2e_ms'] / row['floor_e2e_ms']:.2f}",
                f"{row['attainment']:.1%}",
                f"{background['output_tokens_per_s']:,.0f}",
                f"{background['offered_tokens_per_s']:,.0f}",
                str(rejected),
            )
        console.print(table)
    kv = Table(title="KV cache: static reservation vs paged blocks (fifo at 90%, max_tokens = tier cap; SIMULATOR)")
    for column in ("allocation", "mean use", "peak use", "slots holding KV", "max running", "rt P99 E2E"):
        kv.add_column(column, justify="left" if column == "allocation" else "right")
    for result in report.kv_results:
        stats = result.run
        realtime = next(row for row in result.rows if row["tier"] == "realtime")
        name = "static" if stats["kv_allocation"] == "static" else f"paged {stats['block_size']}"
        kv.add_row(
            name,
            f"{stats['kv_mean_usage']:.1%}",
            f"{stats['kv_peak_usage']:.1%}",
            f"{stats['kv_filled_share']:.1%}",
            str(stats["max_running"]),
            _ms(realtime["p99_e2e_ms"]),
        )
    console.print(kv)
    targets = Table(title="targets (WORKLOADS.md) for tailcut")
    for column in ("target", "measured", "wanted", ""):
        targets.add_column(column, justify="left" if column == "target" else "right")
    for check in checks:
        targets.add_row(
            check.name,
            "-" if check.value is None else f"{check.value:.3f}",
            check.target,
            "met" if check.met else "[red]missed[/red]",
        )
    console.print(targets)


def _plot_policies(report: policies_module.PoliciesReport, out: Path, note: str) -> None:
    from bench import plots

    at_90 = [result for result in report.results if result.job.load == 0.9]
    for name, attribute in (("e2e", "e2e_ms"), ("ttft", "ttft_ms")):
        series = {result.job.variant.label: getattr(result, attribute) for result in at_90}
        plots.plot_cdf(series, name.upper(), out / f"policies_cdf_{name}_90.png", note=f"90% load; {note}", log_x=True)
        key = f"p99_{name}_ms"
        rows = [
            (row["policy"], row["load"], row[key])
            for result in report.results
            if result.job.variant.policy != "static-batch"
            for row in result.rows
            if row["tier"] == "realtime"
        ]
        floor = None
        if name == "e2e":
            floor = {
                row["load"]: row["floor_e2e_ms"]
                for result in report.results
                for row in result.rows
                if row["tier"] == "realtime"
            }
        plots.plot_p99_vs_load(
            rows,
            out / f"policies_p99_{name}_vs_load.png",
            note=f"realtime tier (static-batch off the scale)\n{note}",
            metric=f"P99 {name.upper()}",
            load_label="load (share of fifo capacity)",
            floor_ms=floor,
            log_y=True,
        )


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 10_000 else f"{value:.0f} ms"


def _add_overhead_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    overhead = bench_sub.add_parser(
        "overhead",
        help="LIVE: tailcut's own latency and chunk rate with the zero-cost null engine",
        description="Starts a private redis-server, the API and one worker running the null engine (no model, "
        "no cost), then runs a closed loop of fixed-length requests at each concurrency level, with the httpx "
        "benchmark client and with a raw one that only counts chunks: TTFT is the latency tailcut adds, the chunk "
        "rate at the highest level is what one API process sustains. Prints CPU per process and per chunk.",
    )
    overhead.add_argument("--streams", default="1,50,200", help="concurrency levels, comma-separated")
    overhead.add_argument("--tokens", type=int, default=64, help="output tokens (= chunks) per request")
    overhead.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=16, help="prompt tokens")
    overhead.add_argument(
        "--requests-per-level",
        dest="requests_per_level",
        type=int,
        help="requests at each level (default: max(200, 5 x streams); with --step-ms, about 20 s at one stream)",
    )
    overhead.add_argument("--model", help="model folder (default: the tiny test model, built once in the cache)")
    overhead.add_argument(
        "--step-ms",
        dest="step_ms",
        type=float,
        default=0.0,
        help="null engine step time (0: zero cost; e.g. 10: one token per stream every 10 ms, like a real engine)",
    )
    overhead.add_argument(
        "--policy", default="tailcut", choices=["tailcut", "fifo", "vllm-priority"], help="the worker's scheduler"
    )
    overhead.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0, help="limit of each level")
    overhead.add_argument(
        "--no-client-ceiling",
        dest="client_ceiling",
        action="store_false",
        help="skip measuring the client against a canned SSE server",
    )
    overhead.add_argument("--out", help="folder for overhead.json, the plot and the processes' logs")
    overhead.set_defaults(func=cmd_overhead)


@starts_servers
def cmd_overhead(args: argparse.Namespace) -> None:
    from bench import overhead

    overhead.command(args)


def _add_vs_vllm_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    vs_vllm = bench_sub.add_parser(
        "vs-vllm",
        help="LIVE: tailcut in front of vLLM against vLLM's own OpenAI server, same engine options and load",
        description="Runs tailcut (private Redis, API, one vLLM worker) and then vLLM's own OpenAI server with the "
        "engine options tailcut's worker uses, one at a time, under the same closed-loop load: TTFT at "
        "concurrency 1 and output tokens/s at concurrency 16.",
    )
    vs_vllm.add_argument("--model", default="smollm2", help="model folder or `smollm2` (default, embedded)")
    vs_vllm.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=32, help="prompt tokens")
    vs_vllm.add_argument("--tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    vs_vllm.add_argument("--requests-c1", dest="requests_c1", type=int, default=30, help="requests at concurrency 1")
    vs_vllm.add_argument("--concurrency", type=int, default=16, help="the throughput level")
    vs_vllm.add_argument(
        "--requests-cn", dest="requests_cn", type=int, default=64, help="requests at the throughput level"
    )
    vs_vllm.add_argument("--max-model-len", dest="max_model_len", type=int, default=2048, help="for both servers")
    vs_vllm.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of both systems, in alternating order (A B, B A): the figures pool the rounds",
    )
    vs_vllm.add_argument(
        "--engine-cores",
        dest="engine_cores",
        type=int,
        help="cores for the CPU engine's compute threads on both sides, the rest left to the serving processes "
        "as on a GPU host (default: every core)",
    )
    vs_vllm.add_argument("--only", choices=["tailcut", "vllm"], help="run one side only (no comparison; for debugging)")
    vs_vllm.add_argument("--start-timeout-s", dest="start_timeout_s", type=float, default=300.0)
    vs_vllm.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0, help="limit of each level")
    vs_vllm.add_argument("--out", help="folder for vs_vllm.json, the plot and the servers' logs")
    vs_vllm.set_defaults(func=cmd_vs_vllm)


@starts_servers
def cmd_vs_vllm(args: argparse.Namespace) -> None:
    from bench import vs_vllm

    vs_vllm.command(args)


def _add_live_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    live = bench_sub.add_parser(
        "live",
        help="SIMULATOR in real time: fifo and tailcut through the real pipeline vs the virtual clock, same trace",
        description="Runs the seeded Poisson trace at LOAD x fifo capacity through the real pipeline (private "
        "Redis, API, one worker with the sim engine stepping in real time, TIME_SCALE real seconds per simulated "
        "second), one policy at a time, and on the virtual clock; compares the ratios tailcut / fifo of both. "
        "No model runs: step times come from a published GPU cost model.",
    )
    live.add_argument("--workload", default="seed-mix", help="shipped workload name or a .json path")
    live.add_argument(
        "--cost-model", dest="cost_model", default="h100-llama3-8b", help="step-time cost model (or a100-llama3-8b)"
    )
    live.add_argument("--load", type=float, default=0.9, help="share of fifo capacity")
    live.add_argument("--duration", type=float, default=20.0, help="simulated seconds of arrivals")
    live.add_argument(
        "--time-scale",
        dest="time_scale",
        type=float,
        default=8.0,
        help="real seconds per simulated second (8: two shared cores keep the schedule at 90%% load)",
    )
    live.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same requests)")
    live.add_argument("--policies", default="fifo,tailcut", help="comma-separated: fifo, tailcut")
    live.add_argument("--model", help="model folder whose tokenizer the API uses (default: build the tiny one)")
    live.add_argument("--out", help="folder for live.json, the CDF plots and the processes' logs")
    live.set_defaults(func=cmd_live)


@starts_servers
def cmd_live(args: argparse.Namespace) -> None:
    from bench import live

    live.command(args)
