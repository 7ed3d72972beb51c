"""``tailcut chaos``: faults against a stack of its own; prints what was lost (nothing, we hope)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chaos = sub.add_parser(
        "chaos",
        help="run a mixed load against a stack of its own while killing workers, pausing engines, restarting Redis",
        description=__doc__,
    )
    chaos.add_argument("--duration", type=float, default=120.0, help="seconds of load and faults (default 120)")
    chaos.add_argument("--workers", type=int, default=2, help="worker processes, each with its own engine")
    chaos.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    chaos.add_argument("--fault-every", dest="fault_every", type=float, default=15.0, help="seconds between faults")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--model", help="model folder (default: the tiny random-weight test model)")
    chaos.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    chaos.add_argument("--out", help="folder for chaos.json and the processes' logs")
    chaos.set_defaults(func=command)


def command(args: Any) -> None:
    import tempfile

    from rich.console import Console

    from bench.chaos import ChaosConfig, run
    from bench.chaos_report import HEADLINE, print_summary, summary
    from tailcut.models import prepare_tiny
    from tailcut.processes import interrupt_on_signals
    from tailcut.settings import CommonSettings

    interrupt_on_signals()  # SIGTERM stops the stack like Ctrl-C
    console = Console(stderr=True, highlight=False)
    model_dir = Path(args.model) if args.model else prepare_tiny(CommonSettings().cache_dir)
    config = ChaosConfig(
        duration_s=args.duration,
        num_workers=args.workers,
        concurrency=args.concurrency,
        seed=args.seed,
        fault_every_s=args.fault_every,
    )
    out = Path(args.out) if args.out else None
    log_dir = (out / "logs") if out else Path(tempfile.mkdtemp(prefix="tailcut-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(config, model_dir, log_dir, progress=console.log))
    counts = summary(result)
    if out is not None:
        (out / "chaos.json").write_bytes(orjson.dumps(counts, option=orjson.OPT_INDENT_2))
    if args.as_json:
        ordered = {key: counts[key] for key in HEADLINE} | {k: v for k, v in counts.items() if k not in HEADLINE}
        sys.stdout.write(orjson.dumps(ordered).decode() + "\n")
    else:
        print_summary(Console(), counts)
        console.log(f"process logs in {log_dir}")
    bad = counts["lost"] + counts["duplicate_chunks"] + counts["missing_tokens"] + counts["different_from_reference"]
    sys.exit(1 if bad or counts["idempotency_violations"] else 0)
