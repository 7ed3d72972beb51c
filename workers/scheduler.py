"""The ``tailcut`` policy: which waiting requests enter the engine, which running ones make room (pure).

No Redis, no engine, no wall clock: the worker (and the offline simulator) feed it requests and an
``EngineView`` with the current time, and carry out its ``Decision`` (``workers.scheduling`` has the
interface; the baselines ``fifo`` and ``vllm-priority`` are in ``workers.policies``). The rules of
DESIGN.md "Scheduling":

1. a token budget per round (``workers.budget``), short bucket first; new prefill work is admitted
   while it fits what the running decodes and the prompts still being prefilled (one engine chunk
   each, ``prefill_chunk_tokens``) leave of it. A longer prompt is admitted only when no prefill
   is in flight, so it is not starved and the engine chunks it while every step keeps room;
2. realtime before normal before background, but realtime may jump ahead of older waiting
   lower-tier work at most ``max_cut_ins`` times in a row; then the oldest lower-tier request is
   admitted if it fits;
3. normal-tier fair share across tenants by weighted deficit round robin (``workers.fairshare``);
4. running background requests are preempted when higher tiers wait and slots or KV are short;
5. sliced decoding: an engine call makes at most ``slice_tokens`` tokens; at a slice boundary a
   request yields only when higher-tier work waits and capacity is short, since a resume costs a
   prefill of whatever fell out of the prefix cache meanwhile.

KV is counted by reservation (``SchedRequest.reserved_kv_tokens``): a request is admitted only if its
prompt plus the output ``kv_reservation`` expects of its next call fits what the running requests'
reservations leave, and the same figure decides yields and how many background requests to preempt.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from queues.keys import Bucket, Tier
from workers.budget import RealtimeProgress, token_budget
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


class TailcutPolicy(RunningTable):
    steers_token_budget = True
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
        # Admitted requests whose prompt the engine is still computing: id → prompt tokens.
        self._prefilling: dict[str, int] = {}
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
        budget = self.current_budget(view, now_ms)
        decision = Decision(token_budget=budget)
        slots, kv = view.free_slots, view.free_kv_tokens
        # Each step, every running request decodes one token and each prompt being prefilled takes
        # a chunk; what is left is room for new prompts.
        spent = len(self._running) + sum(map(self._chunk, self._prefilling.values()))
        while slots > 0:
            # A prompt longer than the room is admitted only into an engine with no prefill in
            # flight, so it is not starved and still leaves every step room for what comes next.
            pick = self._pick(slots, kv, budget, spent, first=not decision.admit and not self._prefilling)
            if pick is None:
                break
            self._admit(pick, now_ms)
            decision.admit.append(pick)
            slots -= 1
            kv -= pick.reserved_kv_tokens(self.config)
            spent += self._chunk(pick.prompt_tokens)
        decision.preempt = self._preemptions(slots, kv)
        for victim in decision.preempt:
            self._running.pop(victim.id, None)
            self._prefilling.pop(victim.id, None)
        return decision

    def _chunk(self, prompt_tokens: int) -> int:
        limit = self.config.prefill_chunk_tokens
        return min(prompt_tokens, limit) if limit else prompt_tokens

    def current_budget(self, view: EngineView, now_ms: int) -> int:
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

    def _fits(self, request: SchedRequest, kv: int, budget: int, spent: int, first: bool) -> bool:
        if request.reserved_kv_tokens(self.config) > kv:
            return False
        if request.tier != "realtime":
            budget -= self.config.realtime_reserve_tokens
        return first or spent + self._chunk(request.prompt_tokens) <= budget

    def _oldest_lower(self) -> SchedRequest | None:
        candidates = [*self._normal(), *(self._background if self._admit_background else ())]
        return min(candidates, key=lambda request: request.arrival_ms, default=None)

    def _pick(self, slots: int, kv: int, budget: int, spent: int, *, first: bool) -> SchedRequest | None:
        """Choose (and take out of its queue) the next request to admit, or ``None``."""
        realtime = self._realtime.peek()
        if realtime is not None:
            older = self._oldest_lower()
            jumps = older is not None and older.arrival_ms < realtime.arrival_ms
            if jumps and older is not None and self._cut_ins >= self.config.max_cut_ins:
                if self._fits(older, kv, budget, spent, first):
                    self._take(older)
                    self._cut_ins = 0
                    return older
            if not self._fits(realtime, kv, budget, spent, first):
                return None
            self._realtime.pop()
            if jumps:
                self._cut_ins = min(self._cut_ins + 1, self.config.max_cut_ins)
            return realtime
        normal = self._pick_normal()
        if normal is not None:
            if self._fits(normal, kv, budget, spent, first):
                self._cut_ins = 0
                return normal
            self._normal_by_bucket[normal.bucket].push_front(normal.tenant, normal, _cost(normal))
            return None
        background = self._background.peek() if self._admit_background else None
        if background is not None and self._fits(background, kv, budget, spent, first):
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
        self._prefilling[request.id] = request.prompt_tokens
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

    def _preemptions(self, slots: int, kv: int) -> list[SchedRequest]:
        """Running background requests to abort so waiting higher-tier heads fit."""
        blocked = list(itertools.chain(self._realtime, self._normal()))
        running_background = sorted(
            (request for request in self._running.values() if request.tier == "background"),
            key=lambda request: request.arrival_ms,
            reverse=True,  # the newest loses the least
        )
        if not blocked or not running_background:
            return []
        blocked = blocked[: len(running_background)]
        need_slots = max(0, len(blocked) - slots)
        need_kv = max(0, sum(request.reserved_kv_tokens(self.config) for request in blocked) - kv)
        victims: list[SchedRequest] = []
        for victim in running_background:
            if need_slots <= 0 and need_kv <= 0:
                break
            victims.append(victim)
            need_slots -= 1
            need_kv -= victim.reserved_kv_tokens(self.config)
        return victims
