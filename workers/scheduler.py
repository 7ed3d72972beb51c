"""The ``tailcut`` policy: which waiting requests enter the engine, which running ones make room (pure).

No Redis, no engine, no wall clock: the worker (and the offline simulator) feed it requests and an
``EngineView`` with the current time, and carry out its ``Decision`` (``workers.scheduling`` has the
interface; the baselines ``fifo`` and ``vllm-priority`` are in ``workers.policies``). The rules of
DESIGN.md "Scheduling":

1. a token budget per round (``workers.budget``), short bucket first; new prefill work is admitted
   while it fits what the running decodes and the prompts still being prefilled (one engine chunk
   each, ``prefill_chunk_tokens``) leave of it (``Room``). A realtime prompt is admitted at once,
   the step growing up to the budget ceiling; lower-tier prompts leave the realtime reserve free,
   and background leaves room for the normal tier. A prompt longer than the room is admitted only
   when no prefill is in flight, so it is not starved and the engine chunks it;
2. realtime before normal before background, but realtime may jump ahead of older waiting
   lower-tier work at most ``max_cut_ins`` times in a row; then the oldest lower-tier request is
   admitted if it fits;
3. normal-tier fair share across tenants by weighted deficit round robin (``workers.fairshare``);
4. running background requests are preempted when higher tiers wait and slots or KV are short;
5. sliced decoding: an engine call makes at most ``slice_tokens`` tokens; at a slice boundary a
   request yields only when higher-tier work waits and capacity is short, since a resume costs a
   prefill of whatever fell out of the prefix cache meanwhile.

Adaptive sizes (``SchedulerConfig.adaptive``), from what a worker observes and nothing else: the
engine's prefill chunk and the realtime reserve fit a high quantile of the realtime prompts seen (less
what the engine's prefix cache served of them), so a realtime prompt is prefilled in one step; the
normal tier's room fits its prompts; the lower tiers' room follows their arrival rate and backlog
when that is more than the budget rule gives; background waits while more realtime requests are in
flight than usual (``background_gate_margin``); and while the steps of about a reply's life run
``slow_step_margin`` (7%) slower than those of the last half minute (``slow_step_window_ms``), the
lower tiers' room shrinks to a few chunks and background waits, so a stretch of large steps ends
before the replies decoding through it pay for all of it. Where the step ceiling bounds the lower tiers'
room, realtime prefill in flight takes the reserve before that room (``Room``). The configured chunk
and reserve are floors while realtime traffic comes; once it stopped (none of the last ``TIER_MEMORY``
arrivals, none in flight: ``realtime_quiet``), nothing is kept for it and the lower tiers may fill the
step to the ceiling, as they would without tailcut. Three options (off: BENCHMARKS.md) let a waiting
normal prompt, or a realtime prompt the step would split, take the room of background prompts in
prefill by preempting them (``normal_takes_background_prefill``, ``realtime_takes_background_prefill``),
and, past what the worker serves — from ``overload_background_waiting`` background requests waiting
until half as many do (``overloaded``) — give the lower tiers the budget rule's room in the configured
chunk, with none of the rules above: their demand cannot be met, and steps of one size, evenly filled,
are what the realtime replies need when the engine never idles.

KV is counted by reservation (``SchedRequest.reserved_kv_tokens``): a request is admitted only if its
prompt plus the output ``kv_reservation`` expects of its next call fits what the running requests'
reservations leave, and the same figure decides yields and how many background requests to preempt.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from queues.keys import Bucket, Tier
from workers.budget import PrefillRate, PromptLengths, RealtimeProgress, TimeAverage, token_budget
from workers.fairshare import DeficitRoundRobin, rtt_weight
from workers.scheduling import (
    BUCKET_RANK,
    TIER_RANK,
    Decision,
    EngineView,
    RequestHeap,
    RunningTable,
    SchedRequest,
    SchedulerConfig,
)


def _cost(request: SchedRequest) -> int:
    """Fair-share cost of a normal request: the tokens it will put through the engine."""
    return request.prompt_tokens + request.remaining_tokens


def _urgency(request: SchedRequest) -> tuple[int, ...]:
    return (BUCKET_RANK[request.bucket], request.arrival_ms)


# A tier none of whose requests came among the last this many arrivals (of any tier) has stopped
# sending: room kept for it is throughput lost. The normal tier's room is then not held free of
# background, and with no realtime request in flight either, nothing is kept for realtime
# (``TailcutPolicy.realtime_quiet``).
TIER_MEMORY = 256
# Weight of the newest request in a tier's cached share (``TailcutPolicy.prompt_cached``) once 64 were
# seen; before, each weighs as much as those before it (a mean), so a worker that starts on chat turns
# the engine caches knows the share after a few of them instead of a few hundred.
CACHED_SHARE_WEIGHT = 1 / 64
# The lower tiers' room covers their arrival rate and their backlog (over ``backlog_drain_ms``) with
# this margin (and a chunk to spare: prompts are admitted in whole chunks).
DEMAND_MARGIN = 0.5
# ``TailcutPolicy.slow_steps`` compares the steps of about a realtime reply's life (a chat reply of
# tens of tokens decodes over as many steps) with the usual ones (``slow_step_window_ms``).
SLOW_STEP_ROUNDS = 40


@dataclass(frozen=True, slots=True)
class Room:
    """One round's sizes, in tokens per engine step (``TailcutPolicy.room``).

    ``chunk`` is the engine's prefill chunk in force. The step budget holds the running decodes, the
    prefill room ``lower_prefill`` and the realtime ``reserve`` on top of it. A lower-tier prompt is
    admitted while the decodes and every chunk in flight (realtime ones too: realtime prefill is
    prefill the step already carries, and the reserve stays headroom for realtime prompts still to
    come) stay within ``lower_limit``; background also leaves what normal prompts in flight do not fill
    of ``normal_room``. Where the step ceiling is what bounds the room (``at_ceiling``), realtime
    chunks in flight take the reserve first and the room only beyond it: the room is already less
    than the lower tiers ask, and counting realtime prefill in both would leave them less again (a
    mix of long realtime prompts, whose reserve is large, starved its background so). Realtime is
    admitted whatever the budget: the step grows up to the ``ceiling``, and the engine, which orders
    waiting requests by priority, gives it the step's room first.
    """

    ceiling: int
    chunk: int
    reserve: int
    decodes: int
    lower_prefill: int
    normal_room: int
    # Background waits this round: more realtime requests are in flight than usual, or the steps run slow.
    background_held: bool = False
    # The room is what the ceiling leaves above the decodes and the reserve (see above).
    at_ceiling: bool = False

    @property
    def budget(self) -> int:
        return min(self.ceiling, self.decodes + self.lower_prefill + self.reserve)

    @property
    def lower_limit(self) -> int:
        return self.decodes + self.lower_prefill

    def lower_spent(self, spent: Spent) -> int:
        """What ``spent`` takes of ``lower_limit``: all of it, less the realtime chunks the reserve holds
        where the room is at the ceiling."""
        lent = min(spent.chunks["realtime"], self.reserve) if self.at_ceiling else 0
        return spent.total - lent


@dataclass(slots=True)
class Spent:
    """What a round has committed of the next engine step: a token per running request, and each
    prompt still being prefilled its chunk, per tier."""

    decodes: int
    chunks: dict[Tier, int]

    @property
    def total(self) -> int:
        return self.decodes + sum(self.chunks.values())


class TailcutPolicy(RunningTable):
    steers_token_budget = True
    admits_by_kv = True
    degrades = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__()
        self.config = config
        self._realtime = RequestHeap()
        self._background = RequestHeap()
        # Normal tier: one fair-share queue per bucket, shortest first (see ``_pick_normal``).
        self._normal_by_bucket: dict[Bucket, DeficitRoundRobin[SchedRequest]] = {
            bucket: DeficitRoundRobin(config.fair_quantum_tokens, self.weight) for bucket in BUCKET_RANK
        }
        self._bucket_bypasses = 0
        self._cut_ins = 0
        self._rtt_ms: dict[str, float] = {}
        # Admitted requests whose prompt the engine is still computing: id → (prompt tokens, tier).
        self._prefilling: dict[str, tuple[int, Tier]] = {}
        # What the adaptive sizes are made of (``room``): the prompt lengths clients sent lately, per
        # tier they size, and the share of them the engine's prefix cache served; the lower tiers'
        # arrival rate; the realtime requests in flight, on average.
        self._prompts: dict[Tier, PromptLengths] = {
            tier: PromptLengths(
                window=config.prompt_window, quantile=config.prompt_quantile, grain=config.kv_block_tokens
            )
            for tier in ("realtime", "normal")
        }
        self._cached_share: dict[Tier, float] = dict.fromkeys(self._prompts, 0.0)
        self._cached_seen: dict[Tier, int] = dict.fromkeys(self._prompts, 0)
        # Arrivals since each tier's last one: a worker starts keeping nothing for the normal tier, and
        # keeping what realtime needs (a chat may be the first request it gets).
        self._arrivals_since: dict[Tier, int] = {"realtime": 0, "normal": TIER_MEMORY}
        self._lower_rate = PrefillRate(window_ms=config.traffic_window_ms)
        self._realtime_in_flight = TimeAverage(window_ms=config.traffic_window_ms)
        # The step time over about a reply's life, and the usual one (``slow_steps``).
        self._recent_step = TimeAverage(window_ms=1.0)
        self._usual_step = TimeAverage(window_ms=config.slow_step_window_ms)
        self._steps_seen = False
        # Past what the worker serves (``overloaded``).
        self._overloaded = False
        # The engine's prefill chunk in force: the configured one until the driver applied another.
        # The adaptive sizes act only once it did: they count on the engine chunking as asked.
        self._engine_chunk = config.prefill_chunk_tokens
        self._engine_follows = False
        # The round's view says whether background may enter (no, in the breaker's degrade mode).
        self._admit_background = True

    # --- what the scheduler holds ---------------------------------------------------------------

    def _normal(self) -> Iterator[SchedRequest]:
        for queue in self._normal_by_bucket.values():
            yield from queue

    def waiting(self) -> Iterator[SchedRequest]:
        yield from self._realtime
        yield from self._normal()
        yield from self._background

    @property
    def num_waiting(self) -> int:
        num_normal = sum(len(queue) for queue in self._normal_by_bucket.values())
        return len(self._realtime) + num_normal + len(self._background)

    def add(self, request: SchedRequest) -> None:
        if not request.continuation:
            self._observe(request)
        if request.tier == "realtime":
            self._realtime.push(_urgency(request), request)
        elif request.tier == "normal":
            self._normal_by_bucket[request.bucket].push(request.tenant, request, _cost(request))
        else:
            self._background.push(_urgency(request), request)

    def remove(self, request_id: str) -> SchedRequest | None:
        """Forget a waiting or running request (cancelled, expired)."""
        self._prefilling.pop(request_id, None)
        if request_id in self._running:
            return self._running.pop(request_id)
        for heap in (self._realtime, self._background):
            found = heap.remove(request_id)
            if found is not None:
                return found
        for queue in self._normal_by_bucket.values():
            found = queue.remove(lambda request: request.id == request_id)
            if found is not None:
                return found
        return None

    def _forget(self, request_id: str) -> None:
        self.prefilled(request_id)  # a request that left is not being prefilled either

    def prompt_cached(self, request_id: str, num_cached_tokens: int) -> None:
        """Learn the share of a tier's prompts the engine's prefix cache serves (a chat's earlier
        turns): only the rest is computed, so only the rest sizes the chunk and the room."""
        request = self._running.get(request_id)
        if request is None or request.continuation or request.tier not in self._cached_share:
            return
        share = min(1.0, num_cached_tokens / max(1, request.prompt_tokens))
        self._cached_seen[request.tier] += 1
        weight = max(CACHED_SHARE_WEIGHT, 1 / self._cached_seen[request.tier])
        self._cached_share[request.tier] += weight * (share - self._cached_share[request.tier])

    def prefill_chunk_applied(self, num_tokens: int) -> None:
        """The driver set the engine's prefill chunk (``Decision.prefill_chunk_tokens``): count with it,
        and adapt from now on."""
        self._engine_chunk = num_tokens
        self._engine_follows = True

    @property
    def adapting(self) -> bool:
        """Whether the adaptive sizes act: ``config.adaptive``, and the driver applies the chunk the
        scheduler asks for (until then the policy is the configured one, which a driver that cannot
        change the engine's chunk keeps)."""
        return self.config.adaptive and self._engine_follows

    def prefilled(self, request_id: str) -> None:
        """The engine produced the request's first token: its prompt no longer takes budget."""
        self._prefilling.pop(request_id, None)

    def prefetch_room(self, tier: Tier, prefetch: int) -> int:
        """``prefetch`` minus what waits here at ``tier`` or a more urgent one, so a local queue full
        of background work never keeps a realtime request in Redis."""
        rank = TIER_RANK[tier]
        return prefetch - sum(1 for request in self.waiting() if TIER_RANK[request.tier] <= rank)

    def slice_limit(self, request: SchedRequest) -> int:
        return min(request.remaining_tokens, self.config.slice_tokens)

    def engine_priority(self, request: SchedRequest) -> int:
        """The tier, spaced so that each tier's summaries fit in ahead of it (lower runs first)."""
        return 2 * TIER_RANK[request.tier] + 1

    def summary_priority(self, request: SchedRequest) -> int:
        return 2 * TIER_RANK[request.tier]

    # --- fair share -----------------------------------------------------------------------------

    def weight(self, tenant: str) -> float:
        rtt = self._rtt_ms.get(tenant, 0.0)
        average = sum(self._rtt_ms.values()) / len(self._rtt_ms) if self._rtt_ms else 0.0
        return rtt_weight(average, rtt, min_weight=self.config.fair_min_weight, max_weight=self.config.fair_max_weight)

    def observe_wait(self, tenant: str, wait_ms: float) -> None:
        """Fold a normal-tier queue wait into the tenant's recent latency."""
        alpha = self.config.rtt_smoothing
        previous = self._rtt_ms.get(tenant)
        self._rtt_ms[tenant] = wait_ms if previous is None else (1 - alpha) * previous + alpha * wait_ms

    # --- one round ------------------------------------------------------------------------------

    def schedule(self, view: EngineView, now_ms: int) -> Decision:
        self._admit_background = view.admit_background
        room = self.room(view, now_ms)
        slots, kv = view.free_slots, view.free_kv_tokens
        # Each step, every running request decodes one token and each prompt being prefilled takes
        # a chunk; what is left is room for new prompts.
        admitted: list[SchedRequest] = []
        yielded: list[SchedRequest] = []
        spent = Spent(len(self._running), dict.fromkeys(TIER_RANK, 0))
        for tokens, tier in self._prefilling.values():
            spent.chunks[tier] += self._chunk(tokens, room)
        while slots > 0:
            # A prompt longer than the room is admitted only into an engine with no prefill in
            # flight, so it is not starved and still leaves every step room for what comes next.
            pick = self._pick(slots, kv, room, spent, first=not admitted and not self._prefilling)
            if pick is None:
                if yielded or not (victims := self._background_prefill_for_normal(slots, kv, room, spent, admitted)):
                    break
                slots, kv = self._yield(victims, room, spent, slots, kv)
                yielded.extend(victims)
                continue
            self._admit(pick, now_ms)
            admitted.append(pick)
            slots -= 1
            kv -= pick.reserved_kv_tokens(self.config)
            spent.chunks[pick.tier] += self._chunk(pick.prompt_tokens, room)
        if self.adapting and self.config.realtime_takes_background_prefill:
            # The engine runs the prompts it is prefilling before the ones it was just given: a realtime
            # prompt gets what they leave of the step, and is split if that is less than it needs.
            later = sum(self._chunk(request.prompt_tokens, room) for request in admitted if request.tier != "realtime")
            squeeze = spent.total - later - room.ceiling
            if any(request.tier == "realtime" for request in admitted) and squeeze > 0:
                victims = self._newest_background_prefill(squeeze, room, admitted)
                slots, kv = self._yield(victims, room, spent, slots, kv)
                yielded.extend(victims)
        # A realtime prompt that fits the ceiling but not the budget grows this step's budget, so it
        # is prefilled now and whole rather than split or held.
        budget = min(room.ceiling, max(room.budget, spent.total)) if self.adapting else room.budget
        decision = Decision(admit=admitted, token_budget=budget, prefill_chunk_tokens=self.prefill_chunk_tokens or None)
        preempted = self._preemptions(slots, kv)
        decision.preempt = yielded + preempted
        for victim in preempted:
            self._running.pop(victim.id, None)
            self._prefilling.pop(victim.id, None)
        return decision

    # --- sizes from what the worker sees --------------------------------------------------------

    def _observe(self, request: SchedRequest) -> None:
        """Learn from a client's prompt (continuations are not a client's: they are not counted)."""
        if not self.config.adaptive:
            return
        estimate = self._prompts.get(request.tier)
        if estimate is not None:
            # What the engine will compute of the tier's prompts: less the share its prefix cache serves.
            estimate.observe(request.prompt_tokens, scale=1 - self._cached_share[request.tier])
        if request.tier != "realtime":
            self._lower_rate.observe(request.prompt_tokens)
        for tier, count in self._arrivals_since.items():
            self._arrivals_since[tier] = 0 if request.tier == tier else count + 1

    @property
    def prefill_chunk_tokens(self) -> int:
        """The prefill chunk the engine should run with (``Decision.prefill_chunk_tokens``): the
        configured one, raised so the realtime prompts seen (their ``prompt_quantile``) are prefilled
        in one step, and to half the budget floor — lower-tier prompts then go through about two at a
        time at full speed instead of many at a crawl (a prompt's first token waits for its last
        chunk); at most half the budget ceiling, so a realtime prompt fits beside one lower-tier
        chunk. 0 (no chunking) stays 0. Past what the worker serves (``overloaded``), the configured one:
        the lower tiers' fixed room is then filled evenly, in several chunks a step, not one of half the
        budget floor every other step (on a mix of long realtime prompts, keeping those whole there left
        the lower tiers one chunk at a time: background at 100% 0.72x vllm-priority's against 0.96x)."""
        config = self.config
        configured = config.prefill_chunk_tokens
        if not configured or not config.adaptive or self._overloaded:
            return configured
        seen = self._prompts["realtime"].size() or 0
        return max(configured, min(max(seen, config.budget.min_tokens // 2), config.budget.max_tokens // 2))

    @property
    def realtime_reserve_tokens(self) -> int:
        """Room lower tiers leave free in every step: the configured reserve, raised to one realtime
        prompt of the ``prompt_quantile``, at most one chunk in force. 0 (no reserve) stays 0."""
        configured = self.config.realtime_reserve_tokens
        seen = self._prompts["realtime"].size()
        if not configured or seen is None or not self.adapting:
            return configured
        return max(configured, min(seen, self._engine_chunk or seen))

    def normal_room_tokens(self) -> int:
        """Room background leaves free for the normal tier: one chunk of a normal prompt of the
        ``prompt_quantile``, while normal requests keep arriving (0 before any was seen)."""
        seen = self._prompts["normal"].size()
        if seen is None or self._arrivals_since["normal"] >= TIER_MEMORY or not self.adapting:
            return 0
        return min(seen, self._engine_chunk) if self._engine_chunk else seen

    def room(self, view: EngineView, now_ms: int) -> Room:
        """This round's sizes (``Room``). The prefill room is the most of: what the budget rule
        (``workers.budget``) leaves above the running decodes and the configured reserve; a normal
        chunk and a background chunk side by side; and (adaptive) the lower tiers' arrival rate and
        backlog at the current step time, with a margin and a chunk to spare, as far as the ceiling
        holds it beside the decodes and the reserve. The reserve comes on top of it. Background is
        held while more realtime requests are in flight than their recent average allows
        (``background_gate_margin``), unless ``background_gate_max_waiting`` wait (here, or still in
        the intake streams: ``EngineView.backlog``), and while the steps run slow (``slow_steps``),
        when the prefill room is also ``slow_step_room_chunks`` chunks at most. With no realtime traffic
        (``realtime_quiet``), none of this: no reserve, and the room is what the ceiling leaves above the
        decodes."""
        config = self.config
        chunk = self._engine_chunk
        normal_room = self.normal_room_tokens()
        decodes = len(self._running)
        reserve = self.realtime_reserve_tokens
        budget_room = self.current_budget(view, now_ms) - decodes - config.realtime_reserve_tokens
        lower_prefill = budget_room
        lower_rate = self._lower_rate.update(now_ms)
        if self.adapting:
            lower_prefill = max(lower_prefill, normal_room + chunk)
            backlog = self._queued_tokens(list(self._normal()), view.backlog_of(tiers=("normal",)))
            backlog += self._queued_tokens(list(self._background), view.backlog_of(tiers=("background",)))
            demand = view.step_ms * (lower_rate + backlog / config.backlog_drain_ms) * (1 + DEMAND_MARGIN) + chunk
            lower_prefill = max(lower_prefill, min(int(demand), config.budget.max_tokens - decodes - reserve))
        num_realtime = sum(1 for request in self._running.values() if request.tier == "realtime")
        usual = self._realtime_in_flight.update(now_ms, num_realtime)
        # Background waiting anywhere: here, and in its intake streams (a live worker reads ahead only
        # ``prefetch`` of them; the simulator holds every one here and reports no backlog).
        background_waiting = len(self._background) + view.backlog_of(tiers=("background",))
        slow = self.adapting and self.slow_steps(view.step_ms, now_ms)
        if slow and chunk:
            # The replies decoding now pay every step of this stretch: it takes no more than a few
            # lower-tier chunks at a time until the steps are back to usual.
            lower_prefill = min(lower_prefill, chunk * config.slow_step_room_chunks)
        held = (
            self.adapting
            and (slow or num_realtime > usual * (1 + config.background_gate_margin))
            and background_waiting < config.background_gate_max_waiting
        )
        if self.adapting and self.realtime_quiet(num_realtime, view):
            # Every rule above keeps steps short for realtime replies, and none is coming: the lower
            # tiers may fill the step, as an engine without tailcut would let them.
            reserve, held = 0, False
            lower_prefill = config.budget.max_tokens - decodes
        elif self.adapting and self.overloaded(background_waiting):
            # More is sent than served: no room made for demand that cannot be met, none held for
            # prompts still to come; the budget rule's room, evenly filled.
            lower_prefill = max(budget_room, chunk)
            normal_room, held = 0, False
        return Room(
            ceiling=config.budget.max_tokens,
            chunk=chunk,
            reserve=reserve,
            decodes=decodes,
            lower_prefill=lower_prefill,
            normal_room=normal_room,
            background_held=held,
            at_ceiling=self.adapting and lower_prefill >= config.budget.max_tokens - decodes - reserve,
        )

    def overloaded(self, background_waiting: int) -> bool:
        """Whether the worker serves less than the lower tiers send: from
        ``overload_background_waiting`` background requests waiting (``background_waiting``) until half
        as many do (so the engine's chunk, which it sets, changes seldom). Never with the rule off."""
        threshold = self.config.overload_background_waiting
        if self._overloaded:
            self._overloaded = background_waiting > threshold // 2
        else:
            self._overloaded = 0 < threshold <= background_waiting
        return self._overloaded

    def realtime_quiet(self, num_running: int, view: EngineView) -> bool:
        """Whether the realtime tier has stopped sending: none of the last ``TIER_MEMORY`` arrivals, none
        running (``num_running``), none waiting here or in its intake streams. A worker starts not
        knowing (so keeps the realtime sizes); one realtime request ends it."""
        if self._arrivals_since["realtime"] < TIER_MEMORY or num_running or len(self._realtime):
            return False
        return not view.backlog_of(tiers=("realtime",))

    def slow_steps(self, step_ms: float, now_ms: int) -> bool:
        """Fold in this round's step time; whether the steps of about a reply's life run more than
        ``slow_step_margin`` above those of the last ``slow_step_window_ms``. Both are averages over
        the scheduler's clock, a reply's life being ``SLOW_STEP_ROUNDS`` usual steps long: a live
        worker also runs a round per arrival and per tick, so its rounds are not steps. Both start at
        the first step seen; with the rule off, nothing is kept."""
        margin = self.config.slow_step_margin
        if margin <= 0:
            return False
        recent, usual = self._recent_step, self._usual_step
        if not self._steps_seen:
            recent.value = usual.value = step_ms
            self._steps_seen = True
        recent.window_ms = SLOW_STEP_ROUNDS * max(usual.value, 1.0)
        return recent.update(now_ms, step_ms) > usual.update(now_ms, step_ms) * (1 + margin)

    def _queued_tokens(self, here: list[SchedRequest], num_elsewhere: int) -> int:
        """Prompt tokens of a tier's waiting requests: those here, and ``num_elsewhere`` more still in
        the intake streams, counted at the mean of those here (a count is all the backlog probe gives);
        at most ``SchedulerConfig.backlog_max_requests`` requests of them."""
        if not here:
            return 0
        counted = min(len(here) + num_elsewhere, self.config.backlog_max_requests)
        return sum(request.prompt_tokens for request in here) * counted // len(here)

    def _chunk(self, prompt_tokens: int, room: Room) -> int:
        return min(prompt_tokens, room.chunk) if room.chunk else prompt_tokens

    def current_budget(self, view: EngineView, now_ms: int) -> int:
        """The budget rule's value (``workers.budget``) before the adaptive sizes (``room``)."""
        num_short = sum(1 for request in self.waiting() if request.bucket == "short")
        num_short += view.backlog_of(buckets=("short",))
        realtime = [
            RealtimeProgress(request.deadline_ms, request.remaining_tokens)
            for request in itertools.chain(self._realtime, self._running.values())
            if request.tier == "realtime"
        ]
        return token_budget(
            self.config.budget,
            num_short_waiting=num_short,
            num_running=len(self._running),
            realtime=realtime,
            now_ms=now_ms,
            step_ms=view.step_ms,
        )

    def at_slice_boundary(self, request_id: str, view: EngineView) -> bool:
        """``True``: the request yields (the caller re-queues it as a continuation); ``False``: go on."""
        request = self._running.get(request_id)
        if request is None:
            return False
        higher = self._waiting_above(request.tier)
        higher_tiers = tuple(tier for tier, rank in TIER_RANK.items() if rank < TIER_RANK[request.tier])
        higher_backlog = view.backlog_of(tiers=higher_tiers)
        if higher is None and not higher_backlog:
            return False
        need_kv = higher.reserved_kv_tokens(self.config) if higher is not None else 0
        if view.free_slots > 0 and view.free_kv_tokens >= need_kv:
            return False
        del self._running[request_id]
        self._prefilling.pop(request_id, None)
        return True

    # --- internals ------------------------------------------------------------------------------

    def _fits(
        self, request: SchedRequest, kv: int, room: Room, spent: Spent, first: bool, *, overdue: bool = False
    ) -> bool:
        """Whether ``request`` fits this round; ``overdue``: it is the older request the cut-in limit
        lets in, which the background gate does not hold (every tier's wait stays bounded)."""
        if request.reserved_kv_tokens(self.config) > kv:
            return False
        if first or (request.tier == "realtime" and self.adapting):
            return True
        chunk = self._chunk(request.prompt_tokens, room)
        if request.tier == "realtime":
            return spent.total + chunk <= room.budget
        used = room.lower_spent(spent)
        if request.tier == "normal":
            return used + chunk <= room.lower_limit
        if room.background_held and not overdue:
            return False
        # Background leaves the normal room free, or what of it normal prompts in flight do not fill.
        return used + chunk + max(0, room.normal_room - spent.chunks["normal"]) <= room.lower_limit

    def _oldest_lower(self) -> SchedRequest | None:
        candidates = [*self._normal(), *(self._background if self._admit_background else ())]
        return min(candidates, key=lambda request: request.arrival_ms, default=None)

    def _pick(self, slots: int, kv: int, room: Room, spent: Spent, *, first: bool) -> SchedRequest | None:
        """Choose (and take out of its queue) the next request to admit, or ``None``."""
        realtime = self._realtime.peek()
        if realtime is not None:
            older = self._oldest_lower()
            jumps = older is not None and older.arrival_ms < realtime.arrival_ms
            if jumps and older is not None and self._cut_ins >= self.config.max_cut_ins:
                if self._fits(older, kv, room, spent, first, overdue=True):
                    self._take(older)
                    self._cut_ins = 0
                    return older
            if not self._fits(realtime, kv, room, spent, first):
                return None
            self._realtime.pop()
            if jumps:
                self._cut_ins = min(self._cut_ins + 1, self.config.max_cut_ins)
            return realtime
        normal = self._pick_normal()
        if normal is not None:
            if self._fits(normal, kv, room, spent, first):
                self._cut_ins = 0
                return normal
            self._normal_by_bucket[normal.bucket].push_front(normal.tenant, normal, _cost(normal))
            return None
        background = self._background.peek() if self._admit_background else None
        if background is not None and self._fits(background, kv, room, spent, first):
            self._cut_ins = 0
            return self._background.pop()
        return None

    def _pick_normal(self) -> SchedRequest | None:
        """Shortest bucket first, fair share across tenants within a bucket; a longer bucket whose
        oldest request is older than the shorter pick is bypassed at most ``max_cut_ins`` times in
        a row, so long normal work cannot starve behind a stream of short requests."""
        heads = [(bucket, queue) for bucket, queue in self._normal_by_bucket.items() if len(queue)]
        if not heads:
            return None
        shortest_bucket, shortest = heads[0]
        oldest_in = {bucket: min(request.arrival_ms for request in queue) for bucket, queue in heads}
        overdue = [bucket for bucket, _ in heads[1:] if oldest_in[bucket] < oldest_in[shortest_bucket]]
        if overdue and self._bucket_bypasses >= self.config.max_cut_ins:
            self._bucket_bypasses = 0
            return self._normal_by_bucket[min(overdue, key=oldest_in.__getitem__)].pop()
        if overdue:
            self._bucket_bypasses += 1
        return shortest.pop()

    def _take(self, request: SchedRequest) -> None:
        if request.tier == "normal":
            self._normal_by_bucket[request.bucket].remove(lambda candidate: candidate.id == request.id)
        else:
            self._background.remove(request.id)

    def _admit(self, request: SchedRequest, now_ms: int) -> None:
        self._running[request.id] = request
        self._prefilling[request.id] = (request.prompt_tokens, request.tier)
        if request.tier == "normal":
            self.observe_wait(request.tenant, now_ms - request.arrival_ms)

    def _waiting_above(self, tier: Tier) -> SchedRequest | None:
        """A waiting request of a more urgent tier than ``tier``, if any (realtime first)."""
        if tier == "realtime":
            return None
        head = self._realtime.peek()
        if head is not None or tier == "normal":
            return head
        return next(self._normal(), None)

    def _background_prefill_for_normal(
        self, slots: int, kv: int, room: Room, spent: Spent, admitted: list[SchedRequest]
    ) -> list[SchedRequest]:
        """Background prompts in prefill (not those ``admitted`` this round) to preempt so the normal
        request first in line fits the room (``SchedulerConfig.normal_takes_background_prefill``),
        newest first; none where the room is not what it waits for, or where freeing every one would
        not do."""
        if not self.config.normal_takes_background_prefill or not self.adapting:
            return []
        normal = next(self._normal(), None)
        if normal is None:
            return []
        if slots <= 0 or normal.reserved_kv_tokens(self.config) > kv:
            return []
        excess = room.lower_spent(spent) + self._chunk(normal.prompt_tokens, room) - room.lower_limit
        return self._newest_background_prefill(excess, room, admitted)

    def _newest_background_prefill(self, excess: int, room: Room, admitted: list[SchedRequest]) -> list[SchedRequest]:
        """The newest background prompts in prefill (not those ``admitted`` this round) whose chunks and
        decodes free ``excess`` tokens of the step; none if all of them would not."""
        now = {request.id for request in admitted}
        prefilling = sorted(
            (
                self._running[request_id]
                for request_id, (_, tier) in self._prefilling.items()
                if tier == "background" and request_id in self._running and request_id not in now
            ),
            key=lambda request: request.arrival_ms,
            reverse=True,  # the newest has computed the least
        )
        victims: list[SchedRequest] = []
        for victim in prefilling:
            if excess <= 0:
                break
            victims.append(victim)
            excess -= self._chunk(victim.prompt_tokens, room) + 1
        return victims if excess <= 0 else []

    def _yield(self, victims: list[SchedRequest], room: Room, spent: Spent, slots: int, kv: int) -> tuple[int, int]:
        """Take ``victims`` (background prompts in prefill, to be preempted) out of the running table and
        ``spent``; the slots and KV they free."""
        for victim in victims:
            self._running.pop(victim.id, None)
            self._prefilling.pop(victim.id, None)
            spent.decodes -= 1
            spent.chunks["background"] -= self._chunk(victim.prompt_tokens, room)
            kv += victim.reserved_kv_tokens(self.config)
            slots += 1
        return slots, kv

    def _preemptions(self, slots: int, kv: int) -> list[SchedRequest]:
        """Running background requests to abort so waiting higher-tier heads fit."""
        running_background = [request for request in self._running.values() if request.tier == "background"]
        return self._victims(running_background, list(itertools.chain(self._realtime, self._normal())), slots, kv)

    def _victims(
        self, running: list[SchedRequest], blocked: list[SchedRequest], slots: int, kv: int
    ) -> list[SchedRequest]:
        """Of ``running``, the newest first, those to abort so that ``blocked`` (as many of them as there
        are ``running``) get the ``slots`` and ``kv`` they lack."""
        if not blocked or not running:
            return []
        running = sorted(running, key=lambda request: request.arrival_ms, reverse=True)  # the newest loses the least
        blocked = blocked[: len(running)]
        need_slots = max(0, len(blocked) - slots)
        need_kv = max(0, sum(request.reserved_kv_tokens(self.config) for request in blocked) - kv)
        victims: list[SchedRequest] = []
        for victim in running:
            if need_slots <= 0 and need_kv <= 0:
                break
            victims.append(victim)
            need_slots -= 1
            need_kv -= victim.reserved_kv_tokens(self.config)
        return victims
