"""``tailcut bench ...``: every benchmark prints a table and, with ``--out DIR``, writes JSON there."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks (each compares two things in one run)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    predictor = bench_sub.add_parser("predictor", help="output-length predictor: cost per call and error")
    predictor.add_argument("--calls", type=int, default=100_000)
    predictor.add_argument("--seed", type=int, default=0)
    predictor.add_argument("--out", help="folder for predictor.json")
    predictor.set_defaults(func=cmd_predictor)


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
