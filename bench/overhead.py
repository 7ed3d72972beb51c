"""``tailcut bench overhead``: what tailcut's own pipeline costs, measured with the zero-cost ``null`` engine.

Starts a private redis-server, the API and one worker running the ``null`` engine as child processes, then
runs a closed loop of fixed-length requests at each concurrency level. The engine costs nothing, so TTFT is
the latency tailcut adds before the first token (HTTP → Redis → worker → Redis → HTTP), and the rate of
content chunks the clients receive at the highest level is what one API process sustains. ``--step-ms``
gives the engine steps like a real one (one token per running request per step), so chunks reach the API
one per request per step instead of in bursts.

Every level runs twice: with ``bench.client`` (the httpx client of every other benchmark, which parses each
event and tops out near 8,000 chunks/s on one core) and with a raw client that counts chunks on the wire, so
the server side can be saturated. The CPU time of every process (API, worker, Redis, the client itself, and
whatever else runs on the machine) is read from ``/proc`` for each level, so the report says where the time
goes; a canned SSE server measures each client's own ceiling.

The child-process helpers here (``tailcut_stack``, ``start_child``, ``stop_child``) also serve
``bench.vs_vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import redis

from bench import loadgen
from bench.client import TENANT_HEADER, TIER_HEADER, Timeline, completion_body
from bench.stats import RequestRecord, Summary, TargetCheck, summarize
from bench.workloads import Arrival, TierMix, Workload
from queues.keys import Tier
from tailcut.errors import FatalError
from tailcut.up import free_port, private_redis

T = TypeVar("T")

DEFAULT_STREAMS = (1, 50, 200)
DEFAULT_OUTPUT_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 16
# `normal`: a 60 s deadline, far above any queueing a 200-stream level sees (realtime's 5 s is not).
DEFAULT_TIER: Tier = "normal"
TARGET_TTFT_P50_MS = 2.0  # at one stream: tailcut's added latency before the first token
TARGET_CHUNKS_PER_S = 20_000.0  # at the highest level: what one API process sustains
STEADY_TRIM = 0.1  # the steady chunk rate leaves out the first and last 10% of chunks (ramp up and down)
WARMUP_REQUESTS = 20
LEVEL_BUDGET_S = 20.0  # the default request count at one stream keeps a level with engine steps about this long
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
LOG_TAIL_LINES = 30
ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): ")
MACHINE = "machine"  # the key of the whole machine's busy CPU seconds in ``LevelResult.cpu_s``
BUSY_MACHINE_SHARE = 0.3  # CPU outside the benchmark above this share of a core: the level's figures are suspect

Progress = Callable[[str], None]
# `httpx`: bench.client, the client of every other benchmark (parses each event, about 100 µs of CPU per
# chunk). `raw`: counts chunks on the wire (a few µs per chunk), so the server side can be saturated.
ClientKind = Literal["httpx", "raw"]
CLIENTS: tuple[ClientKind, ...] = ("httpx", "raw")


# --- the workload -----------------------------------------------------------------------------------


def fixed_workload(prompt_tokens: int, output_tokens: int, *, tier: Tier = DEFAULT_TIER) -> Workload:
    """One tier, every request ``prompt_tokens`` in and exactly ``output_tokens`` out, no SLO."""
    return Workload(
        name=f"fixed-{prompt_tokens}-{output_tokens}",
        description=f"every request {prompt_tokens} prompt tokens, {output_tokens} output tokens, tier {tier}",
        tiers=[
            TierMix(
                tier=tier,
                share=1.0,
                prompt_tokens=(prompt_tokens, prompt_tokens),
                output_tokens=(output_tokens, output_tokens),
            )
        ],
    )


def fixed_requests(workload: Workload, count: int) -> list[Arrival]:
    return loadgen.closed_loop_requests(workload, count, seed=0)


def default_num_requests(streams: int, *, request_s: float = 0.0) -> int:
    """Enough requests that each stream sends several (ramp up and down stay small) and P99 has samples;
    at one stream, when each request takes ``request_s`` of engine time, no more than about 20 s of them."""
    single = 200 if request_s <= 0 else max(20, min(200, int(LEVEL_BUDGET_S / request_s)))
    return max(single, 5 * streams)


def parse_streams(text: str) -> list[int]:
    """``"1,50,200"`` → ``[1, 50, 200]`` (sorted, distinct, each at least 1)."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise FatalError(f"--streams must be whole numbers separated by commas, got {text!r}") from exc
    if not levels or levels[0] < 1:
        raise FatalError(f"--streams needs at least one level, each at least 1, got {text!r}")
    return levels


# --- reducing records (pure) ------------------------------------------------------------------------


def chunk_times_s(record: RequestRecord) -> list[float]:
    """When each content chunk of ``record`` arrived, in seconds from the run's start."""
    if record.ttft_ms is None:
        return []
    first_s = record.sent_s + record.ttft_ms / 1000
    return [first_s, *(first_s + np.cumsum(record.gaps_ms) / 1000).tolist()]


def num_chunks(records: Sequence[RequestRecord]) -> int:
    """Content chunks received by the clients (completed requests only)."""
    return sum(len(record.gaps_ms) + 1 for record in records if record.status == "ok" and record.ttft_ms is not None)


def steady_chunk_rate(records: Sequence[RequestRecord], *, trim: float = STEADY_TRIM) -> float | None:
    """Chunks per second between the ``trim`` and ``1 - trim`` quantiles of all chunk arrival times: the
    rate with the closed loop's ramp up and ramp down left out. None with too few chunks to tell."""
    times = np.sort(
        np.fromiter(
            (at for record in records if record.status == "ok" for at in chunk_times_s(record)),
            dtype=float,
        )
    )
    low = int(len(times) * trim)
    high = len(times) - 1 - low
    if high - low < 2 or times[high] <= times[low]:
        return None
    return float((high - low) / (times[high] - times[low]))


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One concurrency level. ``cpu_s``: CPU seconds each process spent during the level."""

    streams: int
    num_requests: int
    num_ok: int
    num_errors: int
    num_wrong_length: int  # completed with a token count (usage chunk) other than asked
    duration_s: float
    num_chunks: int
    chunks_per_s: float  # all content chunks / the level's duration
    steady_chunks_per_s: float | None  # see ``steady_chunk_rate``
    ttft_ms: Summary | None
    e2e_ms: Summary | None
    gap_ms: Summary | None
    cpu_s: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    client: ClientKind = "httpx"

    def cpu_share(self, name: str) -> float | None:
        """CPU of one process as a share of one core over the level."""
        return self.cpu_s[name] / self.duration_s if name in self.cpu_s and self.duration_s > 0 else None

    def cpu_us_per_chunk(self, name: str) -> float | None:
        return self.cpu_s[name] / self.num_chunks * 1e6 if name in self.cpu_s and self.num_chunks else None

    @property
    def others_cpu_share(self) -> float | None:
        """CPU that processes outside the benchmark took during the level, as a share of one core: another
        job on the machine makes every figure of the level meaningless."""
        if MACHINE not in self.cpu_s or self.duration_s <= 0:
            return None
        ours = sum(seconds for name, seconds in self.cpu_s.items() if name != MACHINE)
        return max(0.0, self.cpu_s[MACHINE] - ours) / self.duration_s

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_share"] = {name: self.cpu_share(name) for name in self.cpu_s}
        data["cpu_us_per_chunk"] = {name: self.cpu_us_per_chunk(name) for name in self.cpu_s}
        data["others_cpu_share"] = self.others_cpu_share
        data["api_bound_chunks_per_s"] = api_bound_chunks_per_s(self)
        return data


def summarize_level(
    streams: int,
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    expected_tokens: int,
    cpu_s: Mapping[str, float] | None = None,
    client: ClientKind = "httpx",
) -> LevelResult:
    ok = [record for record in records if record.status == "ok"]
    wrong = [record for record in ok if record.output_tokens != expected_tokens]
    chunks = num_chunks(records)
    errors = Counter(record.error or record.status for record in records if record.status != "ok")
    return LevelResult(
        streams=streams,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        num_wrong_length=len(wrong),
        duration_s=duration_s,
        num_chunks=chunks,
        chunks_per_s=chunks / duration_s if duration_s > 0 else 0.0,
        steady_chunks_per_s=steady_chunk_rate(records),
        ttft_ms=summarize([record.ttft_ms for record in ok if record.ttft_ms is not None]),
        e2e_ms=summarize([record.e2e_ms for record in ok if record.e2e_ms is not None]),
        gap_ms=summarize([gap for record in ok for gap in record.gaps_ms]),
        cpu_s=dict(cpu_s or {}),
        errors=dict(errors.most_common(5)),
        client=client,
    )


def check_targets(levels: Sequence[LevelResult], *, step_ms: float = 0.0) -> list[TargetCheck]:
    """The issue's targets, for each client: P50 TTFT at one stream (only with a zero-cost engine: with
    engine steps, the first token waits for a step), the chunk rate at the highest level."""
    checks = []
    for client in CLIENTS:
        measured = [level for level in levels if level.client == client]
        single = next((level for level in measured if level.streams == 1), None)
        if single is not None and step_ms == 0:
            p50 = single.ttft_ms.p50 if single.ttft_ms else None
            checks.append(
                TargetCheck(
                    f"P50 TTFT at 1 stream (ms), {client} client",
                    p50,
                    f"≤ {TARGET_TTFT_P50_MS:g}",
                    p50 is not None and p50 <= TARGET_TTFT_P50_MS,
                )
            )
        if measured:
            top = max(measured, key=lambda level: level.streams)
            rate = top.steady_chunks_per_s or top.chunks_per_s
            checks.append(
                TargetCheck(
                    f"chunks/s at {top.streams} streams (steady), {client} client",
                    rate,
                    f"≥ {TARGET_CHUNKS_PER_S:,.0f}",
                    rate >= TARGET_CHUNKS_PER_S,
                )
            )
    return checks


def api_bound_chunks_per_s(level: LevelResult) -> float | None:
    """The chunk rate the API would reach with a whole core to itself: 1 s ÷ its CPU per chunk."""
    per_chunk_us = level.cpu_us_per_chunk("api")
    return 1e6 / per_chunk_us if per_chunk_us else None


# --- CPU accounting ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc``; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, every process) from ``/proc/stat``."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # up to steal; guest time is counted in user


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process, and of the whole machine under ``MACHINE``."""
    snapshot = {}
    for name, pid in pids.items():
        seconds = cpu_seconds(pid)
        if seconds is not None:
            snapshot[name] = seconds
    busy = machine_busy_seconds()
    if busy is not None:
        snapshot[MACHINE] = busy
    return snapshot


def group_cpu_seconds(pgids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of every process in each named process group (a child started in its own session and
    the helpers it started, such as vLLM's engine process), from one scan of ``/proc``."""
    wanted = {pgid: name for name, pgid in pgids.items()}
    totals = dict.fromkeys(pgids, 0.0)
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        name = wanted.get(int(fields[2]))  # pgrp
        if name is not None:
            totals[name] += (int(fields[11]) + int(fields[12])) / ticks
    return totals


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before if name in after}


# --- child processes ----------------------------------------------------------------------------------


@dataclass
class Child:
    """A child process in its own session (process group), its output in ``log_path``."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def log_errors(self, limit: int = 5) -> list[str]:
        """The first distinct exception lines of the log (``XError: message``): the root cause of a failed
        start is usually far above the tail of a long traceback."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        found: dict[str, None] = {}
        for line in text.splitlines():
            match = ERROR_LINE.search(line)
            if match and "WARNING" not in line:
                found.setdefault(line[match.start() :].strip(), None)
        return list(found)[:limit]

    def failure(self) -> str:
        """What to show when the child died: its errors, then the tail of its log."""
        errors = "".join(f"\n  {line}" for line in self.log_errors())
        found = f"errors in its log:{errors}\n" if errors else ""
        return f"{found}last lines of {self.log_path}:\n{self.log_tail()}"


def start_child(name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path) -> Child:
    log_path = log_dir / f"{name.replace(' ', '-')}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Child(name, process, log_path)


def stop_child(child: Child, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the child (it stops its own helpers, such as vLLM's engine process), wait, then SIGKILL
    whatever is left of its process group."""
    process = child.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # the group outlives its leader: sweep the helpers too
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def http_status(url: str) -> int | None:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def wait_until_ready(
    url: str, children: Sequence[Child], *, timeout_s: float, what: str, progress: Progress | None = None
) -> float:
    """Poll ``url`` until it answers 200; seconds waited. A child that exits, or the time limit, raises
    ``FatalError`` with the tail of the relevant logs."""
    started = time.monotonic()
    next_note = started + 10
    while True:
        for child in children:
            if child.process.poll() is not None:
                raise FatalError(
                    f"{child.name} exited with status {child.process.returncode} while starting {what}; "
                    + child.failure()
                )
        if http_status(url) == 200:
            return time.monotonic() - started
        now = time.monotonic()
        if now - started > timeout_s:
            tails = "\n".join(f"--- {child.name}: {child.failure()}" for child in children)
            raise FatalError(f"{what} was not ready after {timeout_s:.0f} s ({url}):\n{tails}")
        if progress is not None and now >= next_note:
            progress(f"still starting {what}: {now - started:.0f} s")
            next_note = now + 10
        time.sleep(0.25)


@dataclass
class RunningStack:
    """A tailcut stack started by ``tailcut_stack``: its URL, its served model and every process id."""

    url: str
    redis_url: str
    pids: dict[str, int]
    children: list[Child]
    ready_s: float


def redis_pid(redis_url: str) -> int | None:
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        info: dict[str, Any] = client.info("server")  # type: ignore[assignment]  # sync client: a dict
        return int(info["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


@contextlib.contextmanager
def tailcut_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    env: Mapping[str, str],
    worker_env: Mapping[str, str],
    ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Progress | None = None,
) -> Iterator[RunningStack]:
    """A private redis-server, one worker and the API as child processes (like ``tailcut up``, without the
    batch-job process); yields once ``/readyz`` says ready. Everything is stopped on exit, API first."""
    with private_redis() as redis_url:
        base = {**os.environ, **env, "TAILCUT_REDIS_URL": redis_url, "TAILCUT_MODEL": str(model_dir)}
        port = free_port()
        children: list[Child] = []
        try:
            started = time.monotonic()
            worker_argv = [sys.executable, "-m", "tailcut", "worker"]
            children.append(start_child("worker", worker_argv, {**base, **worker_env}, log_dir))
            api_env = {**base, "TAILCUT_PORT": str(port), "TAILCUT_HOST": "127.0.0.1"}
            children.append(start_child("api", [sys.executable, "-m", "tailcut", "api"], api_env, log_dir))
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(f"{url}/readyz", children, timeout_s=ready_timeout_s, what="tailcut", progress=progress)
            pids = {child.name: child.pid for child in children}
            pid = redis_pid(redis_url)
            if pid is not None:
                pids["redis"] = pid
            yield RunningStack(url, redis_url, pids, children, time.monotonic() - started)
        finally:
            for child in reversed(children):
                stop_child(child)


@contextlib.contextmanager
def log_folder(out: str | None, prefix: str) -> Iterator[Path]:
    """Where the child processes' logs go: ``OUT/logs``, else a temporary folder that is removed after a run
    that succeeded and kept after a failure (whose message points into it)."""
    if out:
        folder = Path(out) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# --- a lightweight client, and the clients' own ceilings ----------------------------------------------

# The raw client counts content chunks by this mark instead of parsing each event: the finish chunk says
# "length", the usage chunk has no choice, so only content chunks carry it.
RAW_CONTENT_MARK = b'"finish_reason":null'
# How a streamed reply ends on the wire: the [DONE] event, then the last chunk of chunked encoding.
RAW_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"
RAW_READ_BYTES = 1 << 16
RAW_OK = b"HTTP/1.1 200"


class RawReplyError(Exception):
    """The reply was not a 200 event stream, or the connection ended early (the connection is dropped)."""


async def raw_send(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, timeline: Timeline
) -> int:
    """Send one prepared request on a keep-alive connection and time its reply; returns its content chunks.

    Every chunk of one socket read gets that read's time (as ``bench.client`` stamps every line of a read).
    No event is parsed: chunks are counted by ``RAW_CONTENT_MARK``, the end found by ``RAW_END``, so the
    client spends a few microseconds per chunk where the httpx client spends about a hundred.
    """
    writer.write(request)
    count_tail = end_tail = b""
    num_chunks = 0
    status: bytes | None = b""  # the reply's first bytes until the status is known, then None
    while True:
        data = await reader.read(RAW_READ_BYTES)
        at_s = time.perf_counter()
        if not data:
            raise RawReplyError("the server closed the connection mid-reply")
        if status is not None:
            status += data
            if len(status) >= len(RAW_OK):
                if not status.startswith(RAW_OK):
                    raise RawReplyError(status.split(b"\r\n", 1)[0].decode(errors="replace"))
                status = None
        counted = count_tail + data
        found = counted.count(RAW_CONTENT_MARK)
        for _ in range(found):
            timeline.on_chunk(at_s)
        num_chunks += found
        # Keep fewer bytes than a mark, so no mark is counted twice; enough to find one split across reads.
        count_tail = counted[-(len(RAW_CONTENT_MARK) - 1) :]
        ended = end_tail + data
        if ended.endswith(RAW_END):
            timeline.on_final(at_s)
            return num_chunks
        end_tail = ended[-len(RAW_END) :]


def raw_request(host: str, body: bytes, arrival: Arrival) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"{TIER_HEADER}: {arrival.tier}\r\n{TENANT_HEADER}: {arrival.tenant}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_raw_closed_loop(
    url: str, model: str, requests: Sequence[Arrival], *, concurrency: int, timeout_s: float
) -> loadgen.LoadResult:
    """``bench.loadgen.run_closed_loop`` with the raw client: ``concurrency`` keep-alive connections, each
    sending its next request when the previous reply ended. Same requests, same records."""
    import secrets

    import orjson

    host_port = url.removeprefix("http://").rstrip("/")
    host, port = host_port.rsplit(":", 1)
    salt = secrets.randbits(32)
    pending = iter(requests)
    origin_s = time.perf_counter()
    deadline_s = origin_s + timeout_s

    async def worker() -> list[RequestRecord]:
        records: list[RequestRecord] = []
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            for arrival in pending:
                timeline = Timeline(time.perf_counter())
                if timeline.sent_s >= deadline_s:
                    records.append(timeline.record(arrival, origin_s=origin_s, status="error", error="timeout"))
                    continue
                body = orjson.dumps(completion_body(model, arrival, salt=salt))
                try:
                    async with asyncio.timeout(deadline_s - timeline.sent_s):
                        if connection is None:
                            connection = await asyncio.open_connection(host, int(port))
                        await raw_send(*connection, raw_request(host_port, body, arrival), timeline)
                    records.append(timeline.record(arrival, origin_s=origin_s))
                except (RawReplyError, OSError, TimeoutError) as exc:
                    error = "timeout" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                    records.append(timeline.record(arrival, origin_s=origin_s, status="error", error=error))
                    if connection is not None:
                        connection[1].close()
                    connection = None
        finally:
            if connection is not None:
                connection[1].close()
        return records

    per_worker = await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration_s = time.perf_counter() - origin_s
    records = sorted((record for records in per_worker for record in records), key=lambda record: record.index)
    return loadgen.LoadResult(records, duration_s, salt)


CANNED_SERVER = "import sys; from bench.overhead import serve_canned; serve_canned(int(sys.argv[1]), int(sys.argv[2]))"


def canned_frames(num_chunks: int) -> list[bytes]:
    """The SSE frames of one reply shaped like tailcut's ``/v1/completions`` stream: ``num_chunks`` content
    chunks, the finish chunk, the usage chunk and ``[DONE]``."""
    import orjson

    def chunk(text: str, finish_reason: str | None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "canned"}
        return b"data: " + orjson.dumps({**body, "choices": [choice], "usage": None}) + b"\n\n"

    usage = {"prompt_tokens": 1, "completion_tokens": num_chunks, "total_tokens": num_chunks + 1}
    usage_frame = {"id": "cmpl-canned", "object": "text_completion", "created": 0, "model": "canned"}
    return [
        *(chunk(" x", None) for _ in range(num_chunks)),
        chunk("", "length"),
        b"data: " + orjson.dumps({**usage_frame, "choices": [], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]


def serve_canned(port: int, num_chunks: int) -> None:
    """A stand-in server that answers every POST with a canned SSE reply at once, one frame per write,
    yielding between frames so concurrent replies interleave as tailcut's do. It costs far less CPU per
    chunk than a real server: what the client reaches against it is the client's own ceiling."""
    frames = [f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in canned_frames(num_chunks)]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in request_head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(head)
                for frame in frames:
                    writer.write(frame)
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    run_async(main())


def wait_for_port(port: int, process: subprocess.Popen[bytes], *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise FatalError(f"the canned SSE server exited with status {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise FatalError(f"the canned SSE server did not listen on port {port} in {timeout_s:.0f} s")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where installed (it comes with uvicorn[standard]): the client's ceiling is higher."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


# --- the benchmark ------------------------------------------------------------------------------------


async def measure_level(
    url: str,
    model: str,
    requests: Sequence[Arrival],
    *,
    streams: int,
    pids: Mapping[str, int],
    expected_tokens: int,
    timeout_s: float,
    client: ClientKind = "httpx",
) -> LevelResult:
    """One closed-loop level; CPU is counted for ``pids`` and for this process (``client``)."""
    watched = {**pids, "client": os.getpid()}
    before = cpu_snapshot(watched)
    if client == "httpx":
        result = await loadgen.run_closed_loop(
            url, model, requests, concurrency=streams, timeout_s=timeout_s, show_progress=True
        )
    else:
        result = await run_raw_closed_loop(url, model, requests, concurrency=streams, timeout_s=timeout_s)
    cpu_s = cpu_delta(before, cpu_snapshot(watched))
    return summarize_level(
        streams, result.records, result.duration_s, expected_tokens=expected_tokens, cpu_s=cpu_s, client=client
    )


async def warm_up(url: str, model: str, workload: Workload, *, concurrency: int, count: int) -> None:
    """Requests not recorded: connection pools, first-call paths and the worker's read loop get going."""
    requests = fixed_requests(workload, count)
    await loadgen.run_closed_loop(url, model, requests, concurrency=concurrency, timeout_s=60.0)


def measure_client_ceilings(
    workload: Workload, *, streams: int, num_requests: int, output_tokens: int, timeout_s: float
) -> list[LevelResult]:
    """Each client with the same load against the canned SSE server (a separate process)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tailcut-canned-") as folder:
        argv = [sys.executable, "-c", CANNED_SERVER, str(port), str(output_tokens)]
        child = start_child("canned-sse", argv, os.environ, Path(folder))
        try:
            wait_for_port(port, child.process)
            url = f"http://127.0.0.1:{port}"

            async def measure() -> list[LevelResult]:
                await warm_up(url, "canned", workload, concurrency=min(streams, 8), count=WARMUP_REQUESTS)
                return [
                    await measure_level(
                        url,
                        "canned",
                        fixed_requests(workload, num_requests),
                        streams=streams,
                        pids={"server": child.pid},
                        expected_tokens=output_tokens,
                        timeout_s=timeout_s,
                        client=client,
                    )
                    for client in CLIENTS
                ]

            return run_async(measure())
        finally:
            stop_child(child, timeout_s=5)


@dataclass
class OverheadReport:
    model: str
    model_dir: str
    prompt_tokens: int
    output_tokens: int
    tier: Tier
    step_ms: float
    policy: str
    stack_ready_s: float
    levels: list[LevelResult]
    client_ceilings: list[LevelResult]
    wall_s: float
    targets: list[TargetCheck] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "engine": "null (one token per running request per step)",
            "step_ms": self.step_ms,
            "policy": self.policy,
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": sys.platform},
            "model": self.model,
            "model_dir": self.model_dir,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tier": self.tier,
            "stack_ready_s": self.stack_ready_s,
            "wall_s": self.wall_s,
            "levels": [level.as_dict() for level in self.levels],
            "client_ceilings": [level.as_dict() for level in self.client_ceilings],
            "targets": [asdict(check) for check in self.targets],
        }
        return data


def run(
    *,
    model_dir: Path,
    streams: Sequence[int],
    output_tokens: int,
    prompt_tokens: int,
    requests_per_level: int | None,
    timeout_s: float,
    client_ceiling: bool,
    log_dir: Path,
    progress: Progress,
    step_ms: float = 0.0,
    policy: str = "tailcut",
    on_level: Callable[[LevelResult], None] | None = None,
) -> OverheadReport:
    """Start the stack, measure every level with each client, stop the stack, then (optionally) measure the
    clients' ceilings against the canned server."""
    from tailcut.models import served_name

    started = time.monotonic()
    workload = fixed_workload(prompt_tokens, output_tokens)
    top = max(streams)
    worker_env = {
        "TAILCUT_ENGINE__KIND": "null",
        "TAILCUT_ENGINE__MAX_NUM_SEQS": str(max(top, 1)),
        "TAILCUT_MAX_RUNNING": str(max(top, 1)),
        "TAILCUT_ENGINE__NULL_STEP_MS": f"{step_ms:g}",
        "TAILCUT_SCHEDULER__POLICY": policy,
    }
    # A closed loop bounds the queue by the stream count; shedding (a 429 past the tier's queue bound, which
    # counts requests admitted since its last probe) is not what this measures.
    env = {"TAILCUT_SHED_NORMAL_WAITING": "0"}
    model = served_name(model_dir, None)
    request_s = output_tokens * step_ms / 1000  # the least time one request takes in the engine
    levels: list[LevelResult] = []
    progress(f"starting a private redis-server, the API and one null-engine worker ({model_dir})")
    with tailcut_stack(model_dir, log_dir, env=env, worker_env=worker_env, progress=progress) as stack:
        progress(f"tailcut ready at {stack.url} in {stack.ready_s:.1f} s")

        async def measure_all() -> None:
            await warm_up(stack.url, model, workload, concurrency=min(top, 8), count=WARMUP_REQUESTS)
            for client in CLIENTS:
                for level in streams:
                    count = requests_per_level or default_num_requests(level, request_s=request_s)
                    progress(f"{client} client, {level} concurrent streams, {count} requests of {output_tokens} tokens")
                    result = await measure_level(
                        stack.url,
                        model,
                        fixed_requests(workload, count),
                        streams=level,
                        pids=stack.pids,
                        expected_tokens=output_tokens,
                        timeout_s=timeout_s,
                        client=client,
                    )
                    levels.append(result)
                    if on_level is not None:
                        on_level(result)

        run_async(measure_all())
        ready_s = stack.ready_s
    ceilings = []
    if client_ceiling:
        count = requests_per_level or default_num_requests(top, request_s=request_s)
        progress(f"clients' ceilings: each client at {top} streams against a canned SSE server")
        ceilings = measure_client_ceilings(
            workload, streams=top, num_requests=count, output_tokens=output_tokens, timeout_s=timeout_s
        )
    report = OverheadReport(
        model=model,
        model_dir=str(model_dir),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tier=DEFAULT_TIER,
        step_ms=step_ms,
        policy=policy,
        stack_ready_s=ready_s,
        levels=levels,
        client_ceilings=ceilings,
        wall_s=time.monotonic() - started,
    )
    report.targets = check_targets(levels, step_ms=step_ms)
    return report


# --- the command ----------------------------------------------------------------------------------------

PROCESSES = ("api", "worker", "redis", "client")


def _ms(summary: Summary | None, attribute: str) -> str:
    if summary is None:
        return "-"
    value = float(getattr(summary, attribute))
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _step(step_ms: float) -> str:
    return "zero cost" if step_ms == 0 else f"steps of {step_ms:g} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def latency_table(levels: Sequence[LevelResult], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("client")
    for column in ("streams", "requests", "ok", "TTFT P50", "TTFT P99", "E2E P50", "E2E P99", "gap P50", "gap P99"):
        table.add_column(column, justify="right")
    for level in levels:
        table.add_row(
            level.client,
            str(level.streams),
            str(level.num_requests),
            str(level.num_ok) + (f" ({level.num_wrong_length} wrong length)" if level.num_wrong_length else ""),
            _ms(level.ttft_ms, "p50"),
            _ms(level.ttft_ms, "p99"),
            _ms(level.e2e_ms, "p50"),
            _ms(level.e2e_ms, "p99"),
            _ms(level.gap_ms, "p50"),
            _ms(level.gap_ms, "p99"),
        )
    return table


def throughput_table(levels: Sequence[LevelResult], ceilings: Sequence[LevelResult]) -> Any:
    from rich.table import Table

    table = Table(title="chunks received per second; CPU per process: share of one core | µs per chunk")
    table.add_column("client")
    for column in ("streams", "chunks/s", "steady", *PROCESSES, "others", "API-bound"):
        table.add_column(column, justify="right")
    rows = [(str(level.streams), level) for level in levels]
    rows += [(f"{level.streams} canned", level) for level in ceilings]
    for label, level in rows:
        cells = []
        for name in PROCESSES:
            share, per_chunk = level.cpu_share(name), level.cpu_us_per_chunk(name)
            if name == "api" and share is None:
                share, per_chunk = level.cpu_share("server"), level.cpu_us_per_chunk("server")
            cells.append("-" if share is None or per_chunk is None else f"{share:.0%} | {per_chunk:.0f}")
        others = level.others_cpu_share
        table.add_row(
            level.client,
            label,
            _rate(level.chunks_per_s),
            _rate(level.steady_chunks_per_s),
            *cells,
            "-" if others is None else f"{others:.0%}" if others < BUSY_MACHINE_SHARE else f"[red]{others:.0%}[/red]",
            _rate(api_bound_chunks_per_s(level)),
        )
    return table


def print_report(console: Any, report: OverheadReport) -> None:
    from rich.table import Table

    console.print(
        f"tailcut pipeline overhead, null engine ({_step(report.step_ms)}), model {report.model}: "
        f"{report.prompt_tokens} prompt tokens, {report.output_tokens} output tokens per request, tier {report.tier}, "
        f"policy {report.policy}, "
        "closed loop; "
        f"{os.cpu_count()} cores shared by the API, the worker, Redis and the client; {report.wall_s:.0f} s wall"
    )
    console.print(latency_table(report.levels, "latency (ms): TTFT = tailcut's added latency before the first token"))
    console.print(throughput_table(report.levels, report.client_ceilings))
    console.print(
        "client httpx: bench.client (parses every event); raw: counts chunks on the wire. steady: chunks/s between "
        "the 10th and 90th percentile chunk (ramp left out). others: CPU of processes outside the benchmark. "
        "API-bound: 1 s ÷ the API's CPU per chunk, the rate one API process would reach with a core of its own."
        + (
            " 'canned': the client against a canned SSE server (its own ceiling; the api column is that server)."
            if report.client_ceilings
            else ""
        )
    )
    for level in [*report.levels, *report.client_ceilings]:
        name = f"{level.client} client, {level.streams} streams"
        if (level.others_cpu_share or 0) >= BUSY_MACHINE_SHARE:
            console.print(
                f"[red]{name}: processes outside the benchmark (or the kernel) took {level.others_cpu_share:.0%} "
                "of a core during this level: its figures are not tailcut's alone; rerun on a quiet machine[/red]"
            )
        if level.errors:
            failures = ", ".join(f"{count}× {error}" for error, count in level.errors.items())
            console.print(f"[red]{name}: {failures}[/red]")
    targets = Table(title="targets (issue: pipeline overhead)")
    for column in ("target", "measured", "wanted", ""):
        targets.add_column(column, justify="left" if column == "target" else "right")
    for check in report.targets:
        value = "-" if check.value is None else f"{check.value:,.2f}" if check.value < 100 else f"{check.value:,.0f}"
        targets.add_row(check.name, value, check.target, "met" if check.met else "[red]missed[/red]")
    console.print(targets)


def write_outputs(report: OverheadReport, out: Path, *, command: Sequence[str], arguments: Mapping[str, Any]) -> Path:
    import orjson

    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    data = {"command": list(command), "arguments": dict(arguments), **report.as_dict()}
    path = out / "overhead.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    note = (
        f"LIVE, null engine ({_step(report.step_ms)}), {report.output_tokens}-token replies, closed loop; "
        f"{os.cpu_count()} shared cores"
    )
    rows = []
    for level in report.levels:
        for metric, summary in (("TTFT", level.ttft_ms), ("E2E", level.e2e_ms)):
            if summary is not None:
                rows += [(f"{metric} P50 ({level.client})", float(level.streams), summary.p50)]
                rows += [(f"{metric} P99 ({level.client})", float(level.streams), summary.p99)]
    plots.plot_p99_vs_load(
        rows,
        out / "overhead_latency.png",
        note=note,
        metric="latency",
        load_label="concurrent streams",
        log_y=True,
    )
    return path


def command(args: Any) -> None:
    """``tailcut bench overhead`` (``args`` from ``bench.cli``)."""
    from rich.console import Console

    from tailcut.models import prepare_tiny, resolve_model
    from tailcut.settings import CommonSettings

    streams = parse_streams(args.streams)
    if args.tokens < 2 or args.prompt_tokens < 1:
        raise FatalError("--tokens must be at least 2 (gaps need two chunks) and --prompt-tokens at least 1")
    if args.step_ms < 0:
        raise FatalError("--step-ms must not be negative")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise FatalError("--requests-per-level must be at least 1")
    status_console = Console(stderr=True, highlight=False)
    console = Console(width=None if sys.stdout.isatty() else 160)
    settings = CommonSettings()
    if args.model:
        model_dir = resolve_model(args.model, settings.cache_dir, progress=status_console.log)
    else:
        model_dir = prepare_tiny(settings.cache_dir, progress=status_console.log)
    with log_folder(args.out, "tailcut-overhead-") as log_dir:
        report = run(
            model_dir=model_dir,
            streams=streams,
            output_tokens=args.tokens,
            prompt_tokens=args.prompt_tokens,
            requests_per_level=args.requests_per_level,
            timeout_s=args.timeout_s,
            client_ceiling=args.client_ceiling,
            log_dir=log_dir,
            progress=status_console.log,
            step_ms=args.step_ms,
            policy=args.policy,
        )
    print_report(console, report)
    if args.out:
        arguments = {name: value for name, value in vars(args).items() if name != "func"}
        path = write_outputs(report, Path(args.out), command=sys.argv, arguments=arguments)
        console.print(f"wrote {path} and {path.with_name('overhead_latency.png')}")
