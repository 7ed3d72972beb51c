"""A load run's records as ``vllm bench serve``'s result JSON: its field names, its definitions (pure).

The figures follow vLLM 0.32's ``calculate_metrics`` and ``benchmark`` (``vllm/benchmarks/serve.py``), so a
``tailcut bench load`` result and a ``vllm bench serve --save-result`` file can be compared field by field:

- ``completed``: requests that succeeded; ``failed``: the others (a 429 and a request never sent at the
  time limit count as failed). Token totals and every latency are over completed requests only.
- ``total_input_tokens``: the server's ``usage.prompt_tokens`` when it reports them (else the client's
  count); ``total_output_tokens``: ``usage.completion_tokens`` (else the content chunks).
- throughputs (``request_throughput``, ``output_throughput``, ``total_token_throughput``) divide by
  ``duration``, the start of the run → the last request done.
- TTFT and E2EL per request; TPOT = (E2EL − TTFT) / (output tokens − 1) over requests of 2 or more tokens;
  ITL: every gap between consecutive content chunks, pooled.
- ``mean_*``, ``median_*``, ``std_*`` (numpy's population std) and ``p{P}_*`` (numpy's linear
  percentile) per metric, in ms; a metric with no values reports 0, as vLLM does.
- ``request_goodput``: completed requests per second that met every ``--goodput`` objective
  (``ttft``/``tpot``/``e2el`` in ms, a value equal to its objective meets it, a 1-token reply's TPOT
  counts as 0); None without ``--goodput``.
- ``max_output_tokens_per_s`` / ``max_concurrent_requests``: the busiest whole second of content chunks
  and the requests active in it, counted as vLLM counts them (a chunk counts as one token).

Two timings differ from vLLM's client by definition, and the docs say so: tailcut's TTFT is the first
chunk that carries text (vLLM's client takes the first chunk with ``choices``, which on a chat stream is
the role-only opening chunk; tailcut's API, like vLLM's server, sends that one with the first token) and
its E2EL ends at ``[DONE]`` (vLLM's at the last chunk with ``choices``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from bench.stats import RequestRecord
from tailcut.errors import FatalError

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "e2el:2000"]`` → ``{"ttft": 500.0, "e2el": 2000.0}`` (ms), checked as vLLM checks it."""
    objectives: dict[str, float] = {}
    for pair in pairs:
        name, separator, value = pair.partition(":")
        try:
            if not separator:
                raise ValueError(pair)
            objectives[name] = float(value)
        except ValueError as exc:
            raise FatalError(
                f"--goodput takes KEY:VALUE pairs (a metric and milliseconds, e.g. ttft:500 e2el:2000), got {pair!r}"
            ) from exc
        if name not in GOODPUT_METRICS:
            raise FatalError(f"--goodput: unknown metric {name!r}; use {', '.join(GOODPUT_METRICS)}")
        if objectives[name] < 0:
            raise FatalError(f"--goodput: {name} must be 0 or more milliseconds, got {value}")
    return objectives


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``--metric-percentiles``: ``"50,90,99"`` → (50.0, 90.0, 99.0), each in [0, 100]."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError as exc:
        raise FatalError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from exc
    if not values or not all(0 <= value <= 100 for value in values):
        raise FatalError(f"--metric-percentiles must lie in [0, 100], got {text!r}")
    return values


def parse_metrics(text: str) -> tuple[str, ...]:
    """``--percentile-metrics``: a comma-separated subset of ttft, tpot, itl, e2el."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in PERCENTILE_METRICS]
    if unknown or not names:
        raise FatalError(f"--percentile-metrics takes some of {', '.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def percentile_key(metric: str, percentile: float) -> str:
    """vLLM's name of one percentile: ``p99_ttft_ms``, ``p99.9_itl_ms``."""
    word = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    return f"p{word}_{metric}_ms"


def metric_fields(metric: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_``, ``median_``, ``std_`` and the ``p{P}_`` fields of one metric, as vLLM computes them."""
    array = np.asarray(values_ms if len(values_ms) else [0.0], dtype=float)
    fields = {
        f"mean_{metric}_ms": float(np.mean(array)),
        f"median_{metric}_ms": float(np.median(array)),
        f"std_{metric}_ms": float(np.std(array)),
    }
    for percentile in percentiles:
        fields[percentile_key(metric, percentile)] = float(np.percentile(array, percentile))
    return fields


def good_requests(records: Iterable[RequestRecord], objectives: Mapping[str, float]) -> int:
    """Completed requests that met every objective (ms; vLLM: ``objective >= value``)."""
    good = 0
    for record in _completed(records):
        if record.ttft_ms is None or record.e2e_ms is None:
            continue
        values = {"ttft": record.ttft_ms, "tpot": record.tpot_ms or 0.0, "e2el": record.e2e_ms}
        good += all(values[name] <= limit for name, limit in objectives.items())
    return good


def peak_output(records: Iterable[RequestRecord]) -> tuple[float, int]:
    """(the most content chunks received in one second, the requests active in that busiest second's
    count), vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: seconds counted from the
    first completed request's send."""
    completed = [record for record in _completed(records) if record.ttft_ms is not None and record.e2e_ms is not None]
    if not completed:
        return 0.0, 0
    start_s = min(record.sent_s for record in completed)
    end_s = max(record.sent_s + (record.e2e_ms or 0.0) / 1000 for record in completed)
    num_seconds = math.ceil(end_s - start_s) + 1
    tokens = np.zeros(num_seconds)
    active = np.zeros(num_seconds)
    for record in completed:
        at_s = record.sent_s + (record.ttft_ms or 0.0) / 1000
        times = [at_s]
        for gap_ms in record.gaps_ms:
            at_s += gap_ms / 1000
            times.append(at_s)
        for time_s in times:
            second = int(time_s - start_s)
            if 0 <= second < num_seconds:
                tokens[second] += 1
        first = int(record.sent_s - start_s)
        last = int(record.sent_s + (record.e2e_ms or 0.0) / 1000 - start_s)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def result_fields(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    goodput: Mapping[str, float] | None = None,
    metrics: Sequence[str] = PERCENTILE_METRICS,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The measured fields of vLLM's result JSON, in its order (module docstring for the definitions)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    completed = list(_completed(records))
    total_input = sum(record.prompt_tokens for record in completed)
    total_output = sum(record.output_tokens for record in completed)
    peak_tokens_per_s, peak_concurrency = peak_output(completed)
    fields: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "request_goodput": good_requests(completed, goodput) / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_tokens_per_s,
        "max_concurrent_requests": peak_concurrency,
    }
    values: dict[str, list[float]] = {
        "ttft": [record.ttft_ms for record in completed if record.ttft_ms is not None],
        "tpot": [record.tpot_ms for record in completed if record.tpot_ms is not None],
        "itl": [gap for record in completed for gap in record.gaps_ms],
        "e2el": [record.e2e_ms for record in completed if record.e2e_ms is not None],
    }
    for metric in metrics:
        fields.update(metric_fields(metric, values[metric], percentiles))
    return fields


def _completed(records: Iterable[RequestRecord]) -> Iterable[RequestRecord]:
    return (record for record in records if record.status == "ok")
