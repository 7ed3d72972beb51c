"""Workers on different hosts share the consumer group: each host a Linux network namespace of the
test's own, whose ``tailcut worker`` reaches Redis over its veth link only; one host dies mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from queues.intake import MESSAGE_FIELD
from queues.keys import WORKER_GROUP, Keys
from queues.messages import RequestMessage
from queues.output import read_output
from tailcut.processes import Child, descendants, free_port, process_table, start_child, stop_child
from tests import netns
from tests.conftest import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN
from tests.sse import DONE, finish_reasons, frames, positions_grow, streamed_token_ids
from tests.stack import private_redis_server, running_stack

pytestmark = pytest.mark.engine

NUM_REQUESTS = 10
MAX_TOKENS = 300
EVENT_IDS = {"X-Tailcut-Event-Ids": "true"}  # each frame's position as its SSE id
WORKER_START_S = 150
# A 2 s heartbeat (below), default take-over settings: a dead worker's beat vouches for it 4 s and the
# survivor looks every 0.5 s, so it takes over 2-5 s after the death. Generous for two busy cores.
TAKEOVER_S = 10.0
ROUND_TWO_S = 45  # from the host's death to the last stream's end (5-13 s here)...
# ...or, on a machine slower than that (other work on its two cores), this many times round one: the
# survivor serves alone what is left of a round both hosts served.
ROUND_TWO_PER_ROUND_ONE = 3


@dataclass
class Reply:
    """What one client read of a streamed reply: each payload (parsed, or ``DONE``), the SSE ids (the
    positions), and when each position came (monotonic seconds)."""

    request_id: str = ""
    events: list[Any] = field(default_factory=list)
    event_ids: list[int] = field(default_factory=list)
    arrived_at: dict[int, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(streamed_token_ids(self.events))


def body(index: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": [10 + index + step for step in range(24)],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def stream(client: httpx.AsyncClient, request: dict[str, Any], reply: Reply) -> Reply:
    try:
        async with client.stream("POST", "/v1/completions", json=request, headers=EVENT_IDS) as response:
            assert response.status_code == 200, await response.aread()
            reply.request_id = response.headers["x-tailcut-request-id"]
            async for event_id, payload in frames(response):
                reply.events.append(payload)
                if event_id is not None:
                    reply.event_ids.append(event_id)
                    reply.arrived_at.setdefault(event_id, time.monotonic())
    except httpx.HTTPError as exc:
        # Which stream broke, and how far it had come: the bare exception says neither.
        raise AssertionError(
            f"request {reply.request_id or '(no response yet)'}: {exc!r} after {len(reply.events)} events, "
            f"last position {max(reply.event_ids, default=0)}"
        ) from exc
    return reply


def start_worker(host: netns.Host, redis_port: int, keys: Keys, model: Path, folder: Path, cpu: int) -> Child:
    """A ``tailcut worker`` process inside ``host``, with its own vLLM engine (default heartbeat and
    take-over settings), reaching Redis at the host side of its veth link; it leads its own process
    group and dies with the test. Its JSON log goes to ``folder``."""
    env = {
        **os.environ,
        # Each host's engine computes on a core of its own, as on a machine of its own: two engines
        # spinning on both cores at once starve the workers' event loops past their heartbeat (a live
        # worker's requests were then taken over by the other).
        "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
        "TAILCUT_REDIS_URL": f"redis://{host.host_ip}:{redis_port}/0",
        "TAILCUT_KEY_PREFIX": keys.prefix,
        "TAILCUT_MODEL": str(model),
        "TAILCUT_MAX_MODEL_LEN": str(TEST_MAX_MODEL_LEN),
        "TAILCUT_WORKER_ID": host.name,
        "TAILCUT_ENGINE__KV_CACHE_MEMORY_BYTES": str(TEST_KV_CACHE_BYTES),
        # At most 6 running and 1 read ahead: neither worker can hold all ten requests.
        "TAILCUT_ENGINE__MAX_NUM_SEQS": "6",
        "TAILCUT_SCHEDULER__PREFETCH": "1",
        "TAILCUT_METRICS_PORT": "0",
        # A 2 s beat (alive for 4 s): two engines on two shared cores stall a worker's loop for 2-3 s
        # at times, and at the default 1 s beat the other worker takes a live one's requests over.
        "TAILCUT_HEARTBEAT_S": "2",
        "TAILCUT_LOG_FORMAT": "json",
        # Compared with greedy references: no summary fallback (see tests.stack.running_workers).
        "TAILCUT_DEGRADE__REALTIME_HEARTBEAT_MS": "0",
        "TAILCUT_DEGRADE__NORMAL_HEARTBEAT_MS": "0",
    }
    argv = host.exec_argv(sys.executable, "-m", "tailcut", "worker")
    return start_child(host.name, argv, env, log_path=folder / f"{host.name}.log")


async def wait_for_workers(redis: aioredis.Redis, keys: Keys, workers: dict[str, Child]) -> None:
    deadline = time.monotonic() + WORKER_START_S
    for worker_id, child in workers.items():
        while await redis.zscore(keys.workers, worker_id) is None:
            assert child.process.poll() is None, f"{worker_id} exited during start: {child.failure()}"
            assert time.monotonic() < deadline, f"{worker_id} was not serving after {WORKER_START_S} s"
            await asyncio.sleep(0.2)


def log_events(child: Child, event: str) -> list[dict[str, Any]]:
    """The worker's JSON log lines of ``event`` (vLLM's own lines are text: skipped)."""
    assert child.log_path is not None
    found = []
    for line in child.log_path.read_bytes().splitlines():
        if line.startswith(b"{"):
            with contextlib.suppress(orjson.JSONDecodeError):
                record = orjson.loads(line)
                if record.get("event") == event:
                    found.append(record)
    return found


def handled(child: Child) -> set[str]:
    """The requests the worker took on: every delivery it ran ends in a ``request_<outcome>`` line
    (``request_final``, ``request_fenced``, ...), and one it took over in ``request_reclaimed``."""
    assert child.log_path is not None
    found = set()
    for line in child.log_path.read_bytes().splitlines():
        if line.startswith(b"{"):
            with contextlib.suppress(orjson.JSONDecodeError):
                record = orjson.loads(line)
                if str(record.get("event", "")).startswith("request_") and "rid" in record:
                    found.add(record["rid"])
    return found


async def finals_by_worker(workers: dict[str, Child], request_ids: set[str]) -> dict[str, set[str]]:
    """Which worker logged ``request_final`` for each of ``request_ids`` (the log line follows the
    acknowledgement, so it may come a moment after the client's last event)."""
    deadline = time.monotonic() + 10
    while True:
        found = {
            worker_id: {record["rid"] for record in log_events(child, "request_final")} & request_ids
            for worker_id, child in workers.items()
        }
        if set().union(*found.values()) >= request_ids or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)


async def held_requests(redis: aioredis.Redis, keys: Keys) -> dict[str, set[str]]:
    """The requests each consumer of the worker group holds now (its pending entries), over every
    intake stream."""
    held: dict[str, set[str]] = {}
    for intake_stream in keys.intake_all():
        with contextlib.suppress(ResponseError):  # a stream nobody wrote to yet
            for row in await redis.xpending_range(intake_stream, WORKER_GROUP, min="-", max="+", count=1000):
                entries = await redis.xrange(intake_stream, min=row["message_id"], max=row["message_id"])
                if entries:  # else acknowledged since
                    consumer = row["consumer"].decode() if isinstance(row["consumer"], bytes) else row["consumer"]
                    held.setdefault(consumer, set()).add(RequestMessage.loads(entries[0][1][MESSAGE_FIELD]).id)
    return held


async def tokens_written(redis: aioredis.Redis, keys: Keys, request_ids: set[str]) -> dict[str, int | None]:
    """How many tokens of each request are in its durable output stream; None once its terminal event
    is there. Tokens, not positions: a position carries several tokens when the writer fell behind, so
    a count of positions cannot tell a reply mid-way from one at its end."""
    ids = list(request_ids)
    outputs = await asyncio.gather(*(read_output(redis, keys, request_id, from_seq=1) for request_id in ids))
    return {
        request_id: None if any(event.terminal for event in events) else sum(len(event.token_ids) for event in events)
        for request_id, events in zip(ids, outputs, strict=True)
    }


def assert_one_whole_reply(reply: Reply, reference: Reply) -> None:
    assert streamed_token_ids(reply.events) == streamed_token_ids(reference.events), reply.request_id
    assert finish_reasons(reply.events) == ["length"], reply.request_id
    assert reply.events[-1] == DONE and reply.events.count(DONE) == 1, reply.request_id
    assert not [event for event in reply.events if isinstance(event, dict) and "error" in event], reply.request_id
    assert positions_grow(reply.event_ids), f"{reply.request_id}: {reply.event_ids}"


async def test_workers_on_two_hosts_share_the_group_and_a_dead_hosts_streams_finish_on_the_other(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two hosts (network namespaces), each with a real worker process and its own vLLM engine, reach
    one Redis over their veth links only (never loopback) and share the consumer group: ten concurrent
    greedy streams through the API are served by both. Then the same ten again, and while both hosts
    hold some of them, one host dies mid-stream: its link is deleted, everything in it SIGKILLed, the
    namespace deleted. The other worker, on the default heartbeat and take-over settings, takes every
    request the dead host held over within seconds, and every client stream completes: the same token
    ids as the first round, each position once with no gap, one finish, one [DONE], no error. Nothing
    of the dead host's processes, and no namespace or link of the test, is left."""
    with contextlib.ExitStack() as cleanup:
        try:
            host_a, host_b = cleanup.enter_context(netns.hosts("a", "b"))
        except netns.NamespacesRefused as exc:
            pytest.skip(str(exc))
        made = {host_a.name, host_b.name}, {host_a.link, host_b.link}
        port = free_port()
        # Reachable from the hosts: bound to the loopback and the root side of their links only (protected
        # mode, on by default without a password, would refuse every client but the loopback's).
        bind = ["--bind", "127.0.0.1", host_a.host_ip, host_b.host_ip, "--protected-mode", "no"]
        server = cleanup.enter_context(private_redis_server(port, *bind))
        # A patient API: on two shared cores busy with two engines its event loop lags past 0.5 s.
        async with running_stack(server.url, tiny_model, None, redis_timeout_s=5.0) as stack:
            workers: dict[str, Child] = {}
            try:
                cpus = sorted(os.sched_getaffinity(0))
                for index, host in enumerate((host_a, host_b)):  # both engines start at once
                    cpu = cpus[index % len(cpus)]
                    workers[host.name] = start_worker(host, port, stack.keys, tiny_model, tmp_path, cpu)
                await wait_for_workers(stack.redis, stack.keys, workers)
                # Each worker's connections come from inside its host, over the veth link.
                peers = {client["addr"].rsplit(":", 1)[0] for client in await stack.redis.client_list()}
                async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
                    # Round one, both hosts alive: the references, and the spread.
                    started = time.monotonic()
                    async with asyncio.timeout(90):
                        references = await asyncio.gather(
                            *(stream(client, body(index), Reply()) for index in range(NUM_REQUESTS))
                        )
                    round_one_s = time.monotonic() - started
                    round_two_limit_s = max(ROUND_TWO_S, TAKEOVER_S + ROUND_TWO_PER_ROUND_ONE * round_one_s)
                    first_ids = {reply.request_id for reply in references}
                    served = await finals_by_worker(workers, first_ids)
                    took = {worker_id: handled(child) & first_ids for worker_id, child in workers.items()}

                    # Round two: the same requests; a host dies while it is well into writing one or more
                    # of them (the one writing more) and the other host holds some too.
                    replies = [Reply() for _ in range(NUM_REQUESTS)]
                    tasks = [
                        asyncio.create_task(stream(client, body(index), reply)) for index, reply in enumerate(replies)
                    ]
                    try:
                        waited_until = time.monotonic() + 60
                        while True:
                            held = await held_requests(stack.redis, stack.keys)
                            # Progress as written to Redis (the client may read well behind it), in tokens.
                            written = await tokens_written(stack.redis, stack.keys, set().union(*held.values()))
                            mid_stream = {
                                worker_id: {
                                    request_id
                                    for request_id in held.get(worker_id, set())
                                    if 10 <= (written[request_id] or 0) <= MAX_TOKENS * 2 // 3
                                }
                                for worker_id in workers
                            }
                            doomed, survivor = sorted(workers, key=lambda worker_id: -len(mid_stream[worker_id]))
                            if mid_stream[doomed]:
                                break
                            if all(task.done() for task in tasks) or time.monotonic() > waited_until:
                                pytest.fail(
                                    "no moment came where a host streamed a request mid-way: "
                                    f"held { ({w: len(ids) for w, ids in held.items()}) }, tokens "
                                    f"{[reply.num_tokens for reply in replies]}, take-overs logged "
                                    f"{[len(log_events(child, 'request_reclaimed')) for child in workers.values()]}"
                                )
                            await asyncio.sleep(0.05)
                        tokens_before = [reply.num_tokens for reply in replies]
                        dead_host = host_a if doomed == host_a.name else host_b
                        engine_pids = set(descendants(workers[doomed].pid))
                        # The host dies: network first (it can no longer write), then every process in it.
                        killed_at, killed_at_epoch_s = time.monotonic(), time.time()
                        dead_host.cut_network()
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(workers[doomed].pid, signal.SIGKILL)
                        dead_host.delete()
                        try:
                            async with asyncio.timeout(round_two_limit_s):
                                await asyncio.gather(*tasks)
                        except TimeoutError:
                            taken = log_events(workers[survivor], "request_reclaimed")
                            pytest.fail(
                                f"the streams had not completed {round_two_limit_s:.0f} s after {doomed} died: tokens "
                                f"{[reply.num_tokens for reply in replies]}, take-overs logged: {len(taken)}"
                            )
                        round_two_s = time.monotonic() - killed_at
                    finally:
                        for task in tasks:
                            task.cancel()
                        await asyncio.gather(*tasks, return_exceptions=True)
                second_ids = {reply.request_id for reply in replies}
                # Take-overs of the death (on a loaded machine a stalled but live worker may also have been
                # taken over earlier, in round one: the fence kept those streams whole, see below): those
                # of the dead worker's heartbeat, and the idle scan's of a request it held (on a loaded
                # machine its entry can pass the idle limit before its heartbeat is judged expired).
                takeovers = [
                    record
                    for record in log_events(workers[survivor], "request_reclaimed")
                    if record["ts"] >= killed_at_epoch_s
                    and (record.get("dead_worker") == doomed or record["rid"] in held.get(doomed, set()))
                ]
                reclaimed = {record["rid"]: record["positions_written"] for record in takeovers}
                # Those it had to finish: a request whose final event the dead host had written already
                # is only acknowledged by the survivor (it logs no request_final for it).
                unfinished = {
                    reply.request_id
                    for reply in replies
                    if reply.request_id in reclaimed and max(reply.event_ids, default=0) > reclaimed[reply.request_id]
                }
                finished_after = await finals_by_worker({survivor: workers[survivor]}, unfinished)
                left = [pid for pid in engine_pids | {workers[doomed].pid} if pid in process_table()]
            finally:
                for child in workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGKILL)  # the worker and its engine processes
                    stop_child(child, timeout_s=1)

    # Kill → take-over (the survivor's log line; the log's clock is the wall clock).
    taken_over_after_s = [record["ts"] - killed_at_epoch_s for record in takeovers]
    # Kill → the first position the survivor wrote (those before it were written by the dead host); a
    # request taken over may also wait there for a free engine slot.
    resumed_after_s = {
        reply.request_id: min(
            moment for position, moment in reply.arrived_at.items() if position > reclaimed[reply.request_id]
        )
        - killed_at
        for reply in replies
        if reply.request_id in reclaimed
    }
    counts = {worker: (len(took[worker]), len(ids)) for worker, ids in served.items()}
    latencies = {rid[:8]: round(seconds, 2) for rid, seconds in resumed_after_s.items()}
    takeover_s = f"{min(taken_over_after_s, default=0):.2f}-{max(taken_over_after_s, default=0):.2f}"
    held_counts = {worker_id: len(ids) for worker_id, ids in held.items()}
    print(
        f"\nround one {round_one_s:.1f} s, (taken, finished) by {counts}; {doomed} died holding {held_counts} "
        f"(mid-stream {len(mid_stream[doomed])}), tokens streamed "
        f"{tokens_before}; taken over (positions written) {reclaimed} {takeover_s} s after the kill; kill → "
        f"next token {latencies} s; "
        f"round two ended {round_two_s:.1f} s after the kill"
    )
    assert {host_a.ns_ip, host_b.ns_ip} <= peers, f"the workers did not reach Redis over their links: {peers}"
    # Both hosts took requests of round one from the group and served them, and each stream completed
    # (below). Who finished which (request_final) is only printed: on an overloaded machine a live
    # worker's beat can come late, the other takes its requests over and the fence sends the first away
    # (seen here: a worker's loop stalled 2.7 s), and a request whose final was written already is then
    # only acknowledged, with no request_final at all.
    assert took[doomed] and took[survivor], f"the requests did not spread over both hosts: {took}"
    assert took[doomed] | took[survivor] == first_ids, took
    for reference in references:
        assert reference.num_tokens == MAX_TOKENS and finish_reasons(reference.events) == ["length"]
    # Both held requests in flight when the host died; the survivor took the dead host's over.
    assert set(reclaimed) <= second_ids and len(reclaimed) >= 1, f"nothing was taken over: {reclaimed}"
    assert mid_stream[doomed] <= set(reclaimed), f"not taken over: {mid_stream[doomed] - set(reclaimed)}"
    assert all(reclaimed[request_id] > 0 for request_id in mid_stream[doomed])
    assert finished_after[survivor] == unfinished
    # All of them were taken over within seconds, and streamed on.
    assert max(taken_over_after_s) < TAKEOVER_S, f"take-over took {taken_over_after_s} s"
    assert all(seconds < round_two_limit_s for seconds in resumed_after_s.values())
    # Every client stream completed once, whole, as in round one.
    for reply, reference in zip(replies, references, strict=True):
        assert_one_whole_reply(reply, reference)
        assert_one_whole_reply(reference, reference)
    assert engine_pids, "the dead host's worker had no engine processes to check"
    assert not left, f"processes of the dead host outlived it: {left}"
    # Nothing of the hosts is left behind.
    names, links = made
    assert not names & netns.namespaces(), f"namespaces left: {names & netns.namespaces()}"
    assert not links & netns.links(), f"links left: {links & netns.links()}"
