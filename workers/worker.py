"""The worker: reads the intake streams into a local queue, lets the scheduler pick what enters the
engine, runs each admitted request slice by slice, and streams the output.

Loops, each its own task: the reader (XREADGROUP, most urgent streams first, home buckets before
stealing), the scheduling loop (one ``Scheduler.schedule`` round per change, carrying out
admissions and preemptions and applying the token budget to the engine), the heartbeat (liveness,
and refreshing the claim on every entry held), the cancel listener, the backlog probe (what still
waits in Redis), and the reclaimer (entries of dead workers). An entry is acknowledged only when its
terminal event is in Redis, or atomically with the continuation that replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from queues import drain, events, intake
from queues.intake import IntakeEntry
from queues.keys import BUCKETS, TIERS, WORKER_ALIVE_BEATS, WORKER_GROUP, Bucket, Keys, Tier
from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from queues.output import OutputWriter, read_output
from tailcut.errors import EngineDeadError, InvalidRequestError
from tailcut.logs import log_event
from warmup.prefixes import PrefixWarmer
from workers.breakers import Breakers
from workers.capacity import BudgetFollower, ChunkFollower, StepTimer, engine_view
from workers.engines.base import Engine, EngineDelta
from workers.lifecycle import EngineCall, Finished, RequestLifecycle, Yield, error_event, resumed
from workers.policies import make_scheduler
from workers.prompter import Prompter
from workers.reservation import ReservationRecord
from workers.retention import TOUCH_PRIORITY, PrefixKeeper, Touch
from workers.scheduling import EngineView, SchedRequest
from workers.settings import WorkerSettings
from workers.ticks import Ticks

log = logging.getLogger("tailcut.worker")

SERVED_IDS_KEPT = 10_000
# The scheduling loop runs at least this often (deadlines, backlog changes) besides on every event: at the
# first engine output this long after its last round, or at twice this long when no output comes
# (``workers.ticks``: while the engine streams, the periodic work adds no wake-up of its own).
SCHEDULE_TICK_S = 0.05
# While some tier's local queue is full, a blocking read on the others lasts at most this long, so the
# room an admission frees is used within it rather than after a whole read_block_ms.
BLOCK_WHILE_FULL_MS = 20
BACKLOG_PROBE_S = 0.1
# While nothing of its own runs, waits or is kept for a later turn here, the worker's periodic work (the
# scheduling round, the degrade watchdog, the backlog probe) comes this seldom instead, and again at its
# busy pace once an entry arrives: an idle worker sends Redis one backlog probe a second, not ten, and
# wakes about 20 times a second, not 60 (BENCHMARKS.md, "An idle stack").
IDLE_TICK_S = 1.0
# How often a worker reads the shared circuit breakers.
BREAKER_REFRESH_S = 1.0
HELPERS_STOP_S = 5.0
# After a blocking read that left every stream it read empty while nothing else ran here (light load), the
# next read waits until the output writer has written once more (the first output of what was just read,
# where the engine is quick), at most this long: preparing and sending that read then stays off the first
# token's path on a worker whose own CPU is the bottleneck, and an entry that arrives meanwhile waits no
# longer than this (BENCHMARKS.md, issue 13). Under load the reads are not held back: pacing them by the
# writes made streams coalesce fewer tokens per chunk, and the API pay for more chunks.
READ_AFTER_WRITE_MAX_S = 0.002
# How long a cancel for a request not (yet) held here is remembered: longer than any read's round trip.
CANCELS_HEARD_S = 30.0
# An entry appended at most this long after the cancel listener (re)subscribed, or this close to
# CANCELS_HEARD_S old, is fenced with a round trip that reads its cancel tombstone (``intake.read``): the
# margin covers the order of the two connections' commands in Redis and the estimate of Redis's clock.
HEARD_CANCELS_MARGIN_MS = 1000
# On stop, how long requests handed back at the end of the drain may take to write their continuation.
HAND_BACK_S = 5.0
# On stop, how long the output writer may try to write what it holds (Redis may be down).
WRITER_CLOSE_S = 5.0
# On stop, once one of the waits above has run out (Redis does not answer), each later one waits this long.
REDIS_UNANSWERED_WAIT_S = 1.0


class Emit(Protocol):
    """Writes one event of the request being served (``ack``: with its intake entry's acknowledgement)."""

    def __call__(self, event: OutputEvent, *, ack: bool = False) -> None: ...


def now_ms() -> int:
    return int(time.time() * 1000)


class CallOutput:
    """An engine call's ``OutputSink``: ``take`` runs in the engine's output loop for each delta, for
    every running request of a step in turn, so no task wakes per request and step; the call's own
    task waits on ``finished`` (the finish reason, or what ``take`` or the engine raised). Nothing is
    taken once that task has been told to stop (cancelled: a preemption, a client's cancel, the
    watchdog, a stop), as the task itself would take nothing more."""

    __slots__ = ("_ended", "_take", "_task", "finished")

    def __init__(self, take: Callable[[EngineDelta], str | None]) -> None:
        self._take = take
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._ended = False  # the engine sent the call's last delta or its error
        self.finished: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def on_delta(self, delta: EngineDelta) -> None:
        if delta.finish_reason is not None:
            self._ended = True
        if self.finished.done() or self._task.cancelling():
            return
        try:
            ended_here = self._take(delta)  # a finish reason of the worker's own (a stop string)
        except asyncio.CancelledError:
            self.finished.cancel()
        except Exception as exc:
            self.finished.set_exception(exc)
        else:
            if ended_here is not None or delta.finish_reason is not None:
                self.finished.set_result(ended_here or delta.finish_reason)

    def on_error(self, error: BaseException) -> None:
        self._ended = True
        if not self.finished.done():
            self.finished.set_exception(error)

    def close(self) -> bool:
        """Take nothing more; ``True`` if the engine still runs the call (the caller aborts it)."""
        if not self.finished.done():
            self.finished.cancel()
        return not self._ended


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        redis: aioredis.Redis,
        blocking_redis: aioredis.Redis,
        *,
        prompter: Prompter | None = None,
        prefixes: Sequence[list[int]] = (),
    ) -> None:
        """``prompter``: the served model's tokenizer for summaries; None: nothing degrades.
        ``prefixes``: prompts to warm into the engine's prefix cache at start (``warmup.prefixes``)."""
        self._settings = settings
        self._engine = engine
        self._prompter = prompter
        self._redis = redis
        self._blocking = blocking_redis
        self._keys = Keys(settings.key_prefix)
        # The output writer sends one script call at a time: a connection of its own (taken from the pool
        # once) spares every write the pool's checkout, its lock and its liveness probe of the socket.
        self._writer_redis = aioredis.Redis(connection_pool=redis.connection_pool, single_connection_client=True)
        self._writer = OutputWriter(
            self._writer_redis, self._keys, ttl_s=settings.output_ttl_s, on_fenced=self._fenced_out
        )
        scheduler_config = settings.scheduler_config()
        self.scheduler = make_scheduler(scheduler_config)
        # Finished chat turns kept in the engine's prefix cache (``workers.retention``): tailcut only.
        keep_alive = scheduler_config.keep_alive
        self.keeper = (
            PrefixKeeper(keep_alive, block_tokens=scheduler_config.kv_block_tokens)
            if scheduler_config.policy == "tailcut" and keep_alive.enabled
            else None
        )
        self._touches: set[asyncio.Task[None]] = set()
        self._entries: dict[str, IntakeEntry] = {}  # every entry held: waiting here or running
        self._tasks: dict[str, asyncio.Task[None]] = {}  # running requests
        self._lives: dict[str, RequestLifecycle] = {}  # their lifecycles
        self._beats: dict[str, float] = {}  # time.monotonic() of each one's last event
        self._degrading: dict[str, int] = {}  # the watchdog stopped these: gap in ms
        self._first_chunk_ms: dict[str, int] = {}  # epoch ms of the first chunk, when this delivery sent it
        self.breakers = Breakers(redis, self._keys, settings.breaker_config(), events=self._event)
        self._cancel_requested: set[str] = set()
        # Cancels heard for requests this worker held no entry of, by time.monotonic(): one read from
        # Redis but not yet accepted here when its cancel came (``_accept`` looks here).
        self._cancels_heard: dict[str, float] = {}
        # From this time on Redis's clock (ms) every cancel published was heard here and is remembered
        # (None: not listening); Redis's clock minus the monotonic one, read when the listener subscribed.
        self._cancels_heard_from_ms: int | None = None
        self._redis_clock_offset_ms = 0.0
        self._preempting: set[str] = set()
        # (request id, fencing token) of deliveries a newer delivery has taken from this worker.
        self._fenced: set[tuple[str, int]] = set()
        # Other workers' deaths are judged only from this time on (after start, and after a Redis
        # outage during which every heartbeat, ours included, went stale).
        self._judge_deaths_after = 0.0
        self._wake = asyncio.Event()
        # The helper loops' periods, kept in the wake-ups the engine's output brings (``_run_call``).
        self._ticks = Ticks()
        self._room = asyncio.Event()
        self._work = asyncio.Event()  # an entry arrived or the worker stops: the idle pauses end
        self._stopping = asyncio.Event()
        # When the drain of running requests ends: ``drain_timeout_s`` after ``stop()``, however long the
        # reader's last blocking read takes to return before the drain begins.
        self._drain_ends_at = math.inf
        self._gone = asyncio.Event()  # set once the drain is over: the heartbeat stops
        self._redis_unanswered_at_stop = False  # a wait of the stop for Redis ran out: shorten the rest
        self._fatal: BaseException | None = None
        self._backlog: dict[tuple[Tier, Bucket], int] = {}
        self._stream_of: dict[str, tuple[Tier, Bucket]] = {
            self._keys.intake(tier, bucket): (tier, bucket) for tier in TIERS for bucket in BUCKETS
        }
        self._step = StepTimer()
        self._budget = BudgetFollower(None)
        # The engine's prefill chunk follows the scheduler's while the engine lets it (the scheduler
        # adapts its sizes only once it does: ``TailcutPolicy.prefill_chunk_applied``).
        self._chunk = ChunkFollower(None)
        self._chunk_control = True
        # The staged cold start (``warmup.ramp``), counted from when the worker starts serving.
        self._ramp = settings.warmup.ramp()
        self._serving_since: float | None = None
        self.prefix_warmer = (
            PrefixWarmer(
                engine,
                prefixes,
                busy=self._busy,
                concurrency=settings.warmup.prefix_concurrency,
                cache_salt=settings.cache_salt(settings.warmup.prefix_tenant),
            )
            if prefixes
            else None
        )
        # Ids of the requests this worker brought to a terminal state, newest last (bounded).
        self.served_ids: deque[str] = deque(maxlen=SERVED_IDS_KEPT)
        self.stolen_ids: deque[str] = deque(maxlen=SERVED_IDS_KEPT)
        # (request id, time.monotonic()) of every entry read, in order.
        self.accepted: deque[tuple[str, float]] = deque(maxlen=SERVED_IDS_KEPT)
        self.num_preempted = 0
        self.num_degraded = 0
        self.num_yielded = 0
        self.num_engine_calls = 0
        self.num_touches = 0  # keep-alive touches the engine ran
        self.outcomes: Counter[str] = Counter()  # deliveries ended, by outcome
        # How the scheduler's KV reservations fared, engine call by engine call (``workers.reservation``).
        self.reservations = ReservationRecord()

    @property
    def worker_id(self) -> str:
        return self._settings.worker_id

    @property
    def running_ids(self) -> list[str]:
        return list(self._tasks)

    @property
    def token_budget(self) -> int | None:
        """The engine's per-step token budget in force (None: not steered, or not known yet)."""
        return self._budget.applied

    @property
    def prefill_chunk(self) -> int | None:
        """The engine's prefill chunk set by this worker (None: not set, or the engine cannot)."""
        return self._chunk.applied if self._chunk_control else None

    @property
    def step_ms(self) -> float:
        return self._step.value_ms

    @property
    def kv_capacity_tokens(self) -> int:
        return self._engine.kv_capacity_tokens

    def _ramp_elapsed_s(self) -> float:
        return 0.0 if self._serving_since is None else time.monotonic() - self._serving_since

    @property
    def warmup_stage(self) -> int:
        return self._ramp.stage(self._ramp_elapsed_s())

    @property
    def capacity_fraction(self) -> float:
        """Share of its capacity the worker has open (the cold-start ramp)."""
        return self._ramp.fraction(self._ramp_elapsed_s())

    @property
    def running_capacity(self) -> int:
        """Requests the engine may run at once now: ``num_running_max`` scaled by the ramp."""
        return self._ramp.capacity(self._ramp_elapsed_s(), self._settings.num_running_max)

    def _idle(self) -> bool:
        """Not ``_busy``, and no turn is being touched or kept for later here."""
        keeper = self.keeper
        return not self._busy() and not self._touches and (keeper is None or keeper.num_kept == 0)

    def _busy(self) -> bool:
        """Requests of its own run or wait here (prefix warmup then waits)."""
        return bool(self._tasks) or self.scheduler.num_waiting > 0 or self._stopping.is_set()

    def requests_by_tier(self) -> dict[Tier, tuple[int, int]]:
        """(running, waiting here) per tier."""
        counts = {tier: [0, 0] for tier in TIERS}
        for request_id in self._tasks:
            entry = self._entries.get(request_id)
            if entry is not None:
                counts[entry.message.tier][0] += 1
        for request in self.scheduler.waiting():
            counts[request.tier][1] += 1
        return {tier: (running, waiting) for tier, (running, waiting) in counts.items()}

    def describe(self) -> dict[str | bytes, str | int | float]:
        """What the status page shows of this worker: its engine and pool, and its load now."""
        engine = self._settings.engine
        by_tier = self.requests_by_tier()
        return {
            "engine": engine.kind,
            "model": self._settings.model,
            "dtype": engine.dtype,
            "quantization": engine.quantization or "",
            "home_buckets": ",".join(self._settings.home_buckets),
            "state": "draining" if self._stopping.is_set() else "serving",
            "warmup_stage": self.warmup_stage,
            "capacity": round(self.capacity_fraction, 2),
            # Prefix warmup: prompts warmed of those planned ("0/0": none).
            "prefix_warmup": f"{self.prefix_warmer.done}/{self.prefix_warmer.total}" if self.prefix_warmer else "0/0",
            "running": sum(running for running, _ in by_tier.values()),
            "waiting": sum(waiting for _, waiting in by_tier.values()),
            "token_budget": self.token_budget or 0,
            "prefill_chunk": self.prefill_chunk or 0,
            "step_ms": round(self.step_ms, 2),
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "beat_ms": int(time.time() * 1000),
        }

    def stop(self) -> None:
        """Stop reading and admitting: waiting requests go back to their intake streams at once, running
        ones get ``drain_timeout_s`` to finish and are then handed back as continuations (resumed from
        the output already written, by whichever worker reads them). The heartbeat goes on until then,
        so nobody takes over what is still running here."""
        if not self._stopping.is_set():
            self._drain_ends_at = time.monotonic() + self._settings.drain_timeout_s
        self._stopping.set()
        self._wake.set()
        self._room.set()
        self._work.set()
        self._ticks.release()

    async def run(self) -> None:
        """Serve until ``stop()``; raises the fatal error that stopped it, if any."""
        await intake.ensure_groups(self._redis, self._keys)
        if self.scheduler.steers_token_budget:
            # Check once at start that the engine's step budget can follow the scheduler's; if not,
            # VllmEngine logs it once and the budget limits admission only.
            applied = await self._engine.set_token_budget(self._settings.scheduler.max_budget_tokens)
            self._budget = BudgetFollower(applied)
            log_event(log, "engine_budget_control", enabled=applied is not None)
        self._writer.start()
        await self._take_over_own()
        self._serving_since = time.monotonic()
        helpers = [
            asyncio.create_task(self._heartbeat(), name="worker-heartbeat"),
            asyncio.create_task(self._listen_for_cancels(), name="worker-cancels"),
            asyncio.create_task(self._probe_backlog(), name="worker-backlog"),
            asyncio.create_task(self._reclaim_loop(), name="worker-reclaim"),
            asyncio.create_task(self._read_loop(), name="worker-reader"),
        ]
        if self.scheduler.degrades:
            helpers.append(asyncio.create_task(self._breaker_loop(), name="worker-breakers"))
        if self.scheduler.degrades and self._prompter is not None:
            helpers.append(asyncio.create_task(self._watch_heartbeats(), name="worker-degrade-watchdog"))
        if self.prefix_warmer is not None:
            # Alongside serving from the first second: warmup never holds readiness back.
            helpers.append(asyncio.create_task(self._warm_prefixes(self.prefix_warmer), name="worker-prefix-warmup"))
        log_event(
            log,
            "worker_started",
            worker=self.worker_id,
            policy=self._settings.scheduler.policy,
            max_running=self._settings.num_running_max,
            home=",".join(self._settings.home_buckets),
        )
        try:
            await self._schedule_loop()
        finally:
            # What the reader or the reclaimer takes on while they stop is handed back with the rest.
            intake_tasks = [task for task in helpers if task.get_name() in ("worker-reader", "worker-reclaim")]
            await asyncio.wait(intake_tasks, timeout=self._settings.read_block_ms / 1000 + HELPERS_STOP_S)
            await self._hand_back_waiting()
            await self._drain()
            for touch in list(self._touches):  # one-token requests: aborted, nothing is lost
                touch.cancel()
            if self._touches:
                await asyncio.wait(self._touches, timeout=HELPERS_STOP_S)
            self._gone.set()
            for task in reversed(helpers):
                task.cancel()
            # Each loop also ends by itself on _stopping (_gone): a library that swallows a
            # CancelledError (seen with redis-py mid-command) must not hang the shutdown.
            _done, stuck = await asyncio.wait(helpers, timeout=HELPERS_STOP_S)
            for task in stuck:
                log_event(log, "helper_did_not_stop", logging.WARNING, task=task.get_name())
            try:
                async with asyncio.timeout(self._stop_wait_s(WRITER_CLOSE_S)):
                    await self._writer.close()
            except TimeoutError:
                # Redis does not answer. Nothing unwritten was acknowledged: whoever takes the entries
                # over resumes them from what is in Redis.
                self._redis_unanswered_at_stop = True
                log_event(log, "output_not_written_at_stop", logging.WARNING, worker=self.worker_id)
            with contextlib.suppress(RedisError, TimeoutError):
                async with asyncio.timeout(self._stop_wait_s(WRITER_CLOSE_S)):
                    await self._writer_redis.aclose()
            await self.breakers.close()
            with contextlib.suppress(RedisError):
                # Gone, not merely late: whatever it left pending is taken over at once.
                await self._redis.zadd(self._keys.workers, {self.worker_id: 0})
                await self._redis.delete(self._keys.worker_info(self.worker_id))
            log_event(log, "worker_stopped", worker=self.worker_id, served=len(self.served_ids))
        if self._fatal is not None:
            raise self._fatal

    # --- reading ------------------------------------------------------------------------------

    def _room_per_stream(self) -> dict[str, int]:
        """How many more entries each stream may contribute to the local queue.

        Per tier: ``prefetch`` minus what waits here at that tier or a more urgent one, so a queue
        full of background work never keeps a realtime request in Redis.
        """
        # A ramping worker reads ahead no more than its open share (a new worker in a busy pool would
        # otherwise take a whole batch of the backlog and serve it slowly).
        prefetch = self._ramp.capacity(self._ramp_elapsed_s(), self._settings.scheduler.prefetch)
        room_of = {tier: self.scheduler.prefetch_room(tier, prefetch) for tier in TIERS}
        return {stream: room_of[tier] for stream, (tier, _bucket) in self._stream_of.items()}

    async def _read_loop(self) -> None:
        home_buckets = set(self._settings.home_buckets)
        # The last blocking read left the streams it read empty: the next read blocks at once rather
        # than first asking them again without blocking (two round trips per request at low load,
        # the first of them before the request could start).
        drained = False
        while not self._stopping.is_set():
            rooms = self._room_per_stream()
            if self._wake.is_set() and not all(rooms.values()):
                # A tier looks full while a scheduling round is due (entries just taken): the round runs
                # first and the rooms are counted again, or the reader would block on the other tiers'
                # streams for BLOCK_WHILE_FULL_MS after every prefetch's worth of one tier, with the
                # engine free (22,000 tokens/s against 96,000 at 200 streams on the null engine).
                await asyncio.sleep(0)
                rooms = self._room_per_stream()
            open_streams = [stream for stream, room in rooms.items() if room > 0]
            if not open_streams:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._room.wait()
                continue
            home = [stream for stream in open_streams if self._stream_of[stream][1] in home_buckets]
            foreign = [stream for stream in open_streams if stream not in home]
            full = len(open_streams) < len(rooms)
            try:
                taken = [] if drained else await self._take(home, rooms)
                drained = False
                if not taken and foreign and self._has_spare_capacity():
                    # Work stealing: home streams are empty and there is room in the engine.
                    taken = await self._take(foreign, rooms)
                    self.stolen_ids.extend(entry.message.id for entry in taken)
                if not taken:
                    taken, drained = await self._take_blocking(home or open_streams, rooms, short=full)
            except RedisError as exc:
                log_event(log, "intake_read_failed", logging.WARNING, error=str(exc))
                await asyncio.sleep(0.5)
                continue
            except Exception:
                log.exception("intake_read_failed")
                await asyncio.sleep(0.5)
                continue
            for entry in taken:
                self._accept(entry)
            if taken and drained and not self._tasks:
                await self._writer.next_write(timeout_s=READ_AFTER_WRITE_MAX_S)

    def _has_spare_capacity(self) -> bool:
        return self.scheduler.num_waiting == 0 and len(self._tasks) < self.running_capacity

    async def _take(self, streams: list[str], rooms: dict[str, int]) -> list[IntakeEntry]:
        """What ``streams`` hold, each stream at most its room: one XREADGROUP for the streams that have
        the same room (a tier's streams do), so an idle worker's read is one round trip, not one per stream."""
        by_room: dict[int, list[str]] = {}
        for stream in streams:
            by_room.setdefault(rooms[stream], []).append(stream)
        taken: list[IntakeEntry] = []
        for room, together in by_room.items():
            taken += await self._read(self._redis, together, count=room, block_ms=None)
        return taken

    async def _take_blocking(
        self, streams: list[str], rooms: dict[str, int], *, short: bool = False
    ) -> tuple[list[IntakeEntry], bool]:
        """Wait for entries on ``streams``, each at most the smallest room among them; also says
        whether every stream gave fewer than that (it was empty when read)."""
        block_ms = min(BLOCK_WHILE_FULL_MS, self._settings.read_block_ms) if short else self._settings.read_block_ms
        count = min(rooms[stream] for stream in streams)
        taken = await self._read(self._blocking, streams, count=count, block_ms=block_ms)
        per_stream = Counter(entry.stream for entry in taken)
        return taken, all(n < count for n in per_stream.values())

    async def _read(
        self, client: aioredis.Redis, streams: list[str], *, count: int, block_ms: int | None
    ) -> list[IntakeEntry]:
        return await intake.read(
            client,
            self._keys,
            self.worker_id,
            streams,
            count=count,
            block_ms=block_ms,
            trusted_from_ms=self._fresh_tokens_from_ms,
        )

    def _redis_now_ms(self) -> float:
        """Redis's clock now, estimated from the monotonic one (``_heard_cancels_from_now``)."""
        return time.monotonic() * 1000 + self._redis_clock_offset_ms

    def _fresh_tokens_from_ms(self) -> int | None:
        """Entries appended from this time on (Redis's clock) are run under the token drawn with them,
        without a round trip to fence them or to read their cancel tombstone: any cancel of theirs was
        published after they were, while this worker listened, and is still remembered here
        (``_accept`` finds it; a later one reaches ``cancel``). None: every entry is fenced."""
        heard_from = self._cancels_heard_from_ms
        if heard_from is None:
            return None
        return int(max(heard_from, self._redis_now_ms() - CANCELS_HEARD_S * 1000 + HEARD_CANCELS_MARGIN_MS))

    def _accept(self, entry: IntakeEntry) -> None:
        if self._cancels_heard.pop(entry.message.id, None) is not None:
            # Its cancel came while the read that brought it was still on its way here.
            entry.cancelled = True
        self.accepted.append((entry.message.id, time.monotonic()))
        self._entries[entry.message.id] = entry
        message = entry.message
        if self.keeper is not None and not message.generated_token_ids:
            self.keeper.arrived(message.tier, message.tenant, message.prompt_token_ids)
        self.scheduler.add(SchedRequest.of(message))
        self._wake.set()
        self._work.set()

    # --- scheduling ---------------------------------------------------------------------------

    def view(self) -> EngineView:
        return engine_view(
            self.scheduler,
            max_running=self.running_capacity,
            kv_capacity_tokens=self._engine.kv_capacity_tokens or 1 << 40,
            backlog=self._backlog,
            step_ms=self._step.value_ms,
            admit_background=self.breakers.admits_background,
        )

    async def _schedule_loop(self) -> None:
        while not self._stopping.is_set():
            if self._idle():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_TICK_S):
                        await self._wake.wait()
            else:
                tick = self._ticks.call_after(SCHEDULE_TICK_S, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    tick.cancel()
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                await self._schedule_round()
            except RedisError as exc:
                log_event(log, "schedule_round_failed", logging.WARNING, error=str(exc))
            except Exception:
                log.exception("schedule_round_failed")

    async def _schedule_round(self) -> None:
        view = self.view()
        decision = self.scheduler.schedule(view, now_ms())
        if self.keeper is not None and not self._stopping.is_set():
            for admitted in decision.admit:
                self.keeper.allocated(admitted.prompt_tokens)
            for touch in self.keeper.due(now_ms(), free_kv_tokens=view.free_kv_tokens):
                touching = asyncio.create_task(self._touch(touch), name=f"touch-{touch.id}")
                self._touches.add(touching)
                touching.add_done_callback(self._touches.discard)
        for request in decision.admit:
            entry = self._entries.get(request.id)
            if entry is None:  # never expected: the scheduler and the entry table disagree
                log_event(log, "admitted_without_entry", logging.ERROR, rid=request.id)
                self.scheduler.finish(request.id, request)
                continue
            self._tasks[request.id] = asyncio.create_task(self._serve(entry, request), name=f"serve-{request.id}")
        for victim in decision.preempt:
            task = self._tasks.get(victim.id)
            if task is not None:
                self._preempting.add(victim.id)
                task.cancel()
        if decision.admit:
            self._room.set()
        token_budget = decision.token_budget
        if token_budget is not None and self.capacity_fraction < 1.0:
            scheduler = self._settings.scheduler
            ramped = self._ramp.capacity(self._ramp_elapsed_s(), scheduler.max_budget_tokens)
            token_budget = min(token_budget, max(scheduler.min_budget_tokens, ramped))
        budget = self._budget.update(token_budget)
        if budget is not None:
            await self._engine.set_token_budget(budget)
        chunk = self._chunk.update(decision.prefill_chunk_tokens) if self._chunk_control else None
        if chunk is not None:
            applied = await self._engine.set_prefill_chunk(chunk)
            if applied is None:  # the engine keeps its chunk, and the scheduler its configured sizes
                self._chunk_control = False
            else:
                self.scheduler.prefill_chunk_applied(applied)
                log_event(log, "engine_prefill_chunk", tokens=applied)

    # --- one request --------------------------------------------------------------------------

    async def _serve(self, entry: IntakeEntry, request: SchedRequest, *, degrade_gap_ms: int | None = None) -> None:
        """Run one delivery of a request to its end; ``degrade_gap_ms``: a continuation that waited
        too long to resume, answered with its summary at once."""
        message = entry.message
        life = RequestLifecycle(message, request, self.scheduler, reservations=self.reservations)
        self._lives[message.id] = life
        started_ms = now_ms()
        outcome = "final"
        acked = False  # the final event carries the entry's acknowledgement

        def emit(event: OutputEvent, *, ack: bool = False) -> None:
            nonlocal acked
            acked = acked or ack
            self._writer.emit(
                message.reply_to, event, fence=entry.fence, ack=(entry.stream, entry.entry_id) if ack else None
            )
            self._beats[message.id] = time.monotonic()
            if event.type == "chunk" and event.seq == 1:
                self._first_chunk_ms[message.id] = now_ms()

        try:
            if entry.cancelled:
                outcome = "cancelled"
                emit(life.error("cancelled", "the client cancelled the request"))
                return
            if life.expired(started_ms):
                outcome = "expired"
                emit(life.error("expired", "the request's deadline passed before it could start"))
                await self._writer.flush()
                if not await intake.dead_letter(self._redis, self._keys, entry, "expired"):
                    outcome = "fenced"
                return
            if degrade_gap_ms is not None:
                outcome = await self._summarise(entry, life, emit, degrade_gap_ms)
                return
            if message.tier == "realtime" and self.breakers.degrade_mode and not life.started:
                # The realtime breaker is open: a long reply is capped, and says so.
                notice = life.cap(self.breakers.config.realtime_cap_tokens, reason="breaker")
                if notice is not None:
                    emit(notice)
                    self.num_degraded += 1
            try:
                outcome = await self._decode(entry, life, emit)
            except asyncio.CancelledError:
                gap_ms = self._degrading.pop(message.id, None)
                if gap_ms is None or self._stopped_by_other(entry) or self._stopping.is_set():
                    raise
                # The watchdog found it silent too long: the rest of the reply is a summary.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                outcome = await self._summarise(entry, life, emit, gap_ms)
        except asyncio.CancelledError:
            if (message.id, entry.fence) in self._fenced:
                # Another worker took the entry over (this one looked dead): it owns the output now.
                outcome = "fenced"
            elif message.id in self._cancel_requested:
                outcome = "cancelled"
                emit(life.error("cancelled", "the client cancelled the request"))
            elif message.id in self._preempting:
                self._preempting.discard(message.id)
                outcome = "preempted" if await self._requeue(entry, life.continuation()) else "fenced"
                self.num_preempted += 1
            else:
                # The worker is stopping: leave the entry pending; another worker takes it over
                # after reclaim_after_ms and resumes from the output already written.
                outcome = "abandoned"
        except InvalidRequestError as exc:
            outcome = "invalid"
            emit(life.error("invalid_request", exc.message))
        except RedisError as exc:
            # Redis hiccup before or between slices: leave the entry pending; it is reclaimed (by us
            # or another worker) after reclaim_after_ms and resumes from the output written so far.
            outcome = "abandoned"
            log_event(log, "request_redis_error", logging.WARNING, rid=message.id, error=str(exc))
        except EngineDeadError as exc:
            outcome = "engine_dead"
            emit(life.error("engine_dead", "the inference engine failed; retry the request"))
            self._fatal = exc
            self.stop()
        except Exception as exc:
            # A bug, not a client error: the client still gets its one terminal event.
            outcome = "failed"
            log.exception("request_failed rid=%s", message.id)
            emit(life.error("internal_error", f"the worker failed: {type(exc).__name__}"))
        finally:
            if self._lives.get(message.id) is life:
                del self._lives[message.id]
                self._beats.pop(message.id, None)
                self._degrading.pop(message.id, None)
            first_chunk_ms = self._first_chunk_ms.pop(message.id, None)
            await self._finish(entry, outcome, started_ms, request, acked=acked)
            if outcome in ("final", "degraded") and self.scheduler.degrades:
                await self._record_latency(message, first_chunk_ms)

    async def _decode(self, entry: IntakeEntry, life: RequestLifecycle, emit: Emit) -> str:
        """Full decoding, slice by slice, until the request finishes or yields; returns the outcome."""
        call = life.next_call()
        while True:
            finish_reason = await self._run_call(entry, life, call, emit)
            if self.keeper is not None:
                self.keeper.allocated(life.call_tokens)
            next_step = life.end_call(finish_reason, self.view)
            if isinstance(next_step, Finished):
                emit(next_step.event, ack=True)
                if self.keeper is not None:
                    message = entry.message
                    self.keeper.finished(
                        message.id, message.tier, message.tenant, message.prompt_token_ids, life.generated, now_ms()
                    )
                return "final"
            if isinstance(next_step, Yield):
                self.num_yielded += 1
                return "yielded" if await self._requeue(entry, next_step.message) else "fenced"
            call = next_step.call

    async def _summarise(self, entry: IntakeEntry, life: RequestLifecycle, emit: Emit, gap_ms: int) -> str:
        """Finish the request with a bounded summary of its prompt and its text so far, produced by the
        engine and streamed as the rest of the response, marked degraded."""
        assert self._prompter is not None  # the watchdog degrades nothing without one
        degrade = self._settings.degrade_config()
        held = life.release_held()
        if held is not None:
            emit(held)
        emit(life.degrade(reason="heartbeat", gap_ms=gap_ms))
        self.num_degraded += 1
        message = entry.message
        log_event(log, "request_degraded", logging.WARNING, rid=message.id, tier=message.tier, gap_ms=gap_ms)
        await self._event("degraded", rid=message.id, tier=message.tier, reason="heartbeat", gap_ms=gap_ms)
        prompt = self._prompter.summary_prompt(
            message.prompt_token_ids,
            life.generated,
            max_prompt_tokens=self._engine.max_model_len - degrade.summary_max_tokens,
            quote_chars=degrade.quote_chars,
        )
        call = life.summary_call(prompt, max_tokens=degrade.summary_max_tokens)
        finish_reason = await self._run_call(entry, life, call, emit)
        outcome = life.end_call(finish_reason, self.view)
        assert isinstance(outcome, Finished)  # a summary always finishes the request
        emit(outcome.event)
        return "degraded"

    async def _run_call(self, entry: IntakeEntry, life: RequestLifecycle, call: EngineCall, emit: Emit) -> str | None:
        """One engine call: stream its output as events; returns its finish reason. The output is
        handled in the engine's own loop (``CallOutput``); this task waits for the call's end."""
        self.num_engine_calls += 1
        last_delta = time.monotonic()

        def take(delta: EngineDelta) -> str | None:
            nonlocal last_delta
            if self._stopped_by_other(entry):
                # The task was cancelled, but a library may have swallowed the CancelledError
                # mid-call (redis-py does): stop here all the same.
                raise asyncio.CancelledError
            prefilling = not life.call_tokens
            if prefilling and life.num_calls == 1 and not life.summarising:
                # What vLLM's prefix cache served of the client's prompt (a chat's earlier turns).
                self.scheduler.prompt_cached(life.id, delta.num_cached_tokens)
            if delta.token_ids or delta.text or (delta.finish_reason and life.held_text):
                # Behind the engine (the last chunk is not written yet): the tokens join that chunk.
                unsent = None if prefilling else self._writer.unsent_chunk(life.id, entry.fence)
                event = life.on_output(delta.token_ids, delta.text, unsent=unsent, finish_reason=delta.finish_reason)
                if event is not None:
                    emit(event)
                else:
                    self._beats[life.id] = time.monotonic()
                if prefilling:
                    self._wake.set()  # its prompt left the budget: a round may admit more
                current = time.monotonic()
                self._step.observe((current - last_delta) * 1000)
                last_delta = current
                self._ticks.beat(current)  # awake for the engine's step: the helper loops that are due run now
            # A stop string ended the reply: the call ends here (``_run_call`` aborts it in the engine).
            return "stop" if life.stopped_here else None

        output = CallOutput(take)
        await self._engine.submit(
            call.engine_request_id,
            call.prompt_token_ids,
            call.sampling,
            priority=call.priority,
            cache_salt=self._settings.cache_salt(entry.message.tenant),
            sink=output,
        )
        try:
            return await output.finished
        finally:
            if output.close():  # ended here, not by the engine: it stops the request at once
                await self._engine.abort(call.engine_request_id)

    async def _touch(self, touch: Touch) -> None:
        """One keep-alive touch: a one-token request of a kept turn's blocks, served from the prefix cache
        (its output is dropped); the keeper learns how much of it the cache still held."""
        assert self.keeper is not None
        num_cached = 0
        one_token = SamplingSpec(temperature=0.0, max_tokens=1)
        deltas = self._engine.generate(
            touch.id,
            touch.token_ids,
            one_token,
            priority=TOUCH_PRIORITY,
            cache_salt=self._settings.cache_salt(touch.tenant),
        )
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    num_cached = max(num_cached, delta.num_cached_tokens)
            self.num_touches += 1
        except Exception as exc:
            # A dead engine stops the worker through its own requests; a touch only ends (and its turn
            # with it: it counts as found evicted).
            log_event(log, "prefix_touch_failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.keeper.touched(touch.id, num_cached)

    async def _record_latency(self, message: RequestMessage, first_chunk_ms: int | None) -> None:
        """Feed the breakers a finished request's latencies, from its enqueue time (best effort)."""
        finished_ms = now_ms()
        ttft_ms = first_chunk_ms - message.enqueued_at_ms if first_chunk_ms is not None else None
        try:
            await self.breakers.record(
                message.tier,
                ttft_ms=ttft_ms,
                e2e_ms=finished_ms - message.enqueued_at_ms,
                request_id=message.id,
                now_ms=finished_ms,
            )
        except RedisError as exc:
            log_event(log, "breaker_record_failed", logging.WARNING, rid=message.id, error=str(exc))

    async def _breaker_loop(self) -> None:
        """Read the shared breakers every second; evaluate the time-driven rules when it is our turn."""
        while not self._stopping.is_set():
            try:
                before = self.breakers.admits_background
                await self.breakers.evaluate(now_ms())
                await self.breakers.refresh()
                if self.breakers.admits_background and not before:
                    self._wake.set()  # background may enter again
            except RedisError as exc:
                log_event(log, "breaker_refresh_failed", logging.WARNING, error=str(exc))
            await self._pause(BREAKER_REFRESH_S)

    async def _warm_prefixes(self, warmer: PrefixWarmer) -> None:
        try:
            await warmer.run()
        except EngineDeadError:
            pass  # the worker's own requests meet it too, and stop the worker
        except Exception:
            log.exception("prefix_warmup_failed")

    async def report_event(self, event: dict[str, object]) -> None:
        """An event of this worker (or of a helper of its process: the GPU memory monitor, the loop
        watch) onto the operators' stream ``tc:events`` (best effort)."""
        await events.publish(self._redis, self._keys, event, source={"worker": self.worker_id})

    async def _event(self, kind: str, **fields: str | int) -> None:
        await self.report_event({"type": kind, **fields})

    async def _watch_heartbeats(self) -> None:
        """The degrade watchdog: a request in decode silent past its tier's limit finishes with a summary;
        so does a continuation waiting here to resume for that long since its last output."""
        degrade = self._settings.degrade_config()
        while not self._stopping.is_set():
            await self._pause_unless_work(degrade.watch_interval_ms / 1000)
            now = time.monotonic()
            for request_id, life in list(self._lives.items()):
                task = self._tasks.get(request_id)
                last = self._beats.get(request_id)
                if task is None or last is None or life.degraded is not None or request_id in self._degrading:
                    continue
                if not life.call_tokens:
                    continue  # its engine call has not produced a token yet: a prefill, not a stall
                gap_ms = (now - last) * 1000
                if degrade.is_late(life.message.tier, gap_ms, life.remaining_tokens):
                    self._degrading[request_id] = math.ceil(gap_ms)  # over the limit, also when rounded
                    task.cancel()
            wall_ms = now_ms()
            for request in list(self.scheduler.waiting()):
                entry = self._entries.get(request.id)
                if entry is None or not entry.message.last_output_ms:
                    continue
                gap_ms = wall_ms - entry.message.last_output_ms
                remaining = entry.message.sampling.max_tokens - len(entry.message.generated_token_ids)
                if degrade.is_late(request.tier, gap_ms, remaining) and self.scheduler.remove(request.id) is not None:
                    # Taken out of the queue: it runs now, as its summary (short and bounded).
                    self.scheduler.admit_now(request)
                    self._tasks[request.id] = asyncio.create_task(
                        self._serve(entry, request, degrade_gap_ms=int(gap_ms)), name=f"summary-{request.id}"
                    )

    async def _requeue(self, entry: IntakeEntry, message: RequestMessage) -> bool:
        """Hand the rest of the request back to the intake stream as the continuation ``message``;
        False when another delivery holds the request (nothing was requeued).

        Everything emitted so far is flushed first: output stream ids must grow, so a continuation
        picked up elsewhere must never write before our earlier positions are in.
        """
        await self._writer.flush()
        message.last_output_ms = now_ms()
        return await intake.requeue(self._redis, self._keys, entry, message) is not None

    def _stopped_by_other(self, entry: IntakeEntry) -> bool:
        """The request was preempted, cancelled or fenced while its task ran. The task was cancelled
        too, but a library may have swallowed the CancelledError mid-call (redis-py does)."""
        rid = entry.message.id
        return rid in self._preempting or rid in self._cancel_requested or (rid, entry.fence) in self._fenced

    def _fenced_out(self, request_id: str, fence: int) -> None:
        """A newer delivery of ``request_id`` holds its fencing token: stop this one, write nothing more."""
        self._fenced.add((request_id, fence))
        entry = self._entries.get(request_id)
        task = self._tasks.get(request_id)
        if entry is not None and entry.fence == fence and task is not None:
            task.cancel()
        elif entry is not None and entry.fence == fence and self.scheduler.remove(request_id) is not None:
            # Still waiting here: let it go without a word, it runs elsewhere.
            del self._entries[request_id]
        log_event(log, "request_fenced", logging.WARNING, rid=request_id, fence=fence)

    async def _finish(
        self,
        entry: IntakeEntry,
        outcome: str,
        started_ms: int,
        request: SchedRequest | None = None,
        *,
        acked: bool = False,
    ) -> None:
        """Acknowledge (unless handed on, or ``acked`` with the final event) and forget the request.

        A continuation keeps the request id, and may already be read back and running here by the
        time this runs: only this run's own entry, task and scheduler slot are dropped.
        """
        message = entry.message
        try:
            await self._writer.flush()
            if (message.id, entry.fence) in self._fenced:
                outcome = "fenced"
            handed_on = outcome in ("expired", "abandoned", "yielded", "preempted", "fenced")
            if not handed_on and not acked and not await intake.ack(self._redis, self._keys, entry):
                outcome = "fenced"
        except RedisError as exc:
            # Left pending: it will be redelivered, and its written positions are de-duplicated.
            log_event(log, "ack_failed", logging.WARNING, rid=message.id, error=str(exc))
        finally:
            if request is not None:
                self.scheduler.finish(message.id, request)
            if self._tasks.get(message.id) is asyncio.current_task():
                del self._tasks[message.id]
                self._cancel_requested.discard(message.id)
                self._preempting.discard(message.id)
            if self._entries.get(message.id) is entry:
                del self._entries[message.id]
            self._fenced.discard((message.id, entry.fence))
            self._wake.set()
            self._room.set()
            if outcome not in ("yielded", "preempted", "abandoned", "fenced"):
                self.served_ids.append(message.id)
            self.outcomes[outcome] += 1
        log_event(
            log,
            "request_" + outcome,
            rid=message.id,
            tier=message.tier,
            bucket=message.bucket,
            slice=message.slice_index,
            wait_ms=started_ms - message.enqueued_at_ms,
            run_ms=now_ms() - started_ms,
        )

    async def _hand_back_waiting(self) -> None:
        """On stop: every entry waiting here (read, not started) goes back to the end of its intake
        stream, atomically with its acknowledgement, for another worker to read at once. One that
        cannot go back stays pending in Redis, taken over once the heartbeat stops."""
        handed = 0
        for request in list(self.scheduler.waiting()):
            entry = self._entries.get(request.id)
            if entry is None or self.scheduler.remove(request.id) is None:
                continue
            try:
                if self._redis_unanswered_at_stop:
                    raise RedisError("the output of earlier requests could not be written")
                # As it is: a fresh request stays fresh (its last output time, if any, is unchanged).
                # The flush waits for every request's output, which a Redis that is gone never takes.
                async with asyncio.timeout(HAND_BACK_S):
                    await self._writer.flush()
                if await intake.requeue(self._redis, self._keys, entry, entry.message) is not None:
                    handed += 1
            except (RedisError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    self._redis_unanswered_at_stop = True
                log_event(log, "hand_back_failed", logging.WARNING, rid=request.id, error=str(exc) or "timed out")
            if self._entries.get(request.id) is entry:
                del self._entries[request.id]
        if handed:
            log_event(log, "requests_handed_back", worker=self.worker_id, waiting=handed)

    async def _drain(self) -> None:
        """Let running requests finish until ``drain_timeout_s`` after ``stop()``; hand back the rest as
        continuations."""
        if not self._tasks:
            return
        left_s = min(self._settings.drain_timeout_s, max(0.0, self._drain_ends_at - time.monotonic()))
        _done, pending = await asyncio.wait(list(self._tasks.values()), timeout=left_s)
        if not pending:
            return
        running = list(self._tasks)
        for request_id in running:
            self.preempt(request_id)
        log_event(log, "requests_handed_back", worker=self.worker_id, running=len(running))
        _done, stuck = await asyncio.wait(pending, timeout=self._stop_wait_s(HAND_BACK_S))
        self._redis_unanswered_at_stop = self._redis_unanswered_at_stop or bool(stuck)
        # Redis does not answer: what could not be handed back stays pending in Redis, taken over once
        # the heartbeat stops. A task waiting on Redis ends after a few cancellations (each ends one
        # wait: the requeue, then the final flush), never by waiting.
        for _attempt in range(4):
            if not stuck:
                break
            for task in stuck:
                task.cancel()
            _done, stuck = await asyncio.wait(stuck, timeout=1.0)
        if stuck:
            log_event(log, "requests_not_handed_back", logging.WARNING, worker=self.worker_id, tasks=len(stuck))

    def _stop_wait_s(self, bound_s: float) -> float:
        """How long a step of the stop may wait for Redis: its own bound, or a second once an earlier
        step's wait ran out (Redis does not answer; waiting the whole bound again only delays the exit,
        and what is left pending in Redis is taken over all the same)."""
        return REDIS_UNANSWERED_WAIT_S if self._redis_unanswered_at_stop else bound_s

    # --- helpers loops ------------------------------------------------------------------------

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker stops."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _ride(self, seconds: float) -> None:
        """Sleep ``seconds``, and on until the engine's next output (the worker is awake for it then), at
        most ``seconds`` more; at once when the worker stops (``Ticks``)."""
        if not self._stopping.is_set():
            await self._ticks.wait(seconds)

    async def _pause_unless_work(self, seconds: float) -> None:
        """``_ride(seconds)``, and then, while the worker is idle, on up to ``IDLE_TICK_S`` in all unless
        an entry arrives (or the worker stops): never more often than before, far less when idle. An
        entry that ends the wait is followed by one more ``_ride(seconds)``, so that what runs next (a
        probe's round trip) does not run beside the entry's start, on its first token's path."""
        await self._ride(seconds)
        if not self._idle():
            return
        self._work.clear()  # in the same step as the check: an entry accepted after it sets it again
        try:
            async with asyncio.timeout(max(0.0, IDLE_TICK_S - seconds)):
                await self._work.wait()
        except TimeoutError:
            return
        await self._ride(seconds)

    async def _heartbeat(self) -> None:
        """Beat until the drain is over (not merely until stop: what still runs here is ours)."""
        beat_s = self._settings.heartbeat_s
        failing = False
        while not self._gone.is_set():
            try:
                now = time.time()
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(self._keys.workers, {self.worker_id: now + WORKER_ALIVE_BEATS * beat_s})
                    pipe.hset(self._keys.worker_info(self.worker_id), mapping=self.describe())
                    pipe.pexpire(self._keys.worker_info(self.worker_id), int(WORKER_ALIVE_BEATS * beat_s * 1000))
                    await pipe.execute()
                held = list(self._entries.values())
                for request_id in await intake.keep_claimed(self._redis, self._keys, self.worker_id, held):
                    self._fenced_out(request_id, next(e.fence for e in held if e.message.id == request_id))
                if not self._stopping.is_set() and await drain.take_drain_request(
                    self._redis, self._keys, self.worker_id
                ):
                    # An operator asked (POST /admin/workers/{id}/drain): stop as SIGTERM would.
                    log_event(log, "worker_drain_requested", worker=self.worker_id)
                    await self._event("worker_draining")
                    self.stop()
                if failing:
                    # Redis was away: every worker's beat went stale, none of them died. Judge again
                    # once each had the time to beat.
                    failing = False
                    self._judge_deaths_after = time.monotonic() + (WORKER_ALIVE_BEATS + 1) * beat_s
            except RedisError as exc:
                failing = True
                log_event(log, "heartbeat_failed", logging.WARNING, error=str(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(beat_s):
                    await self._gone.wait()

    async def _probe_backlog(self) -> None:
        streams = list(self._stream_of)
        while not self._stopping.is_set():
            try:
                lags = await intake.backlog(self._redis, streams)
                self._backlog = {self._stream_of[stream]: lag for stream, lag in lags.items() if lag}
            except RedisError as exc:
                log_event(log, "backlog_probe_failed", logging.WARNING, error=str(exc))
            await self._pause_unless_work(BACKLOG_PROBE_S)

    async def _listen_for_cancels(self) -> None:
        """Until the drain is over: a client may still cancel what runs here."""
        while not self._gone.is_set():
            try:
                async with self._blocking.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self._keys.cancel_channel)
                    await self._heard_cancels_from_now()
                    while not self._gone.is_set():
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            await self.cancel(message["data"].decode())
            except RedisError as exc:
                self._cancels_heard_from_ms = None
                log_event(log, "cancel_listener_reconnect", logging.WARNING, error=str(exc))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._gone.wait()

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request now (what a scheduler decision does): it is aborted in the
        engine and handed back to the intake stream as a continuation."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        self.scheduler.remove(request_id)
        self._preempting.add(request_id)
        task.cancel()
        return True

    async def cancel(self, request_id: str) -> bool:
        """Abort a running request (cancelling its engine iteration aborts it in vLLM), or drop a
        waiting one; either way the client gets one terminal ``cancelled`` error."""
        task = self._tasks.get(request_id)
        if task is not None:
            self._cancel_requested.add(request_id)
            task.cancel()
            return True
        entry = self._entries.get(request_id)
        if entry is None:
            self._remember_cancel(request_id)
            return False
        if self.scheduler.remove(request_id) is None:
            return False
        self._writer.emit(
            entry.message.reply_to,
            error_event(request_id, entry.message.next_seq, "cancelled", "the client cancelled the request"),
            fence=entry.fence,
        )
        await self._finish(entry, "cancelled", now_ms())
        return True

    async def _heard_cancels_from_now(self) -> None:
        """The cancel listener has subscribed: cancels published from now on (Redis's clock, with a margin)
        are heard here."""
        seconds, micros = await self._redis.time()
        redis_ms = seconds * 1000 + micros / 1000
        self._redis_clock_offset_ms = redis_ms - time.monotonic() * 1000
        self._cancels_heard_from_ms = int(redis_ms) + HEARD_CANCELS_MARGIN_MS

    def _remember_cancel(self, request_id: str) -> None:
        """A cancel for a request not held here: kept ``CANCELS_HEARD_S`` in case its entry is on its
        way (read, the reply not handled yet, or still queued when it runs under the token drawn with
        it); the tombstone covers any later read. Forgetting one before its time (more than
        ``SERVED_IDS_KEPT`` heard) sends every entry appended until now through the tombstone's read."""
        now = time.monotonic()
        heard = self._cancels_heard
        while heard and (len(heard) >= SERVED_IDS_KEPT or now - next(iter(heard.values())) > CANCELS_HEARD_S):
            if len(heard) >= SERVED_IDS_KEPT and self._cancels_heard_from_ms is not None:
                self._cancels_heard_from_ms = int(self._redis_now_ms()) + HEARD_CANCELS_MARGIN_MS
            del heard[next(iter(heard))]
        heard[request_id] = now

    async def _reclaim_loop(self) -> None:
        """Take over the entries of dead workers: at once from a worker whose heartbeat stopped, and
        after ``reclaim_after_ms`` of idleness from any consumer (one that never beat, say)."""
        last_idle_scan = time.monotonic()
        while not self._stopping.is_set():
            await self._pause(self._settings.reclaim_interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.take_over_dead()
                due = time.monotonic() - last_idle_scan >= self._settings.reclaim_after_ms / 1000
                if self._settings.reclaim_after_ms and due:
                    last_idle_scan = time.monotonic()
                    await self.reclaim_once()
            except RedisError as exc:
                log_event(log, "reclaim_failed", logging.WARNING, error=str(exc))

    async def _take_over_own(self) -> None:
        """At start: entries still pending under this worker's id were held by an earlier process with
        the same id (a restarted pod with a stable name) that died; resume them here."""
        for stream in self._stream_of:
            entries = await intake.take_over(
                self._redis, self._keys, self.worker_id, self.worker_id, stream, min_idle_ms=0, count=1000
            )
            await intake.fence(self._redis, self._keys, entries)
            for entry in entries:
                await self._take_over(entry, dead_worker=self.worker_id)

    async def take_over_dead(self) -> int:
        """Claim every entry pending on a worker whose heartbeat vouches for it no longer; returns how
        many. A dead worker with nothing left pending is forgotten (heartbeat set, consumer group)."""
        if time.monotonic() < self._judge_deaths_after:
            return 0
        dead = [
            member.decode() if isinstance(member, bytes) else str(member)
            for member in await self._redis.zrangebyscore(self._keys.workers, 0, time.time())
        ]
        taken = 0
        min_idle_ms = int(self._settings.heartbeat_s * 1000)
        for worker_id in dead:
            if worker_id == self.worker_id:
                continue
            left = False
            for stream in self._stream_of:
                entries = await intake.take_over(
                    self._redis, self._keys, self.worker_id, worker_id, stream, min_idle_ms=min_idle_ms, count=100
                )
                await intake.fence(self._redis, self._keys, entries)
                for entry in entries:
                    taken += 1
                    await self._take_over(entry, dead_worker=worker_id)
                left = left or await intake.has_pending(self._redis, stream, worker_id)
            if not left:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.zrem(self._keys.workers, worker_id)
                    for stream in self._stream_of:
                        pipe.xgroup_delconsumer(stream, WORKER_GROUP, worker_id)
                    await pipe.execute(raise_on_error=False)
        return taken

    async def reclaim_once(self) -> int:
        """Take over entries idle past ``reclaim_after_ms`` (their consumer died or hangs); returns how many."""
        taken = 0
        for stream in self._stream_of:
            free = self._settings.num_running_max - len(self._entries)
            if free <= 0:
                break
            entries = await intake.reclaim(
                self._redis, self._keys, self.worker_id, stream, min_idle_ms=self._settings.reclaim_after_ms, count=free
            )
            # Our own (a missed claim refresh) stays ours, under its token.
            theirs = [entry for entry in entries if entry.message.id not in self._entries]
            await intake.fence(self._redis, self._keys, theirs)
            for entry in theirs:
                taken += 1
                await self._take_over(entry)
        return taken

    async def _take_over(self, entry: IntakeEntry, *, dead_worker: str | None = None) -> None:
        """Resume a claimed entry from its durable output. Its new fencing token was given before the
        output is read, so nothing the former owner might still write can slip in after."""
        message = entry.message
        written = await read_output(self._redis, self._keys, message.id, from_seq=1)
        log_event(
            log,
            "request_reclaimed",
            rid=message.id,
            tier=message.tier,
            deliveries=entry.delivery_count,
            positions_written=len(written),
            dead_worker=dead_worker,
        )
        if any(event.terminal for event in written):
            # It finished; only the acknowledgement was lost.
            await intake.ack(self._redis, self._keys, entry)
            return
        entry.message = resumed(message, written)
        if entry.delivery_count > self._settings.max_deliveries:
            self._writer.emit(
                message.reply_to,
                error_event(
                    message.id,
                    entry.message.next_seq,
                    "max_deliveries",
                    f"the request was delivered {entry.delivery_count} times without finishing",
                ),
                fence=entry.fence,
            )
            await self._writer.flush()
            await intake.dead_letter(self._redis, self._keys, entry, "max_deliveries")
            return
        self._accept(entry)
