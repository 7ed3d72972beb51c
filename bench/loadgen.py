"""Open- and closed-loop load against an OpenAI-compatible server, bounded by a wall-clock limit.

Open loop (WORKLOADS.md's default): each request of a Poisson trace is sent at its offset whatever
happened to the requests before it, so the server's queueing shows up in latency. Closed loop (like
``ab -c``): C workers each send their next request when the previous one finished, so the offered load
adapts to the server and hides its queueing; it is for throughput and pipeline-overhead measurements.
At the time limit, requests still running are abandoned and requests not yet sent are recorded without
being sent, both as ``error: timeout``: every request of the trace has a record.

``send_offsets`` draws the send times ``vllm bench serve`` draws (``--request-rate``, ``--burstiness``,
``--seed``), and ``run_open_loop``'s ``max_concurrency`` caps the requests in flight as its
``--max-concurrency`` does: a request due while the cap is reached waits in the client, and its
latencies start when it is actually sent.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.client import DEFAULT_OPTIONS, RequestOptions, Timeline, open_http, send
from bench.stats import RequestRecord
from bench.workloads import Arrival, Workload, draw_requests

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    records: list[RequestRecord]  # one per request, in index order
    duration_s: float  # start → last request finished (or the time limit): the denominator of rates
    prompt_salt: int  # made the prompts of this run distinct from other runs' (bench.client.prompt_token_ids)


def closed_loop_requests(workload: Workload, count: int, *, seed: int) -> list[Arrival]:
    """The requests ``poisson_trace`` would draw with this seed (same tiers and lengths), all at offset 0."""
    return draw_requests(workload, count, np.random.default_rng([seed, 2]))


def send_offsets(num_requests: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``num_requests`` requests, as vLLM 0.32's ``get_request``
    draws them after ``np.random.seed(seed)``: gaps from a gamma distribution of shape ``burstiness`` and
    scale 1 / (rate × burstiness) — mean 1 / rate, coefficient of variation 1 / sqrt(burstiness); 1 is a
    Poisson process, below 1 burstier, ``inf`` evenly spaced — the first gap before the first request,
    the sum rescaled so the last request goes out at exactly N / rate. An infinite rate sends all at 0."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request rate and burstiness must be positive, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * num_requests
    else:
        # vLLM draws one value at a time from numpy's global (legacy) generator; a RandomState seeded
        # the same way yields the same stream.
        state = np.random.RandomState(seed)
        scale = 1.0 / (request_rate * burstiness)
        gaps = [float(state.gamma(shape=burstiness, scale=scale)) for _ in range(num_requests)]
    offsets = np.cumsum(gaps)
    if offsets[-1] == 0:
        return [0.0] * num_requests
    return [float(offset) for offset in offsets * (num_requests / request_rate / offsets[-1])]


def at_offsets(requests: Sequence[Arrival], offsets: Sequence[float]) -> list[Arrival]:
    """``requests`` sent at ``offsets`` (one each, in order)."""
    if len(requests) != len(offsets):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} offsets")
    return [replace(request, at_s=offset) for request, offset in zip(requests, offsets, strict=True)]


async def run_open_loop(
    base_url: str,
    model: str,
    trace: Sequence[Arrival],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prompt_salt: int | None = None,
    show_progress: bool = False,
    max_concurrency: int | None = None,
    options: RequestOptions = DEFAULT_OPTIONS,
) -> LoadResult:
    """Send each request of ``trace`` at its ``at_s`` offset from the start, regardless of completions;
    with ``max_concurrency``, a due request waits until fewer than that many are in flight."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    salt = secrets.randbits(32) if prompt_salt is None else prompt_salt
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
    async with open_http(base_url) as http:
        with _Progress(len(trace), show_progress) as progress:
            origin_s = time.perf_counter()
            deadline_s = origin_s + timeout_s

            async def sent(arrival: Arrival) -> RequestRecord:
                progress.on_sent()
                request = send(
                    http, model, arrival, origin_s=origin_s, deadline_s=deadline_s, salt=salt, options=options
                )
                return await progress.track(request)

            async def in_a_slot(arrival: Arrival, slots: asyncio.Semaphore) -> RequestRecord:
                try:
                    async with asyncio.timeout(deadline_s - time.perf_counter()):
                        await slots.acquire()
                except TimeoutError:
                    return _not_sent(arrival, origin_s, sent_s=time.perf_counter())
                try:
                    return await sent(arrival)
                finally:
                    slots.release()

            tasks: list[asyncio.Task[RequestRecord]] = []
            unsent: list[RequestRecord] = []
            for arrival in trace:
                send_at_s = origin_s + arrival.at_s
                if send_at_s >= deadline_s:
                    unsent.append(_not_sent(arrival, origin_s, sent_s=send_at_s))
                    continue
                await asyncio.sleep(max(0.0, send_at_s - time.perf_counter()))
                tasks.append(asyncio.create_task(sent(arrival) if slots is None else in_a_slot(arrival, slots)))
            records = [*await asyncio.gather(*tasks), *unsent]
            duration_s = time.perf_counter() - origin_s
    return LoadResult(sorted(records, key=lambda record: record.index), duration_s, salt)


async def run_closed_loop(
    base_url: str,
    model: str,
    requests: Sequence[Arrival],
    *,
    concurrency: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prompt_salt: int | None = None,
    show_progress: bool = False,
    options: RequestOptions = DEFAULT_OPTIONS,
) -> LoadResult:
    """``concurrency`` workers share ``requests`` in order; each sends its next when its previous finished."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    salt = secrets.randbits(32) if prompt_salt is None else prompt_salt
    pending: Iterator[Arrival] = iter(requests)  # shared: each worker takes the next request
    async with open_http(base_url) as http:
        with _Progress(len(requests), show_progress) as progress:
            origin_s = time.perf_counter()
            deadline_s = origin_s + timeout_s

            async def worker() -> list[RequestRecord]:
                records = []
                for arrival in pending:
                    now_s = time.perf_counter()
                    if now_s >= deadline_s:
                        records.append(_not_sent(arrival, origin_s, sent_s=now_s))
                        continue
                    progress.on_sent()
                    request = send(
                        http, model, arrival, origin_s=origin_s, deadline_s=deadline_s, salt=salt, options=options
                    )
                    records.append(await progress.track(request))
                return records

            per_worker = await asyncio.gather(*(worker() for _ in range(concurrency)))
            duration_s = time.perf_counter() - origin_s
    records = [record for records in per_worker for record in records]
    return LoadResult(sorted(records, key=lambda record: record.index), duration_s, salt)


def _not_sent(arrival: Arrival, origin_s: float, *, sent_s: float) -> RequestRecord:
    return Timeline(sent_s).record(arrival, origin_s=origin_s, status="error", error="timeout (not sent)")


class _Progress:
    """The live line: sent / completed / in flight / errors (on stderr; nothing when not shown)."""

    def __init__(self, total: int, show: bool) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not show,
        )
        self._task = self._progress.add_task("", total=total)
        self.sent = self.completed = self.rejected = self.errors = 0
        self._refresh()

    def __enter__(self) -> _Progress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._progress.stop()

    def on_sent(self) -> None:
        self.sent += 1
        self._refresh()

    async def track(self, request: Awaitable[RequestRecord]) -> RequestRecord:
        record = await request
        self.completed += 1
        self.rejected += record.status == "rejected"
        self.errors += record.status == "error"
        self._refresh()
        return record

    def _refresh(self) -> None:
        description = (
            f"sent {self.sent}  completed {self.completed}  in flight {self.sent - self.completed}  "
            f"rejected {self.rejected}  errors {self.errors}"
        )
        self._progress.update(self._task, completed=self.completed, description=description)
