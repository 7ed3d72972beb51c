"""Closed-loop levels of fixed-length requests, and what one level's records reduce to.

``tailcut bench overhead`` and ``tailcut bench vs-vllm`` both send every request with the same prompt and
output length (``fixed_workload``) at a fixed concurrency, and summarise each level the same way
(``LevelResult``: latencies, chunk rates, the CPU each process used).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import numpy as np

from bench import loadgen
from bench.client import TextArrival
from bench.cpu import MACHINE
from bench.stats import RequestRecord, Summary, summarize
from bench.workloads import Arrival, TierMix, Workload
from queues.keys import Tier

# `normal`: a 60 s deadline, far above any queueing a 200-stream level sees (realtime's 5 s is not).
DEFAULT_TIER: Tier = "normal"
STEADY_TRIM = 0.1  # the steady chunk rate leaves out the first and last 10% of chunks (ramp up and down)
# `httpx`: bench.client, the client of every other benchmark (parses each event, about 100 µs of CPU per
# chunk). `raw`: bench.rawclient, counts chunks on the wire (a few µs per chunk), so the server side can be
# saturated.
ClientKind = Literal["httpx", "raw"]
CLIENTS: tuple[ClientKind, ...] = ("httpx", "raw")
# How prompts are sent: token ids, which the API does not tokenize, or text, which it does (as it does a
# chat client's or `vllm bench serve`'s).
PromptKind = Literal["ids", "text"]
# The words of a text prompt: short and common, one token each in the usual vocabularies (the tiny test
# model's tokenizer splits some of them, so a text prompt's length is counted in words, not tokens).
PROMPT_WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "to", "see", "what", "was", "new")


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


def fixed_requests(workload: Workload, count: int, *, prompt: PromptKind = "ids") -> list[Arrival]:
    """``count`` requests of ``workload``; with ``prompt="text"``, each prompt is text of its
    ``prompt_tokens`` words (``prompt_text``, drawn afresh at every call)."""
    arrivals = loadgen.closed_loop_requests(workload, count, seed=0)
    if prompt == "ids":
        return arrivals
    salt = secrets.randbits(32)
    return [with_text(arrival, prompt_text(arrival.index, arrival.prompt_tokens, salt=salt)) for arrival in arrivals]


def prompt_text(index: int, num_words: int, *, salt: int) -> str:
    """``num_words`` words (at least one), the first naming the call (``salt``) and the request: no two
    prompts are alike, so neither the answer cache nor the engine's prefix cache serves one."""
    rng = np.random.default_rng([salt, index])
    words = [PROMPT_WORDS[int(pick)] for pick in rng.integers(0, len(PROMPT_WORDS), size=max(0, num_words - 1))]
    return " ".join([f"r{salt:x}q{index}", *words])


def with_text(arrival: Arrival, text: str) -> TextArrival:
    return TextArrival(**{item.name: getattr(arrival, item.name) for item in fields(Arrival)}, text=text)


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


def steady_token_rate(records: Sequence[RequestRecord], *, trim: float = STEADY_TRIM) -> float | None:
    """Output tokens per second over the same steady window as ``steady_chunk_rate``, each chunk weighing
    its request's tokens spread evenly over its chunks (a server that falls behind sends fewer chunks
    of several tokens each; tokens are what the engine produced). None with too few chunks to tell."""
    pairs = sorted(
        (at, record.output_tokens / (len(record.gaps_ms) + 1))
        for record in records
        if record.status == "ok" and record.ttft_ms is not None
        for at in chunk_times_s(record)
    )
    if len(pairs) < 3:
        return None
    times = np.array([at for at, _ in pairs])
    weights = np.cumsum([weight for _, weight in pairs])
    total = weights[-1]
    low = int(np.searchsorted(weights, total * trim))
    high = int(np.searchsorted(weights, total * (1 - trim)))
    if high <= low or times[high] <= times[low]:
        return None
    return float((weights[high] - weights[low]) / (times[high] - times[low]))


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
    # Output tokens the clients received (the usage chunks' counts, completed requests only): a chunk
    # carries several when the server coalesced them.
    num_tokens: int = 0
    tokens_per_s: float = 0.0
    steady_tokens_per_s: float | None = None  # see ``steady_token_rate``

    def cpu_share(self, name: str) -> float | None:
        """CPU of one process as a share of one core over the level."""
        return self.cpu_s[name] / self.duration_s if name in self.cpu_s and self.duration_s > 0 else None

    def cpu_us_per_chunk(self, name: str) -> float | None:
        return self.cpu_s[name] / self.num_chunks * 1e6 if name in self.cpu_s and self.num_chunks else None

    def cpu_us_per_token(self, name: str) -> float | None:
        return self.cpu_s[name] / self.num_tokens * 1e6 if name in self.cpu_s and self.num_tokens else None

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
        data["cpu_us_per_token"] = {name: self.cpu_us_per_token(name) for name in self.cpu_s}
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
    tokens = sum(record.output_tokens for record in ok if record.ttft_ms is not None)
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
        num_tokens=tokens,
        tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        steady_tokens_per_s=steady_token_rate(records),
    )


def api_bound_chunks_per_s(level: LevelResult) -> float | None:
    """The chunk rate the API would reach with a whole core to itself: 1 s ÷ its CPU per chunk."""
    per_chunk_us = level.cpu_us_per_chunk("api")
    return 1e6 / per_chunk_us if per_chunk_us else None


def api_bound_tokens_per_s(level: LevelResult) -> float | None:
    """The token rate the API would reach with a whole core to itself: 1 s ÷ its CPU per token."""
    per_token_us = level.cpu_us_per_token("api")
    return 1e6 / per_token_us if per_token_us else None
