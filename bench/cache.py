"""``tailcut bench cache``: the answer cache on a workload with exact repeats, against the cache off.

One open-loop Poisson trace of greedy requests on the real engine (the embedded SmolLM2 on CPU by default),
run twice through the same stack — answer cache off, then on — each time on a fresh private Redis and a
fresh worker (so the engine's prefix cache starts cold both times). ``--repeat-share`` of the requests
(30%) are exact repeats of one of the first ``--popular`` distinct questions, drawn with Zipf weights, as
a support desk's frequent questions are; the rest are distinct. With K = 2 a question's first repeat is
generated and stored, later ones are hits, so the hit rate stays below the repeat share. Reported: the
hit rate (the API's own counters), TTFT P50/P99 of all requests and of the repeats, cache on / off.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import run_open_loop
from bench.stack import log_folder, tailcut_stack
from bench.stats import RequestRecord, Summary, summarize
from bench.vllm_server import tailcut_env
from bench.workloads import Arrival
from tailcut.errors import FatalError
from tailcut.processes import Progress

DEFAULT_REQUESTS = 200
DEFAULT_RATE = 2.0
DEFAULT_REPEAT_SHARE = 0.3
DEFAULT_POPULAR = 20
ZIPF_S = 1.1


def repeat_trace(
    count: int, rate: float, *, repeat_share: float, popular: int, prompt_tokens: int, output_tokens: int, seed: int
) -> list[Arrival]:
    """Poisson arrivals at ``rate``; each request after the first ``popular`` is, with probability
    ``repeat_share``, an exact repeat of one of the first ``popular`` (Zipf weights)."""
    rng = np.random.default_rng([seed, 7])
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=count))
    weights = 1.0 / np.arange(1, popular + 1) ** ZIPF_S
    weights /= weights.sum()
    trace = []
    for index in range(count):
        arrival = Arrival(index, float(offsets[index]), "realtime", "bench", prompt_tokens, output_tokens)
        if index >= popular and rng.random() < repeat_share:
            arrival = replace(arrival, prompt_of=int(rng.choice(popular, p=weights)))
        trace.append(arrival)
    return trace


@dataclass(frozen=True, slots=True)
class Side:
    cache: bool
    ok: int
    lookups: dict[str, float]
    ttft_ms: Summary | None
    ttft_repeats_ms: Summary | None
    ttft_distinct_ms: Summary | None

    @property
    def hit_rate(self) -> float:
        return self.lookups.get("hit", 0.0) / max(1, self.ok)


# Both pools: the tenants' answer cache and the shared tiny-request pool.
LOOKUP_SAMPLES = ("tailcut_answer_cache_lookups_total", "tailcut_tiny_pool_lookups_total")


def lookups_of(metrics: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name in LOOKUP_SAMPLES:
                result = sample.labels["result"]
                found[result] = found.get(result, 0.0) + sample.value
    return found


def side_of(cache: bool, trace: list[Arrival], records: list[RequestRecord], lookups: dict[str, float]) -> Side:
    repeats = {arrival.index for arrival in trace if arrival.prompt_of is not None}
    ok = [record for record in records if record.status == "ok" and record.ttft_ms is not None]
    return Side(
        cache=cache,
        ok=len(ok),
        lookups=lookups,
        ttft_ms=summarize([record.ttft_ms for record in ok if record.ttft_ms is not None]),
        ttft_repeats_ms=summarize([r.ttft_ms for r in ok if r.index in repeats and r.ttft_ms is not None]),
        ttft_distinct_ms=summarize([r.ttft_ms for r in ok if r.index not in repeats and r.ttft_ms is not None]),
    )


def run(
    model_dir: Path, trace: list[Arrival], *, log_dir: Path, max_model_len: int, progress: Progress, timeout_s: float
) -> list[Side]:
    env, worker_env = tailcut_env(on_cpu=True, max_model_len=max_model_len)
    sides = []
    salt = 12345  # the same prompts on both sides
    for cache in (False, True):
        progress(f"answer cache {'on' if cache else 'off'}: {len(trace)} requests")
        side_env = {**env, "TAILCUT_CACHE_ENABLED": "true" if cache else "false"}
        tag = "cache-on" if cache else "cache-off"
        stack_of = tailcut_stack(model_dir, log_dir, env=side_env, worker_env=worker_env, log_tag=tag)
        with stack_of as stack:
            model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
            result = asyncio.run(run_open_loop(stack.url, model, trace, prompt_salt=salt, timeout_s=timeout_s))
            lookups = lookups_of(httpx.get(f"{stack.url}/metrics", timeout=10).text)
        sides.append(side_of(cache, trace, result.records, lookups))
    return sides


def ratio(on: Summary | None, off: Summary | None, field: str) -> float | None:
    if on is None or off is None or getattr(off, field) <= 0:
        return None
    return float(getattr(on, field) / getattr(off, field))


def report_of(sides: list[Side], trace: list[Arrival], arguments: dict[str, Any]) -> dict[str, Any]:
    off, on = sides
    return {
        "benchmark": "cache",
        "arguments": arguments,
        "requests": len(trace),
        "repeats": sum(arrival.prompt_of is not None for arrival in trace),
        "sides": [{**asdict(side), "hit_rate": side.hit_rate} for side in sides],
        "ratios_on_over_off": {
            "ttft_p50": ratio(on.ttft_ms, off.ttft_ms, "p50"),
            "ttft_p99": ratio(on.ttft_ms, off.ttft_ms, "p99"),
            "repeats_ttft_p50": ratio(on.ttft_repeats_ms, off.ttft_repeats_ms, "p50"),
            "repeats_ttft_p99": ratio(on.ttft_repeats_ms, off.ttft_repeats_ms, "p99"),
        },
    }


def command(args: Any) -> None:
    """``tailcut bench cache`` (``args`` from ``bench.cli``)."""
    from rich.console import Console

    from tailcut.models import resolve_model
    from tailcut.settings import CommonSettings

    if not 0 <= args.repeat_share < 1 or args.popular < 1 or args.requests <= args.popular or args.rate <= 0:
        raise FatalError("need 0 <= --repeat-share < 1, --popular >= 1, --requests > --popular and --rate > 0")
    console = Console(stderr=True, highlight=False)
    with console.status("preparing the model"):
        model_dir = resolve_model(args.model, CommonSettings().cache_dir, progress=console.log)
    trace = repeat_trace(
        args.requests, args.rate, repeat_share=args.repeat_share, popular=args.popular,
        prompt_tokens=args.prompt_tokens, output_tokens=args.tokens, seed=args.seed,
    )  # fmt: skip
    arguments = {name: value for name, value in vars(args).items() if name != "func"}
    with log_folder(args.out, "tailcut-bench-cache-") as log_dir:
        sides = run(
            model_dir, trace, log_dir=log_dir, max_model_len=args.max_model_len, progress=console.log,
            timeout_s=args.timeout_s,
        )  # fmt: skip
    report = report_of(sides, trace, arguments)
    out = Console(width=None if sys.stdout.isatty() else 160)
    for side in report["sides"]:
        ttft, repeats = side["ttft_ms"] or {}, side["ttft_repeats_ms"] or {}
        out.print(
            f"cache {'on ' if side['cache'] else 'off'}: ok {side['ok']}/{report['requests']}, "
            f"hit rate {100 * side['hit_rate']:.1f}%, TTFT P50 {ttft.get('p50', float('nan')):.0f} ms "
            f"P99 {ttft.get('p99', float('nan')):.0f} ms; repeats P50 {repeats.get('p50', float('nan')):.0f} ms "
            f"P99 {repeats.get('p99', float('nan')):.0f} ms"
        )
    ratios = report["ratios_on_over_off"].items()
    out.print({name: None if value is None else round(value, 3) for name, value in ratios})
    if args.out:
        path = Path(args.out) / "cache.json"
        path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        out.print(f"wrote {path}")
