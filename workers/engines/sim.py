"""SIMULATOR of an inference engine: continuous batching on a virtual clock (pure, no model runs).

``SimEngine`` is not an inference engine. It reproduces the scheduling mechanics of vLLM v1 — the
per-step token budget, chunked prefill, paged KV blocks, recompute preemption, prefix caching — and
charges each step the time a published cost model gives it (``workers.engines.costmodel``). The
caller drives it: ``add`` / ``abort`` requests, ``step()`` once per engine iteration, ``idle_until``
to move the clock over idle time. No asyncio, no wall clock, no randomness: the same calls give the
same step sequence, in any process.

One ``step()`` (vLLM v1's ``schedule()`` followed by ``update_from_output()``):

1. Running requests, in admission order, each take ``min(tokens it still lacks, budget left)``
   tokens: one decode token, or the next chunk of a prefill that the budget cut short. With
   ``long_prefill_token_threshold`` set (and more than one request in the engine), a prefill chunk
   is at most that many tokens, so a long prompt is spread over steps and leaves room for others.
   A request whose KV does not fit (paged mode) preempts the last running request (``fcfs``) or the
   one with the largest ``(priority, arrival)`` (``priority``), itself included, as vLLM does; the
   victim frees its blocks and goes back to waiting to be recomputed later.
2. If nothing was preempted, waiting requests are admitted in queue order while the budget, free KV
   blocks and ``max_num_seqs`` allow (their first chunk capped the same way); the queue head that
   does not fit stops admission (no skipping).
   Waiting requests never preempt running ones, whatever their priority (vLLM v1 neither). A
   prompt's leading full blocks found in the prefix cache are not computed again; a preempted
   request's recompute (prompt and output so far) counts as prefill.
3. The step takes exactly ``cost.step_us(P, D)``: P = prefill tokens computed (prefix-cache hits
   excluded), D = requests that decoded one token. A request whose prompt is complete samples a token
   (a synthetic id); one that reaches ``max_tokens`` finishes and frees its blocks.

KV allocation: ``paged`` allocates ``block_size``-token blocks as a request's KV grows; ``static``
reserves blocks for ``prompt + max_tokens`` at admission (the "fixed-ratio allocation" baseline),
so it never preempts but admits fewer requests. The prefix cache works as vLLM's: a full block of
computed KV is keyed by the hash of its token ids chained to the previous block's key; the blocks of
finished, aborted and preempted requests stay in an LRU free queue (a request's tail blocks are
evicted first) and are reused until a new allocation evicts them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, get_args

from workers.engines.costmodel import CostModel
from workers.engines.kvblocks import BlockPool

KvAllocation = Literal["paged", "static"]
SimPolicy = Literal["fcfs", "priority"]
_State = Literal["waiting", "running", "done"]

# Synthetic token ids (count-only prompts, generated tokens) start far above any real vocabulary.
SYNTHETIC_TOKEN_BASE = 1 << 40
# Parent key of a request's first block. Keys hash ints and tuples of ints only: Python salts the
# hashes of str and bytes per process, never those of ints, so the keys are the same in every run.
_ROOT_BLOCK_KEY = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one simulated step did. KV figures are taken after the step computed its tokens and before
    the requests it finished released their blocks."""

    start_us: float
    duration_us: float
    num_prefill_tokens: int
    num_decode_seqs: int
    # Tokens computed per request in this step (a prefill chunk, or 1 for a decode), in schedule order.
    scheduled_tokens: dict[str, int]
    # Request id → the token it sampled in this step (after its last prefill chunk, or a decode).
    new_token_ids: dict[str, int]
    finished: list[str]
    preempted: list[str]
    # Request id → prompt tokens served from the prefix cache, for the requests admitted in this step.
    num_cached_tokens: dict[str, int]
    kv_used_blocks: int
    kv_total_blocks: int
    # Tokens of KV held in the used blocks.
    kv_filled_tokens: int
    block_size: int

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us

    @property
    def idle(self) -> bool:
        """Nothing ran (no requests, or every candidate was preempted); the step took no time."""
        return not self.scheduled_tokens

    @property
    def kv_usage(self) -> float:
        """Share of KV blocks held by running requests (vLLM's ``kv_cache_usage``)."""
        return self.kv_used_blocks / self.kv_total_blocks

    @property
    def kv_reserved_unused_share(self) -> float:
        """Share of the token slots in used blocks that hold no KV: partial tail blocks when paged,
        plus the output reserved but not yet generated when static."""
        slots = self.kv_used_blocks * self.block_size
        return 1.0 - self.kv_filled_tokens / slots if slots else 0.0


@dataclass(slots=True, eq=False)
class _SimRequest:
    id: str
    token_ids: list[int]  # prompt, then the tokens generated so far
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    arrival: int  # order of ``add`` calls
    stop_after: int | None = None  # tokens after which it ends (an end-of-sequence), below max_tokens
    state: _State = "waiting"
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full blocks
    num_registered_blocks: int = 0
    decoding: bool = False  # sampled a token and has run since: its next token is a decode

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def keys_of_full_blocks(self, num_blocks: int, block_size: int) -> list[int]:
        """Keys of the first ``num_blocks`` blocks, computed once each."""
        for index in range(len(self.block_keys), num_blocks):
            parent = self.block_keys[-1] if self.block_keys else _ROOT_BLOCK_KEY
            tokens = tuple(self.token_ids[index * block_size : (index + 1) * block_size])
            self.block_keys.append(hash((parent, tokens)))
        return self.block_keys[:num_blocks]


class _WaitQueue:
    """Waiting requests: arrival order with preempted ones in front (``fcfs``), or by
    ``(priority, arrival)`` (``priority``). Aborted requests are dropped lazily."""

    def __init__(self, policy: SimPolicy) -> None:
        self._policy = policy
        self._fifo: deque[_SimRequest] = deque()
        self._heap: list[tuple[int, int, _SimRequest]] = []

    def push(self, request: _SimRequest, *, front: bool = False) -> None:
        if self._policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival, request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> _SimRequest | None:
        if self._policy == "priority":
            while self._heap and self._heap[0][2].state != "waiting":
                heapq.heappop(self._heap)
            return self._heap[0][2] if self._heap else None
        while self._fifo and self._fifo[0].state != "waiting":
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> _SimRequest:
        head = self.peek()
        if head is None:
            raise IndexError("no waiting request")
        if self._policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        return head


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class SimEngine:
    """SIMULATOR of a continuous-batching engine on a virtual clock (see the module docstring)."""

    def __init__(
        self,
        cost: CostModel,
        *,
        kv_capacity_tokens: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        kv_allocation: KvAllocation = "paged",
        prefix_cache: bool = True,
        policy: SimPolicy = "fcfs",
        output_token_id: int | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """``output_token_id``: the id of every generated token (a real vocabulary id when the
        caller feeds outputs back as prompt tokens, as a live worker's continuations do, so their
        KV blocks hit the prefix cache); default a fresh synthetic id per token."""
        if block_size < 1 or max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be at least 1")
        if kv_allocation not in get_args(KvAllocation) or policy not in get_args(SimPolicy):
            raise ValueError(
                f"kv_allocation must be one of {get_args(KvAllocation)} and policy one of {get_args(SimPolicy)}"
            )
        if kv_capacity_tokens < block_size:
            raise ValueError(f"kv_capacity_tokens={kv_capacity_tokens} holds no block of {block_size} tokens")
        self.cost = cost
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_allocation: KvAllocation = kv_allocation
        self.prefix_cache = prefix_cache
        self.policy: SimPolicy = policy
        # vLLM's ``long_prefill_token_threshold``: at most this many prefill tokens per request and
        # step while others are in the engine (0: no cap), so one long prompt cannot take a whole step.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self._pool = BlockPool(kv_capacity_tokens // block_size, block_size)
        self._requests: dict[str, _SimRequest] = {}
        self._waiting = _WaitQueue(policy)
        self._num_waiting = 0
        self._running: list[_SimRequest] = []
        self._token_budget = max_num_batched_tokens
        self._now_us = 0.0
        self._arrivals = itertools.count()
        self._synthetic_ids = itertools.count(SYNTHETIC_TOKEN_BASE)
        self._output_token_id = output_token_id

    def __repr__(self) -> str:
        return (
            f"SimEngine(SIMULATOR, cost={self.cost.name}, kv_blocks={self.num_kv_blocks}x{self.block_size}, "
            f"kv_allocation={self.kv_allocation}, prefix_cache={self.prefix_cache}, policy={self.policy}, "
            f"token_budget={self._token_budget}, now_us={self._now_us})"
        )

    # --- state -------------------------------------------------------------------------------------

    @property
    def now_us(self) -> float:
        """The virtual clock: the sum of all step durations and idle jumps so far."""
        return self._now_us

    @property
    def num_kv_blocks(self) -> int:
        return len(self._pool.blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- requests ----------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: list[int] | int,
        max_tokens: int,
        *,
        priority: int = 0,
        stop_after: int | None = None,
    ) -> None:
        """Queue a request. ``prompt`` is its token ids, or a token count (then it gets unique synthetic
        ids, so it shares no prefix with anything). Lower ``priority`` runs first under ``priority``.
        ``stop_after``: the request ends after this many tokens, as at an end-of-sequence token, while
        ``max_tokens`` stays the cap a static reservation must hold."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        token_ids = [next(self._synthetic_ids) for _ in range(prompt)] if isinstance(prompt, int) else list(prompt)
        if not token_ids or max_tokens < 1:
            raise ValueError(f"request {request_id!r} needs at least one prompt token and max_tokens >= 1")
        num_blocks = _ceil_div(len(token_ids) + max_tokens, self.block_size)
        if num_blocks > self.num_kv_blocks:
            raise ValueError(
                f"request {request_id!r} needs {num_blocks} KV blocks, the cache has {self.num_kv_blocks}: "
                "shorten it or raise kv_capacity_tokens"
            )
        request = _SimRequest(request_id, token_ids, len(token_ids), max_tokens, priority, next(self._arrivals))
        if stop_after is not None:
            request.stop_after = max(1, min(stop_after, max_tokens))
        self._requests[request_id] = request
        self._waiting.push(request)
        self._num_waiting += 1

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; its computed blocks stay in the prefix cache.
        ``False`` if the engine does not hold it."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.state == "running":
            self._running.remove(request)
            self._pool.free(request.block_ids)
            request.block_ids = []
        else:
            self._num_waiting -= 1
        request.state = "done"
        return True

    def set_token_budget(self, num_tokens: int) -> int:
        """Cap prefill tokens plus decode sequences per step, between 1 and ``max_num_batched_tokens``;
        returns the value in force."""
        self._token_budget = max(1, min(num_tokens, self.max_num_batched_tokens))
        return self._token_budget

    def set_prefill_chunk(self, num_tokens: int) -> int:
        """Set ``long_prefill_token_threshold`` (0: no cap) from the next step on, as the tailcut
        vLLM plugin sets vLLM's; returns the value in force."""
        self.long_prefill_token_threshold = max(0, num_tokens)
        return self.long_prefill_token_threshold

    def idle_until(self, t_us: float) -> float:
        """Move the clock forward to ``t_us`` over a stretch where the engine holds nothing."""
        if self._requests:
            raise RuntimeError(f"{len(self._requests)} unfinished requests: call step(), not idle_until()")
        self._now_us = max(self._now_us, t_us)
        return self._now_us

    # --- one step ----------------------------------------------------------------------------------

    def step(self) -> StepResult:
        start_us = self._now_us
        budget = self._token_budget
        # The cap applies only while the request has company (vLLM: nobody to starve otherwise).
        cap = self.long_prefill_token_threshold if len(self._requests) > 1 else 0
        scheduled: dict[str, tuple[_SimRequest, int]] = {}
        preempted: list[str] = []
        num_cached: dict[str, int] = {}

        for request in list(self._running):
            if budget <= 0:
                break
            if request.state != "running":  # preempted earlier in this step
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if 0 < cap < num_new:
                num_new = cap
            while not self._grow(request, num_new):
                victim = self._victim()
                undone = scheduled.pop(victim.id, None)
                if undone is not None:
                    budget += undone[1]
                self._preempt(victim)
                preempted.append(victim.id)
                if victim is request:
                    break
            if request.state != "running":
                break  # it preempted itself: nothing left to make room with (vLLM stops here too)
            scheduled[request.id] = (request, num_new)
            budget -= num_new

        while not preempted and budget > 0 and len(self._running) < self.max_num_seqs:
            admitted = self._admit_head(min(budget, cap) if cap > 0 else budget)
            if admitted is None:
                break
            request, num_new, num_hit = admitted
            scheduled[request.id] = (request, num_new)
            num_cached[request.id] = num_hit
            budget -= num_new

        num_prefill = sum(num_new for request, num_new in scheduled.values() if not request.decoding)
        num_decode = sum(1 for request, _ in scheduled.values() if request.decoding)
        duration_us = self.cost.step_us(num_prefill, num_decode) if scheduled else 0.0
        for request, num_new in scheduled.values():
            self._compute(request, num_new)
        kv_used, kv_filled = self._pool.num_used, self._pool.num_filled_tokens

        new_token_ids: dict[str, int] = {}
        finished: list[str] = []
        for request, _ in scheduled.values():
            if request.num_computed_tokens < request.num_tokens:
                continue  # mid-prefill: no token yet
            token_id = next(self._synthetic_ids) if self._output_token_id is None else self._output_token_id
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
            request.decoding = True
            new_token_ids[request.id] = token_id
            if request.num_output_tokens >= (request.stop_after or request.max_tokens):
                finished.append(request.id)
                self.abort(request.id)

        self._now_us = start_us + duration_us
        return StepResult(
            start_us=start_us,
            duration_us=duration_us,
            num_prefill_tokens=num_prefill,
            num_decode_seqs=num_decode,
            scheduled_tokens={request_id: num_new for request_id, (_, num_new) in scheduled.items()},
            new_token_ids=new_token_ids,
            finished=finished,
            preempted=preempted,
            num_cached_tokens=num_cached,
            kv_used_blocks=kv_used,
            kv_total_blocks=self.num_kv_blocks,
            kv_filled_tokens=kv_filled,
            block_size=self.block_size,
        )

    # --- internals ---------------------------------------------------------------------------------

    def _target_slots(self, request: _SimRequest, num_computed_after: int) -> int:
        """KV token slots the request must hold once this step's tokens are computed."""
        if self.kv_allocation == "static":
            return max(num_computed_after, request.num_prompt_tokens + request.max_tokens)
        return num_computed_after

    def _grow(self, request: _SimRequest, num_new: int) -> bool:
        """Allocate the blocks a running request needs for ``num_new`` more tokens, if they are free
        (a static reservation already holds them all)."""
        num_missing = request.num_computed_tokens + num_new - len(request.block_ids) * self.block_size
        if num_missing <= 0:
            return True
        num_needed = _ceil_div(num_missing, self.block_size)
        if num_needed > self._pool.num_free:
            return False
        request.block_ids += self._pool.allocate(num_needed)
        return True

    def _victim(self) -> _SimRequest:
        if self.policy == "priority":
            return max(self._running, key=lambda request: (request.priority, request.arrival))
        return self._running[-1]

    def _preempt(self, request: _SimRequest) -> None:
        """Back to waiting, KV freed into the prefix cache; it recomputes prompt and output later."""
        self._running.remove(request)
        self._pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.decoding = False
        request.state = "waiting"
        self._waiting.push(request, front=True)
        self._num_waiting += 1

    def _admit_head(self, budget: int) -> tuple[_SimRequest, int, int] | None:
        """Admit the head of the waiting queue if its first chunk's KV fits: (request, tokens to
        compute now, tokens served from the prefix cache)."""
        request = self._waiting.peek()
        if request is None:
            return None
        hits: list[int] = []
        if self.prefix_cache:
            # At least the last token is computed: its forward pass samples the next token.
            num_hittable = (request.num_tokens - 1) // self.block_size
            hits = self._pool.lookup(request.keys_of_full_blocks(num_hittable, self.block_size))
        num_hit = len(hits) * self.block_size
        num_new = min(request.num_tokens - num_hit, budget)
        num_needed = _ceil_div(self._target_slots(request, num_hit + num_new), self.block_size) - len(hits)
        if num_needed + self._pool.num_evictable(hits) > self._pool.num_free:
            return None
        self._waiting.pop()
        self._num_waiting -= 1
        self._pool.touch(hits)
        request.block_ids = hits + self._pool.allocate(num_needed)
        request.num_computed_tokens = num_hit
        request.num_registered_blocks = len(hits)
        request.state = "running"
        self._running.append(request)
        return request, num_new, num_hit

    def _compute(self, request: _SimRequest, num_new: int) -> None:
        """Write ``num_new`` tokens of KV and register the blocks they complete in the prefix cache."""
        start = request.num_computed_tokens
        end = start + num_new
        if num_new == 1:  # a decode, most of every step: one slot of the last block
            index = start // self.block_size
            self._pool.fill(request.block_ids[index], end - index * self.block_size)
        else:
            for index in range(start // self.block_size, _ceil_div(end, self.block_size)):
                self._pool.fill(request.block_ids[index], min(self.block_size, end - index * self.block_size))
        request.num_computed_tokens = end
        num_full = end // self.block_size
        if self.prefix_cache and num_full > request.num_registered_blocks:
            keys = request.keys_of_full_blocks(num_full, self.block_size)
            for index in range(request.num_registered_blocks, num_full):
                self._pool.register(request.block_ids[index], keys[index])
            request.num_registered_blocks = num_full
