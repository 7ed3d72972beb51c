"""``tailcut bench warmup``: the first requests a fresh worker serves, cold against prefix-warmed.

Real engine (the embedded SmolLM2 on CPU by default). The trace is ``--requests`` (200) customer
questions from a Q&A file (``warmup/qa/customer-service.jsonl`` by default), drawn with the file's hit
counts as weights — the popular ones recur, and rarely asked ones beyond what warmup covers come too —
Poisson at ``--rate``, greedy, ``--tokens`` out. Each is sent as the exact prompt the API builds for a
chat with that question (its token ids, through ``/v1/completions``: token for token what
``/v1/chat/completions`` builds), so a warmed question meets its cached prefix.

Each round starts two fresh stacks — a private Redis, a new worker and engine whose prefix cache is
empty — and sends them the same trace: **cold** (no prefix file) at once when ready, and **warmed**
(``TAILCUT_WARMUP__PREFIX_FILE``) once its worker reports its warmup done on ``/readyz``. Neither runs
the staged ramp or the answer cache, so what differs is the prefix warmup alone. ``--rounds`` alternate
the two. Reported per side: TTFT P50/P99 of all requests and of each question's first ask (a later ask
finds its prompt cached on either side), and how long warmup took; the ratios are warmed over cold.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from bench.loadgen import run_open_loop
from bench.stack import RunningStack, log_folder, tailcut_stack
from bench.stats import RequestRecord, Summary, summarize
from bench.vllm_server import tailcut_env
from bench.workloads import Arrival
from tailcut.errors import FatalError
from tailcut.models import encode_chat
from tailcut.processes import Progress
from warmup.prefixes import QaEntry, conversation, load_qa

SAMPLE = Path(__file__).resolve().parent.parent / "warmup" / "qa" / "customer-service.jsonl"
WARMUP_TIMEOUT_S = 600.0


def question_trace(
    entries: list[QaEntry], tokenizer: Any, count: int, rate: float, *, output_tokens: int, seed: int
) -> tuple[list[Arrival], list[int]]:
    """Poisson arrivals of questions drawn by hit count; returns the trace and each request's question."""
    rng = np.random.default_rng([seed, 11])
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=count))
    weights = np.array([max(entry.hits, 1) for entry in entries], dtype=float)
    asked = [int(index) for index in rng.choice(len(entries), size=count, p=weights / weights.sum())]
    prompts = {index: tuple(encode_chat(tokenizer, conversation(entries[index]))) for index in set(asked)}
    trace = [
        Arrival(
            order,
            float(offsets[order]),
            "realtime",
            "bench",
            len(prompts[index]),
            output_tokens,
            prompt_ids=prompts[index],
        )
        for order, index in enumerate(asked)
    ]
    return trace, asked


@dataclass(frozen=True, slots=True)
class Side:
    warmed: bool
    round: int
    ok: int
    warmup_s: float | None  # from ready to warmup done (warmed side)
    warmup_prompts: int
    ttft_ms: Summary | None
    ttft_first_asks_ms: Summary | None


def first_asks(asked: list[int]) -> set[int]:
    seen: set[int] = set()
    firsts = set()
    for order, index in enumerate(asked):
        if index not in seen:
            seen.add(index)
            firsts.add(order)
    return firsts


def side_of(
    warmed: bool, round_index: int, records: list[RequestRecord], asked: list[int], warmup: tuple[float | None, int]
) -> Side:
    firsts = first_asks(asked)
    ok = [record for record in records if record.status == "ok" and record.ttft_ms is not None]
    return Side(
        warmed=warmed,
        round=round_index,
        ok=len(ok),
        warmup_s=warmup[0],
        warmup_prompts=warmup[1],
        ttft_ms=summarize([record.ttft_ms for record in ok if record.ttft_ms is not None]),
        ttft_first_asks_ms=summarize([r.ttft_ms for r in ok if r.index in firsts and r.ttft_ms is not None]),
    )


def wait_for_warmup(stack: RunningStack, timeout_s: float) -> tuple[float, int]:
    """Seconds until the worker's prefix warmup is done, and how many prompts it ran."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for state in httpx.get(f"{stack.url}/readyz", timeout=10).json().get("warmup", {}).values():
            done, _, total = str(state.get("prefix_warmup") or "0/0").partition("/")
            if int(total) > 0 and int(done) == int(total):
                return time.monotonic() - started, int(total)
        time.sleep(0.2)
    raise FatalError(f"the worker's prefix warmup did not finish within {timeout_s:.0f} s (see its log)")


def run(
    model_dir: Path,
    qa_file: Path,
    trace: list[Arrival],
    asked: list[int],
    *,
    rounds: int,
    log_dir: Path,
    max_model_len: int,
    progress: Progress,
    timeout_s: float,
) -> list[Side]:
    env, worker_env = tailcut_env(on_cpu=True, max_model_len=max_model_len)
    sides = []
    for round_index in range(rounds):
        for warmed in (False, True):
            name = "warmed" if warmed else "cold"
            progress(f"round {round_index + 1}/{rounds}, {name}: {len(trace)} requests to a fresh worker")
            extra = {"TAILCUT_WARMUP__PREFIX_FILE": str(qa_file)} if warmed else {}
            tag = f"{name}-{round_index + 1}"
            with tailcut_stack(model_dir, log_dir, env=env, worker_env={**worker_env, **extra}, log_tag=tag) as stack:
                warmup: tuple[float | None, int] = (None, 0)
                if warmed:
                    warmup = wait_for_warmup(stack, WARMUP_TIMEOUT_S)
                    progress(f"warmup done: {warmup[1]} prompts in {warmup[0]:.1f} s")
                model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
                result = asyncio.run(run_open_loop(stack.url, model, trace, timeout_s=timeout_s))
            sides.append(side_of(warmed, round_index, result.records, asked, warmup))
    return sides


def ratio(warm: Summary | None, cold: Summary | None, field: str) -> float | None:
    if warm is None or cold is None or getattr(cold, field) <= 0:
        return None
    return float(getattr(warm, field) / getattr(cold, field))


def report_of(sides: list[Side], trace: list[Arrival], asked: list[int], arguments: dict[str, Any]) -> dict[str, Any]:
    pairs = [(cold, warm) for cold, warm in zip(sides[::2], sides[1::2], strict=True)]
    per_round = [
        {
            "round": cold.round,
            "ttft_p50": ratio(warm.ttft_ms, cold.ttft_ms, "p50"),
            "ttft_p99": ratio(warm.ttft_ms, cold.ttft_ms, "p99"),
            "first_asks_ttft_p50": ratio(warm.ttft_first_asks_ms, cold.ttft_first_asks_ms, "p50"),
            "first_asks_ttft_p99": ratio(warm.ttft_first_asks_ms, cold.ttft_first_asks_ms, "p99"),
        }
        for cold, warm in pairs
    ]
    colds = [side for side in sides if not side.warmed]
    pooled = {
        name: float(np.median([value for value in (r[name] for r in per_round) if value is not None] or [np.nan]))
        for name in ("ttft_p50", "ttft_p99", "first_asks_ttft_p50", "first_asks_ttft_p99")
    }
    return {
        "benchmark": "warmup",
        "rounds": len(colds),
        "median_ratio_over_rounds": pooled,
        "arguments": arguments,
        "requests": len(trace),
        "distinct_questions": len(set(asked)),
        "mean_prompt_tokens": float(np.mean([arrival.prompt_tokens for arrival in trace])) if trace else 0.0,
        "sides": [asdict(side) for side in sides],
        "ratios_warmed_over_cold": per_round,
    }


def command(args: Any) -> None:
    """``tailcut bench warmup`` (``args`` from ``bench.cli``)."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from tailcut.models import resolve_model
    from tailcut.settings import CommonSettings

    if args.requests < 1 or args.rate <= 0 or args.rounds < 1:
        raise FatalError("need --requests >= 1, --rate > 0 and --rounds >= 1")
    console = Console(stderr=True, highlight=False)
    with console.status("preparing the model"):
        model_dir = resolve_model(args.model, CommonSettings().cache_dir, progress=console.log)
    qa_file = Path(args.qa).resolve() if args.qa else SAMPLE
    entries = load_qa(qa_file)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trace, asked = question_trace(
        entries, tokenizer, args.requests, args.rate, output_tokens=args.tokens, seed=args.seed
    )
    arguments = {name: value for name, value in vars(args).items() if name != "func"} | {"qa": str(qa_file)}
    with log_folder(args.out, "tailcut-bench-warmup-") as log_dir:
        sides = run(
            model_dir, qa_file, trace, asked, rounds=args.rounds, log_dir=log_dir, max_model_len=args.max_model_len,
            progress=console.log, timeout_s=args.timeout_s,
        )  # fmt: skip
    report = report_of(sides, trace, asked, arguments)
    out = Console(width=None if sys.stdout.isatty() else 160)
    out.print(
        f"{report['requests']} requests, {report['distinct_questions']} distinct questions, "
        f"{report['mean_prompt_tokens']:.0f} prompt tokens on average"
    )
    nan = float("nan")
    for side in report["sides"]:
        ttft, firsts = side["ttft_ms"] or {}, side["ttft_first_asks_ms"] or {}
        warmup = f", warmup {side['warmup_prompts']} prompts in {side['warmup_s']:.1f} s" if side["warmed"] else ""
        out.print(
            f"round {side['round'] + 1} {'warmed' if side['warmed'] else 'cold  '}: "
            f"ok {side['ok']}/{report['requests']}, "
            f"TTFT P50 {ttft.get('p50', nan):.1f} ms P99 {ttft.get('p99', nan):.1f} ms; "
            f"first asks P50 {firsts.get('p50', nan):.1f} ms P99 {firsts.get('p99', nan):.1f} ms{warmup}"
        )
    out.print(
        {"median over rounds": {name: round(value, 3) for name, value in report["median_ratio_over_rounds"].items()}}
    )
    for ratios in report["ratios_warmed_over_cold"]:
        out.print(
            {name: value if value is None or name == "round" else round(value, 3) for name, value in ratios.items()}
        )
    if args.out:
        path = Path(args.out) / "warmup.json"
        path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        out.print(f"wrote {path}")
