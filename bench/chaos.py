"""``tailcut chaos``: a mixed load against a stack it starts itself, for a bounded time, while killing
workers with SIGKILL, pausing engines (SIGSTOP/SIGCONT), restarting Redis, dropping clients mid-stream
and resuming them after their last event id, repeating Idempotency-Keys and sending poison inputs.

Every accepted request must end: completed, degraded (and marked so), or failed with an explicit
error — never lost. Every completed greedy stream is compared with an uninterrupted reference run of
the same request, taken before the faults begin.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from api.streaming import EVENT_IDS_HEADER
from bench.chaos_client import Spec, StreamTrace, read_events, run_request, send_poison
from bench.chaos_stack import ChaosStack

# Positions as SSE ids on a stream that is not resumable (the load's requests are: they carry an
# Idempotency-Key).
EVENT_IDS = {EVENT_IDS_HEADER: "true"}

FAULTS = ("kill_worker", "pause_engine", "restart_redis", "stop_worker")
ENGINE_PAUSE_S = 1.5
# The longest a request may take, resumes included, before it counts as lost.
REQUEST_LIMIT_S = 180.0
JOB_WAIT_S = 180.0
TIERS = ("realtime", "normal", "background")

Progress = Callable[[str], None]
# A small log-analysis job that runs through the faults too.
JOB = {
    "lines": [f"12:00:{n:02d} ERROR disk {n} full" for n in range(30)],
    "instruction": "Find the errors.",
    "chunk_lines": 5,
    "max_tokens": 16,
    "ignore_eos": True,
}


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    duration_s: float = 120.0
    num_workers: int = 2
    concurrency: int = 6
    seed: int = 0
    fault_every_s: float = 15.0
    drop_share: float = 0.25
    repeat_share: float = 0.1
    num_specs: int = 8


@dataclass
class Fault:
    kind: str
    at_s: float  # from the start of the load
    at: float  # time.monotonic()
    detail: str = ""
    # A killed or stopped worker: the longest wait from the signal to the next token of a stream in flight
    # then, over all of them and per tier (background yields to the others, so on the surviving workers
    # its streams may wait longest by design).
    next_token_by_tier: dict[str, float] = field(default_factory=dict)

    @property
    def next_token_s(self) -> float | None:
        """The longest of the tiers' waits (None: no stream was in flight)."""
        return max(self.next_token_by_tier.values(), default=None)


@dataclass
class ChaosResult:
    config: ChaosConfig
    ready_s: float
    traces: list[StreamTrace]
    references: dict[int, list[int]]
    faults: list[Fault]
    poison: list[tuple[str, int, bool]]
    job: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0


def make_specs(rng: random.Random, count: int) -> list[Spec]:
    specs = []
    for index in range(count):
        tier = TIERS[index % len(TIERS)]
        prompt = [rng.randrange(10, 1900) for _ in range(rng.randint(8, 60))]
        max_tokens = {"realtime": rng.randint(16, 64), "normal": rng.randint(64, 200), "background": 300}[tier]
        specs.append(Spec(index, tier, prompt, max_tokens))
    return specs


async def reference(client: httpx.AsyncClient, spec: Spec) -> list[int]:
    """The uninterrupted greedy reply of ``spec`` (re-run if a stall happened to degrade it). The trace
    counts positions by SSE id, which a plain stream does not carry: the request asks for them."""
    seen: list[str] = []
    for _ in range(3):
        trace = StreamTrace(spec)
        async with client.stream("POST", "/v1/completions", json=spec.body(), headers=EVENT_IDS) as response:
            response.raise_for_status()
            await read_events(response, trace)
        if trace.terminal == "final" and trace.degraded is None:
            return trace.token_ids()
        seen.append(f"{trace.terminal or 'no terminal event'}, {trace.last_id} positions, degraded: {trace.degraded}")
    raise RuntimeError(f"no undisturbed reference run for request {spec.index}: {'; '.join(seen)}")


async def load_loop(
    client: httpx.AsyncClient,
    specs: list[Spec],
    rng: random.Random,
    config: ChaosConfig,
    until: float,
    traces: list[StreamTrace],
    lane: int,
) -> None:
    sent = 0
    while time.monotonic() < until:
        spec = rng.choice(specs)
        drop = rng.random() < config.drop_share
        repeat = not drop and rng.random() < config.repeat_share
        key = f"chaos-{config.seed}-{lane}-{sent}"
        traces.append(
            await run_request(client, spec, rng, tenant=f"tenant-{lane % 3}", key=key, drop=drop, repeat=repeat)
        )
        sent += 1


async def fault_loop(stack: ChaosStack, config: ChaosConfig, started: float, until: float, faults: list[Fault]) -> None:
    turn = 0
    while True:
        await asyncio.sleep(config.fault_every_s)
        if time.monotonic() >= until:
            return
        kind = FAULTS[turn % len(FAULTS)]
        turn += 1
        if kind == "kill_worker":
            # Only with a survivor serving: killing the last worker measures an engine's start, not a take-over.
            await asyncio.to_thread(stack.wait_workers, len(stack.workers))
            victim = await asyncio.to_thread(stack.busiest_worker)
            fault = Fault(kind, time.monotonic() - started, time.monotonic())
            await asyncio.to_thread(stack.kill_worker, victim)
            fault.detail = f"{victim} SIGKILLed; {stack.start_worker()} started in its place"
        elif kind == "stop_worker":
            # A graceful stop (a rolling restart): SIGTERM, the drain, the hand-back, a replacement.
            await asyncio.to_thread(stack.wait_workers, len(stack.workers))
            victim = await asyncio.to_thread(stack.busiest_worker)
            fault = Fault(kind, time.monotonic() - started, time.monotonic())
            took = await asyncio.to_thread(stack.stop_worker, victim)
            fault.detail = f"{victim} SIGTERMed, gone after {took:.1f} s; {stack.start_worker()} started in its place"
        elif kind == "pause_engine":
            await asyncio.to_thread(stack.wait_workers, len(stack.workers))
            victim = await asyncio.to_thread(stack.busiest_worker)
            fault = Fault(kind, time.monotonic() - started, time.monotonic())
            paused = await asyncio.to_thread(stack.pause_engine, victim, ENGINE_PAUSE_S)
            fault.detail = f"{victim}'s engine paused {ENGINE_PAUSE_S} s" if paused else f"{victim} had no engine yet"
        else:
            fault = Fault(kind, time.monotonic() - started, time.monotonic())
            away = await asyncio.to_thread(stack.restart_redis)
            fault.detail = f"Redis SIGKILLed and restarted ({away:.1f} s away)"
        faults.append(fault)


async def wait_for_job(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_WAIT_S
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            response = await client.get(f"/v1/jobs/{job_id}")
            if response.status_code == 200:
                view = response.json()
                if view["status"] in ("complete", "failed", "aborted"):
                    return view
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1.0)
    return {**view, "status": view.get("status", "unknown") + " (still not finished)"}


def next_token_after(fault: Fault, traces: list[StreamTrace]) -> dict[str, float]:
    """Per tier, the longest wait from ``fault`` to the next token among the streams in flight at that
    moment (tiers with no stream in flight are absent)."""
    waits: dict[str, float] = {}
    for trace in traces:
        times = sorted(trace.times.values())
        before = [t for t in times if t <= fault.at]
        after = [t for t in times if t > fault.at]
        if before and after:
            tier = trace.spec.tier
            waits[tier] = max(waits.get(tier, 0.0), after[0] - fault.at)
    return waits


async def run(config: ChaosConfig, model_dir: Path, log_dir: Path, progress: Progress) -> ChaosResult:
    env = {
        "TAILCUT_MAX_MODEL_LEN": "2048",
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(64 * 1024 * 1024),
        "TAILCUT_ENGINE__MAX_NUM_SEQS": "16",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    stack = ChaosStack(model_dir, log_dir, config.num_workers, env)
    try:
        progress(
            f"starting Redis (AOF, appendfsync always), the API, {config.num_workers} workers and the jobs process"
        )
        ready_s = await asyncio.to_thread(stack.start)
        rng = random.Random(config.seed)
        specs = make_specs(rng, config.num_specs)
        timeout = httpx.Timeout(60.0, connect=5.0)
        async with httpx.AsyncClient(base_url=stack.url, timeout=timeout) as client:
            progress(f"ready in {ready_s:.0f} s; reference runs of {len(specs)} requests")
            references = {spec.index: await reference(client, spec) for spec in specs}
            job = await client.post("/v1/jobs", json=JOB)
            job_id = job.json()["id"]
            progress(f"load and faults for {config.duration_s:.0f} s")
            traces: list[StreamTrace] = []
            faults: list[Fault] = []
            started = time.monotonic()
            until = started + config.duration_s
            lanes = [
                load_loop(client, specs, random.Random(config.seed * 1000 + lane), config, until, traces, lane)
                for lane in range(config.concurrency)
            ]
            poison_task = asyncio.create_task(_poison_later(client, config.duration_s / 2))
            await asyncio.gather(fault_loop(stack, config, started, until, faults), *lanes)
            load_s = time.monotonic() - started
            poison = await poison_task
            progress("waiting for the batch job")
            job_view = await wait_for_job(client, job_id)
        for fault in faults:
            if fault.kind in ("kill_worker", "stop_worker"):
                fault.next_token_by_tier = next_token_after(fault, traces)
        return ChaosResult(config, ready_s, traces, references, faults, poison, job_view, load_s)
    finally:
        await asyncio.to_thread(stack.stop)


async def _poison_later(client: httpx.AsyncClient, delay_s: float) -> list[tuple[str, int, bool]]:
    await asyncio.sleep(delay_s)
    return await send_poison(client)
