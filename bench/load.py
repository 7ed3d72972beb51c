"""``tailcut bench load``: a workload against any OpenAI-compatible server (tailcut or ``vllm serve``),
open loop (Poisson arrivals) or closed loop; tables per tier and bucket, ``load.json`` (the summary),
``load-records.jsonl`` (every request) and CDF plots."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from bench import client, loadgen, plots, stats
from bench.records import record_row, write_records
from bench.workloads import WorkloadError, load_workload, poisson_trace
from tailcut.errors import FatalError


def command(args: Any) -> None:
    """``tailcut bench load`` (``args`` from ``bench.cli``)."""
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
        }
        (out / "load.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        records = write_records(out, "load", (record_row(record) for record in result.records))
        note = f"LIVE: {mode}, {workload.name}, {len(trace)} requests, {args.url}"
        cdf_metrics: dict[str, stats.Metric] = {"e2e": "e2e_ms", "ttft": "ttft_ms"}
        for name, metric in cdf_metrics.items():
            series = {args.label or args.url: stats.by_tier(result.records, metric)}
            plots.plot_cdf(series, name.upper(), out / f"load_cdf_{name}.png", note=note)
        console.print(f"wrote {out / 'load.json'}, {records} and the CDF plots")
