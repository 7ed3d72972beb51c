"""``tailcut bench live``'s records and what they say: the trace stretched into real time and the records
brought back into simulated time, tokens within the arrival window, latencies with unfinished requests
counted, live-minus-virtual deltas of the same requests, the client's own stalls, and what the worker's
JSON log says about the engine keeping its schedule (pure, but for the stall probe)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import orjson

from bench.loadgen import LoadResult
from bench.stats import RequestRecord, Summary, summarize
from bench.workloads import Arrival
from queues.keys import Tier

Metric = Literal["ttft_ms", "e2e_ms"]
# The load generator's event loop is probed this often; a probe this late (real ms) is a stall.
STALL_PROBE_S = 0.01
STALL_MS = 20.0


def stretch(trace: Sequence[Arrival], time_scale: float) -> list[Arrival]:
    """The same requests in the same order, every offset multiplied by ``time_scale`` (real seconds)."""
    return [replace(arrival, at_s=arrival.at_s * time_scale) for arrival in trace]


def jittered(trace: Sequence[Arrival], bound_ms: float, seed: int) -> list[Arrival]:
    """The same requests, each arriving a seeded uniform 0 to ``bound_ms`` later, in their new order."""
    rng = random.Random(seed)
    moved = [replace(arrival, at_s=arrival.at_s + rng.uniform(0.0, bound_ms) / 1000) for arrival in trace]
    return sorted(moved, key=lambda arrival: arrival.at_s)


def to_simulated(record: RequestRecord, time_scale: float) -> RequestRecord:
    """A record measured in real time with every time divided by ``time_scale``: simulated time."""

    def scaled(value: float | None) -> float | None:
        return None if value is None else value / time_scale

    return replace(
        record,
        sent_s=record.sent_s / time_scale,
        ttft_ms=scaled(record.ttft_ms),
        e2e_ms=scaled(record.e2e_ms),
        tpot_ms=scaled(record.tpot_ms),
        gaps_ms=[gap / time_scale for gap in record.gaps_ms],
    )


def tokens_before(record: RequestRecord, window_s: float) -> float:
    """Output tokens of ``record`` received before ``window_s`` from the run's start. Chunk times are
    rebuilt from the send time, the TTFT and the gaps; a chunk carrying several tokens (deltas merge
    when a consumer lags) counts its share of the request's total."""
    if record.ttft_ms is None or not record.output_tokens:
        return 0.0
    at_s = record.sent_s + record.ttft_ms / 1000
    num_inside = int(at_s < window_s)
    for gap_ms in record.gaps_ms:
        at_s += gap_ms / 1000
        num_inside += at_s < window_s
    return record.output_tokens * num_inside / (len(record.gaps_ms) + 1)


def latencies_ms(records: Iterable[RequestRecord], metric: Metric, end_s: float) -> list[float]:
    """``metric`` of every request that was not shed; one that never got there counts at its time so far
    (run end − send), a lower bound, as ``bench.policies.run_job`` counts it."""
    values = []
    for record in records:
        value = getattr(record, metric)
        if value is not None:
            values.append(value)
        elif record.status != "rejected":
            values.append((end_s - record.sent_s) * 1000)
    return values


def paired_delta_ms(
    live: Sequence[RequestRecord], virtual: Sequence[RequestRecord], metric: Metric, tier: Tier
) -> Summary | None:
    """Live minus virtual ``metric`` of the same requests (one trace: same index, same request)."""
    by_index = {record.index: record for record in virtual}
    deltas = []
    for record in live:
        twin = by_index.get(record.index)
        mine, theirs = getattr(record, metric), getattr(twin, metric, None)
        if record.tier == tier and mine is not None and theirs is not None:
            deltas.append(mine - theirs)
    return summarize(deltas)


def stalled_first_tokens(records: Iterable[RequestRecord], stalls: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the requests (real-time records) whose first token the client awaited while its event
    loop stalled: a stall at ``at_s``, ``late_ms`` late, blocked it from ``at_s`` for the probe interval
    plus ``late_ms``."""
    blocked = [(at_s, at_s + STALL_PROBE_S + late_ms / 1000) for at_s, late_ms in stalls]
    return {
        record.index
        for record in records
        if record.ttft_ms is not None
        and any(start < record.sent_s + record.ttft_ms / 1000 and record.sent_s < end for start, end in blocked)
    }


def read_worker_log(path: Path) -> dict[str, Any]:
    """What the worker's JSON log says about the engine keeping its schedule, its request outcomes, and
    the mean real time a realtime request spent from the API's enqueue to its final token at the worker."""
    behind_shares: list[float] = []
    realtime_ms: list[float] = []
    stopped: dict[str, Any] = {}
    outcomes: Counter[str] = Counter()
    num_problems = 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            body = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(body, dict):
            continue
        event = str(body.get("event", ""))
        num_problems += body.get("level") in ("warning", "error", "critical")
        if event == "sim_behind":
            behind_shares.append(float(body.get("behind_share", 0.0)))
        elif event == "sim_stopped":
            stopped = body
        elif event.startswith("request_"):
            outcomes[event.removeprefix("request_")] += 1
            if event == "request_final" and body.get("tier") == "realtime":
                realtime_ms.append(float(body.get("wait_ms", 0)) + float(body.get("run_ms", 0)))
    return {
        "sim_behind_warnings": len(behind_shares),
        "max_behind_share": max(behind_shares, default=0.0),
        "behind_ms": stopped.get("behind_ms"),
        "engine_steps": stopped.get("steps"),
        "engine_virtual_s": stopped.get("virtual_s"),
        "outcomes": dict(outcomes),
        "warnings": num_problems,
        "realtime_enqueue_to_final_mean_ms": sum(realtime_ms) / len(realtime_ms) if realtime_ms else None,
    }


async def watching_stalls(load: Awaitable[LoadResult]) -> tuple[LoadResult, list[tuple[float, float]]]:
    """Run the load generator while watching its event loop: every probe woken more than
    ``STALL_MS`` late is a client stall (seconds from the start, real ms late). A stalled client reads
    chunks late, which inflates the latencies it measures."""
    stalls: list[tuple[float, float]] = []

    async def watch() -> None:
        origin = time.perf_counter()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(STALL_PROBE_S)
            late_ms = (time.perf_counter() - before - STALL_PROBE_S) * 1000
            if late_ms > STALL_MS:
                stalls.append((before - origin, late_ms))

    watcher = asyncio.create_task(watch())
    try:
        return await load, stalls
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
