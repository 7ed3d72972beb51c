"""``tailcut bench overhead`` and ``tailcut bench vs-vllm``: the pure parts (fixed workload, record
reduction, targets, the raw client's chunk counting, vLLM's server command), then one real run of the
overhead command as a subprocess (a private redis-server, the API and a null-engine worker).

No test here runs vLLM: the vs-vllm comparison is checked through its argument and command construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from bench import cpu, overhead, rawclient, vllm_server, vs_vllm
from bench.client import TextArrival, Timeline, request_body
from bench.levels import (
    ClientKind,
    LevelResult,
    api_bound_chunks_per_s,
    chunk_times_s,
    fixed_requests,
    fixed_workload,
    num_chunks,
    steady_chunk_rate,
    steady_token_rate,
    summarize_level,
    with_text,
)
from bench.overhead import check_targets, parse_streams
from bench.rawclient import canned_frames, raw_send
from bench.stats import RequestRecord, Status
from bench.workloads import Arrival
from tailcut.errors import FatalError

ROOT = Path(__file__).parents[2]


def record(
    index: int,
    *,
    sent_s: float = 0.0,
    ttft_ms: float | None = 10.0,
    gaps_ms: list[float] | None = None,
    output_tokens: int = 4,
    status: Status = "ok",
    error: str | None = None,
) -> RequestRecord:
    gaps = [1.0, 2.0, 3.0] if gaps_ms is None else gaps_ms
    e2e_ms = None if ttft_ms is None else ttft_ms + sum(gaps)
    return RequestRecord(
        index=index,
        tier="normal",
        bucket="short",
        tenant="default",
        prompt_tokens=16,
        output_tokens=output_tokens,
        sent_s=sent_s,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        tpot_ms=None,
        gaps_ms=gaps,
        status=status,
        error=error,
    )


# --- the workload and the records (pure) ---


def test_fixed_workload_gives_requests_of_exactly_the_asked_lengths() -> None:
    workload = fixed_workload(16, 64)
    requests = fixed_requests(workload, 50)

    assert [mix.tier for mix in workload.tiers] == ["normal"]
    assert len(requests) == 50 and [arrival.index for arrival in requests] == list(range(50))
    assert {(arrival.prompt_tokens, arrival.output_tokens, arrival.tier) for arrival in requests} == {
        (16, 64, "normal")
    }
    assert fixed_requests(workload, 50) == requests  # the same requests for every system and every run


def test_text_prompts_are_the_same_requests_with_distinct_texts_of_the_asked_words() -> None:
    workload = fixed_workload(16, 64)
    ids = fixed_requests(workload, 50)
    text = fixed_requests(workload, 50, prompt="text")
    again = fixed_requests(workload, 50, prompt="text")

    assert all(isinstance(arrival, TextArrival) for arrival in [*text, *again])
    texts = [arrival.text for arrival in text if isinstance(arrival, TextArrival)]
    assert [with_text(arrival, "") for arrival in ids] == [replace(arrival, text="") for arrival in text]
    assert {len(prompt.split()) for prompt in texts} == {16}
    assert len(set(texts)) == 50, "no two prompts alike: no cache serves one"
    drawn_again = {arrival.text for arrival in again if isinstance(arrival, TextArrival)}
    assert not set(texts) & drawn_again, "a new draw at each call (the warm-up's, then each level's)"
    assert request_body("m", text[0])["prompt"] == texts[0]


def test_parse_streams_sorts_and_rejects_nonsense() -> None:
    assert parse_streams("1,50,200") == [1, 50, 200]
    assert parse_streams("200, 1,1,") == [1, 200]
    for bad in ("", "0,5", "1,x", "-3"):
        with pytest.raises(FatalError):
            parse_streams(bad)
    assert overhead.default_num_requests(1) == 200 and overhead.default_num_requests(200) == 1000
    # 64 tokens at 10 ms per step: 0.64 s per request, so about 20 s at one stream.
    assert overhead.default_num_requests(1, request_s=0.64) == 31
    assert overhead.default_num_requests(200, request_s=0.64) == 1000


def test_chunk_times_and_counts_come_from_ttft_and_gaps() -> None:
    first = record(0, sent_s=1.0, ttft_ms=100.0, gaps_ms=[10.0, 0.0, 20.0])
    assert chunk_times_s(first) == pytest.approx([1.1, 1.11, 1.11, 1.13])
    assert chunk_times_s(record(1, ttft_ms=None, gaps_ms=[])) == []
    failed = record(2, status="error", error="timeout")
    # A failed request's chunks are not throughput.
    assert num_chunks([first, failed, record(3, gaps_ms=[])]) == 4 + 1


def test_steady_chunk_rate_leaves_the_ramp_out() -> None:
    # 1,000 chunks 1 ms apart (1,000/s), then a straggler 5 s later: the overall rate would be ~170/s.
    records = [record(index, sent_s=index / 1000, ttft_ms=0.0, gaps_ms=[]) for index in range(1000)]
    records.append(record(1000, sent_s=6.0, ttft_ms=0.0, gaps_ms=[]))
    assert steady_chunk_rate(records) == pytest.approx(1000.0, rel=0.01)
    assert steady_chunk_rate(records[:2]) is None  # too few chunks to tell


def test_summarize_level_counts_outcomes_lengths_rates_and_cpu() -> None:
    records = [
        record(0, gaps_ms=[1.0, 1.0, 1.0]),
        record(1, gaps_ms=[2.0, 2.0, 2.0]),
        record(2, output_tokens=3, gaps_ms=[1.0, 1.0]),  # one token short: a wrong length
        record(3, ttft_ms=None, gaps_ms=[], output_tokens=0, status="error", error="timeout"),
        record(4, ttft_ms=None, gaps_ms=[], output_tokens=0, status="rejected", error="HTTP 429: full"),
    ]
    cpu_s = {"api": 0.5, "worker": 0.25, cpu.MACHINE: 1.5}
    level = summarize_level(8, records, 2.0, expected_tokens=4, cpu_s=cpu_s, client="raw")

    assert (level.streams, level.num_requests, level.num_ok, level.num_errors) == (8, 5, 3, 2)
    assert level.num_wrong_length == 1 and level.client == "raw"
    assert level.num_chunks == 4 + 4 + 3 and level.chunks_per_s == pytest.approx(11 / 2.0)
    assert level.errors == {"timeout": 1, "HTTP 429: full": 1}
    assert level.ttft_ms is not None and level.ttft_ms.count == 3
    assert level.gap_ms is not None and level.gap_ms.count == 8
    assert level.cpu_share("api") == pytest.approx(0.25)
    assert level.cpu_us_per_chunk("worker") == pytest.approx(0.25 / 11 * 1e6)
    assert level.others_cpu_share == pytest.approx((1.5 - 0.75) / 2.0)
    assert api_bound_chunks_per_s(level) == pytest.approx(11 / 0.5)
    data = level.as_dict()
    assert data["cpu_share"]["api"] == pytest.approx(0.25) and data["others_cpu_share"] == pytest.approx(0.375)


def test_targets_compare_the_raw_client_with_the_canned_server() -> None:
    def level(streams: int, client: ClientKind, ttft_ms: float, spacing_s: float, cpu_s: float = 0.0) -> LevelResult:
        # 50 requests of 64 tokens in 8 chunks, each all at once, ``spacing_s`` apart: about 64 / spacing_s
        # tokens/s.
        records = [
            record(index, sent_s=index * spacing_s, ttft_ms=ttft_ms, gaps_ms=[0.0] * 7, output_tokens=64)
            for index in range(50)
        ]
        cpu = {"api": cpu_s, "worker": 2 * cpu_s}
        return summarize_level(streams, records, 1.0, expected_tokens=64, client=client, cpu_s=cpu)

    # 3,200 tokens in all: 0.016 s of API CPU is 5 µs per token, the worker's 10 µs.
    levels = [level(1, "httpx", 3.0, 0.01), level(1, "raw", 1.5, 0.01), level(200, "raw", 20.0, 0.002, 0.016)]
    levels.append(level(1000, "raw", 90.0, 0.001, 0.1))
    canned = [level(1, "raw", 0.4, 0.01), level(200, "raw", 5.0, 0.001), level(1000, "raw", 5.0, 0.001)]
    checks = {check.name: check for check in check_targets(levels, canned)}

    ttft = checks["P50 TTFT at 1 stream above the canned server's (ms)"]
    assert ttft.value == pytest.approx(1.1) and not ttft.met
    # At 200 streams (not the highest level): half the canned server's token rate, just met.
    share = checks["tokens/s at 200 streams (steady) ÷ the canned server's"]
    assert share.value == pytest.approx(0.5, rel=0.05)
    assert checks["api CPU per token at 200 streams (µs)"].value == pytest.approx(5.0)
    assert checks["api CPU per token at 200 streams (µs)"].met
    assert checks["worker CPU per token at 200 streams (µs)"].value == pytest.approx(10.0)
    # Tokens count, not chunks: the same level's chunks are an eighth of its tokens.
    assert levels[2].num_tokens == 8 * levels[2].num_chunks == 3200
    # With engine steps the first token waits for a step: no TTFT target; without canned levels, no share.
    stepped = [check.name for check in check_targets(levels, canned, step_ms=10.0)]
    assert "P50 TTFT at 1 stream above the canned server's (ms)" not in stepped
    alone = [check.name for check in check_targets(levels)]
    assert alone == ["api CPU per token at 200 streams (µs)", "worker CPU per token at 200 streams (µs)"]


def test_steady_token_rate_weighs_each_chunk_by_its_tokens() -> None:
    # 1,000 requests of 4 tokens, 1 ms apart: in two chunks (2 tokens each) or in one.
    two = [record(index, sent_s=index / 1000, ttft_ms=0.0, gaps_ms=[0.0], output_tokens=4) for index in range(1000)]
    one = [record(index, sent_s=index / 1000, ttft_ms=0.0, gaps_ms=[], output_tokens=4) for index in range(1000)]
    assert steady_token_rate(two) == pytest.approx(4000.0, rel=0.01)
    assert steady_token_rate(one) == pytest.approx(4000.0, rel=0.01)
    assert steady_chunk_rate(two) == pytest.approx(2 * steady_chunk_rate(one), rel=0.01)  # type: ignore[operator]


def test_cpu_accounting_reads_proc() -> None:
    own = cpu.cpu_seconds(os.getpid())
    assert own is not None and own > 0
    assert cpu.cpu_seconds(2**22 + 12345) is None  # no such process
    busy = cpu.machine_busy_seconds()
    assert busy is not None and busy >= own
    snapshot = cpu.cpu_snapshot({"me": os.getpid()})
    assert set(snapshot) == {"me", cpu.MACHINE}
    assert cpu.cpu_delta({"a": 1.0, "b": 2.0}, {"a": 1.5}) == {"a": 0.5}


def test_the_interpreter_yardstick_is_time_per_iteration() -> None:
    """Per iteration, not per loop: eight times the iterations give about the same figure."""
    short = cpu.interpreter_ns_per_iteration(50_000)
    long = cpu.interpreter_ns_per_iteration(400_000)
    assert 0 < short < 10_000 and 0 < long < 10_000
    assert 0.4 < long / short < 2.5, (short, long)
    with pytest.raises(ValueError):
        cpu.interpreter_ns_per_iteration(0)


# --- the raw client (pure: a stream reader fed by hand) ---


def chunked_reply(num_chunks: int) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in canned_frames(num_chunks))
    return head + body + b"0\r\n\r\n"


class FakeWriter:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)


@pytest.mark.parametrize("piece_bytes", [1, 7, 19, 20, 21, 64, 1 << 16])
async def test_raw_client_counts_every_content_chunk_however_the_reply_is_split(piece_bytes: int) -> None:
    reply = chunked_reply(5)
    reader = asyncio.StreamReader()
    writer = FakeWriter()
    timeline = Timeline(0.0)

    async def feed() -> None:
        for start in range(0, len(reply), piece_bytes):
            reader.feed_data(reply[start : start + piece_bytes])
            await asyncio.sleep(0)

    feeding = asyncio.create_task(feed())
    count, tokens = await raw_send(reader, writer, b"POST / HTTP/1.1\r\n\r\n", timeline)  # type: ignore[arg-type]
    await feeding

    assert count == 5 and len(timeline.content_s) == 5 and timeline.final_s is not None
    assert tokens == 5  # from the usage chunk
    assert writer.sent == [b"POST / HTTP/1.1\r\n\r\n"]
    reader.feed_eof()
    assert await reader.read() == b""  # the whole reply was read, and nothing past it


def test_raw_client_takes_the_token_count_from_the_usage_chunk_not_the_frames() -> None:
    # Three frames carrying seven tokens (a server that fell behind coalesced them).
    reply = b"".join(canned_frames(3)).replace(b'"completion_tokens":3', b'"completion_tokens":7')
    assert rawclient.usage_tokens(reply[-rawclient.RAW_TAIL_BYTES :]) == 7
    assert rawclient.usage_tokens(b"data: [DONE]\n\n") is None


async def test_raw_client_reports_a_refusal_and_an_early_close() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}")
    with pytest.raises(rawclient.RawReplyError, match="429"):
        await raw_send(reader, FakeWriter(), b"", Timeline(0.0))  # type: ignore[arg-type]
    reader = asyncio.StreamReader()
    reader.feed_data(chunked_reply(3)[:200])
    reader.feed_eof()
    with pytest.raises(rawclient.RawReplyError, match="closed"):
        await raw_send(reader, FakeWriter(), b"", Timeline(0.0))  # type: ignore[arg-type]


def test_raw_request_carries_the_body_and_the_tier() -> None:
    arrival = Arrival(index=0, at_s=0.0, tier="realtime", tenant="acme", prompt_tokens=3, output_tokens=2)
    request = rawclient.raw_request("127.0.0.1:9", b'{"a":1}', arrival)
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body == b'{"a":1}'
    assert b"content-length: 7" in head and b"X-Tailcut-Tier: realtime" in head


# --- vs-vllm: the server command and the comparison (pure) ---


def test_vllm_server_command_mirrors_the_worker_engine_args(tmp_path: Path) -> None:
    args = vllm_server.shared_engine_args(tmp_path, on_cpu=True, max_model_len=2048)
    command = vllm_server.vllm_server_command("/py", args, port=8123, served_name="tiny")

    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == str(tmp_path)
    assert value("--block-size") == "32" and value("--dtype") == "float32"
    assert value("--kv-cache-memory-bytes") == str(512 * 1024 * 1024) and value("--max-model-len") == "2048"
    assert value("--scheduling-policy") == "priority" and value("--max-num-seqs") == str(args["max_num_seqs"])
    assert "--enforce-eager" in command and "--enable-prefix-caching" in command
    assert value("--port") == "8123" and value("--served-model-name") == "tiny"
    assert "--quantization" not in command  # None: vLLM's default
    assert "--disable-uvicorn-access-log" in command


def test_engine_flags_spell_booleans_and_skip_none() -> None:
    flags = vllm_server.engine_flags({"enforce_eager": False, "block_size": 32, "quantization": None, "x_y": "z"})
    assert flags == ["--no-enforce-eager", "--block-size", "32", "--x-y", "z"]


def test_tailcut_side_gets_the_same_engine_settings() -> None:
    env, worker_env = vllm_server.tailcut_env(on_cpu=True, max_model_len=1024)
    assert env["TAILCUT_MAX_MODEL_LEN"] == "1024" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert worker_env == {"TAILCUT_ENGINE__KIND": "vllm", "TAILCUT_ENGINE__DEVICE": "cpu"}


def test_engine_cores_leave_the_rest_to_the_serving_processes_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_server.os, "cpu_count", lambda: 4)
    env, _ = vllm_server.tailcut_env(on_cpu=True, max_model_len=1024, engine_cores=3)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" == vllm_server.engine_env(3)["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    for impossible in (0, 4):
        with pytest.raises(FatalError, match="--engine-cores must be from 1 to 3"):
            vllm_server.engine_env(impossible)


def test_comparison_is_tailcut_minus_vllm_and_a_throughput_ratio() -> None:
    def level(concurrency: int, ttft_ms: float, tokens_per_s: float) -> vs_vllm.Level:
        records = [record(index, ttft_ms=ttft_ms, output_tokens=4) for index in range(10)]
        return vs_vllm.Level(summarize_level(concurrency, records, 1.0, expected_tokens=4), tokens_per_s, records)

    ours = vs_vllm.SystemRun("tailcut", 20.0, [level(1, 52.0, 19.0), level(16, 400.0, 150.0)])
    theirs = vs_vllm.SystemRun("vllm", 40.0, [level(1, 50.5, 20.0), level(16, 390.0, 160.0)])
    comparison = vs_vllm.compare(ours, theirs, concurrency=16)

    assert comparison.ttft_p50_overhead_ms == pytest.approx(1.5)
    assert comparison.throughput_ratio == pytest.approx(150 / 160)
    checks = vs_vllm.check_targets(comparison)
    assert [check.met for check in checks] == [True, True]
    slower = vs_vllm.compare(ours, vs_vllm.SystemRun("vllm", 40.0, [level(16, 390.0, 200.0)]), concurrency=16)
    assert slower.ttft_p50_overhead_ms is None and [check.met for check in vs_vllm.check_targets(slower)] == [
        False,
        False,
    ]


def test_round_spread_is_each_systems_lowest_round_over_its_highest() -> None:
    def run(system: str, round_index: int, tokens_per_s: float) -> vs_vllm.SystemRun:
        records = [record(index, ttft_ms=50.0, output_tokens=4) for index in range(4)]
        level = vs_vllm.Level(summarize_level(16, records, 1.0, expected_tokens=4), tokens_per_s, records)
        return vs_vllm.SystemRun(system, 10.0, [level], round=round_index)

    runs = [run("tailcut", 0, 200.0), run("vllm", 0, 250.0), run("vllm", 1, 200.0), run("tailcut", 1, 180.0)]

    assert vs_vllm.round_spread(runs, "vllm", concurrency=16) == pytest.approx(0.8)
    assert vs_vllm.round_spread(runs, "tailcut", concurrency=16) == pytest.approx(0.9)
    assert vs_vllm.round_spread(runs[:2], "vllm", concurrency=16) is None  # one round: no spread
    assert vs_vllm.round_spread(runs, "vllm", concurrency=64) is None  # no such level


# --- one real run ---


@pytest.mark.timeout(90)
def test_overhead_command_measures_a_real_stack(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tailcut", "bench", "overhead", "--streams", "1,4", "--requests-per-level"]
    command += ["12", "--tokens", "8", "--model", str(tiny_model), "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    report = orjson.loads((out / "overhead.json").read_bytes())
    assert report["output_tokens"] == 8 and report["model"] == "tiny"
    assert report["machine"]["python_loop_ns"] > 0  # the yardstick runs on the machine measured
    levels = report["levels"]
    assert [(level["client"], level["streams"]) for level in levels] == [
        ("httpx", 1),
        ("httpx", 4),
        ("raw", 1),
        ("raw", 4),
    ]
    for level in levels:
        assert level["num_requests"] == level["num_ok"] == 12, level["errors"]
        # Every token arrives; a stream that fell behind gets several in one chunk.
        assert level["num_wrong_length"] == 0 and level["num_tokens"] == 12 * 8
        assert 12 <= level["num_chunks"] <= 12 * 8
        assert level["ttft_ms"]["count"] == 12 and level["ttft_ms"]["p50"] > 0
        assert level["e2e_ms"]["p99"] >= level["ttft_ms"]["p99"]
        assert level["chunks_per_s"] > 0
        assert {"api", "worker", "redis", "client", cpu.MACHINE} <= set(level["cpu_s"])
    assert [(ceiling["client"], ceiling["streams"]) for ceiling in report["client_ceilings"]] == [
        ("raw", 1),
        ("raw", 4),
        ("httpx", 4),
    ]
    assert all(ceiling["num_ok"] == 12 for ceiling in report["client_ceilings"])
    assert {check["name"] for check in report["targets"]} == {
        "P50 TTFT at 1 stream above the canned server's (ms)",
        "tokens/s at 4 streams (steady) ÷ the canned server's",
        "api CPU per token at 4 streams (µs)",
        "worker CPU per token at 4 streams (µs)",
    }
    assert (out / "overhead_latency.png").stat().st_size > 0
    assert {"api.log", "worker.log"} <= {path.name for path in (out / "logs").iterdir()}
    assert "targets" in result.stdout


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                children.add(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(90)
def test_sigterm_stops_a_benchmark_and_the_servers_it_started(tiny_model: Path, tmp_path: Path) -> None:
    """A `timeout` or a CI runner ends a benchmark with SIGTERM: its Redis, API and worker go with it."""
    command = [sys.executable, "-m", "tailcut", "bench", "overhead", "--streams", "1", "--requests-per-level"]
    command += ["100000", "--tokens", "8", "--model", str(tiny_model), "--out", str(tmp_path / "out")]
    children: set[int] = set()
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as bench:
        try:
            deadline = time.monotonic() + 60
            while len(children) < 3 and time.monotonic() < deadline and bench.poll() is None:
                time.sleep(0.2)
                children |= children_of(bench.pid)  # redis-server, then the API and the worker
            assert len(children) >= 3, f"the stack did not start (exit status {bench.poll()})"
            time.sleep(1.0)  # the load is running
            bench.terminate()
            assert bench.wait(timeout=30) == 130
        finally:
            if bench.poll() is None:
                bench.kill()
    for pid in children:
        for _ in range(50):
            if not alive(pid):
                break
            time.sleep(0.1)
        assert not alive(pid), f"child {pid} outlived the benchmark"


def test_rounds_alternate_and_pool_into_one_run_per_system() -> None:
    assert vs_vllm.round_orders(["tailcut", "vllm"], 3) == [
        ["tailcut", "vllm"],
        ["vllm", "tailcut"],
        ["tailcut", "vllm"],
    ]

    def run(round_index: int, ttft_ms: float, duration_s: float) -> vs_vllm.SystemRun:
        records = [record(index, ttft_ms=ttft_ms, output_tokens=4) for index in range(10)]
        result = summarize_level(16, records, duration_s, expected_tokens=4, cpu_s={"api": 1.0})
        level = vs_vllm.Level(result, 40 / duration_s, records)
        return vs_vllm.SystemRun("tailcut", 10.0 + round_index, [level], round=round_index)

    pooled = vs_vllm.pool([run(0, 10.0, 1.0), run(1, 30.0, 3.0)], expected_tokens=4)
    level = pooled.level(16)
    assert pooled.round == -1 and pooled.start_s == pytest.approx(10.5) and level is not None
    assert level.result.num_requests == 20 and level.result.duration_s == pytest.approx(4.0)
    assert level.output_tokens_per_s == pytest.approx(80 / 4.0)  # total tokens over total time
    assert level.result.cpu_s == {"api": 2.0}
    assert level.result.ttft_ms is not None and level.result.ttft_ms.p50 == pytest.approx(20.0)


def test_clients_are_a_subset_in_the_order_measured() -> None:
    assert overhead.parse_clients("raw") == ["raw"]
    assert overhead.parse_clients("raw,httpx") == ["httpx", "raw"]
    for wrong in ("", "raw,curl", "httpx,"):
        with pytest.raises(FatalError, match="--clients"):
            overhead.parse_clients(wrong)
