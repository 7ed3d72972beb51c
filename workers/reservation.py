"""How the scheduler's KV reservations fared against what the engine calls produced (pure).

At admission the scheduler counts room for each request's next engine call
(``SchedRequest.reserved_output_tokens``, per ``SchedulerConfig.kv_reservation``); when the call
ends, the driver (the live worker, the simulator) tells a ``ReservationRecord`` how much that was and
how many tokens the call produced. A call was

- **short** when it produced more than was reserved: the scheduler counted less KV than the request
  took, so it may have admitted more than the engine holds (the engine then preempts);
- **wasteful** when at least one whole KV block of the reservation stayed unused: the scheduler kept
  that room from other requests for nothing;
- **exact** otherwise (the output ended in the reservation's last block).

Under ``none`` the reservation is the room left in the prompt's last partial block, so every call that
produced more than that is short. Calls that never ended (aborted, preempted by the scheduler) are not
counted, nor are degraded requests' summaries (their prompt is not the request's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReservationVerdict = Literal["short", "wasteful", "exact"]
VERDICTS: tuple[ReservationVerdict, ...] = ("short", "wasteful", "exact")


def verdict(reserved_tokens: int, produced_tokens: int, block_size: int) -> ReservationVerdict:
    """How one call's reservation of ``reserved_tokens`` output slots fared when it produced
    ``produced_tokens``, KV being allocated in blocks of ``block_size`` tokens."""
    if produced_tokens > reserved_tokens:
        return "short"
    if reserved_tokens - produced_tokens >= block_size:
        return "wasteful"
    return "exact"


@dataclass(slots=True)
class ReservationRecord:
    """Counts over the engine calls that ended: verdicts and token totals (see the module docstring)."""

    num_calls: int = 0
    num_short: int = 0
    num_wasteful: int = 0
    reserved_tokens: int = 0  # output slots reserved, over every call
    produced_tokens: int = 0  # tokens the calls produced
    unused_tokens: int = 0  # reserved and not produced (the calls that produced less)
    overrun_tokens: int = 0  # produced beyond the reservation (the short calls)

    def observe(self, reserved_tokens: int, produced_tokens: int, block_size: int) -> ReservationVerdict:
        """One engine call ended: it had ``reserved_tokens`` of output reserved, produced
        ``produced_tokens``, in an engine with KV blocks of ``block_size`` tokens."""
        outcome = verdict(reserved_tokens, produced_tokens, block_size)
        self.num_calls += 1
        self.num_short += outcome == "short"
        self.num_wasteful += outcome == "wasteful"
        self.reserved_tokens += reserved_tokens
        self.produced_tokens += produced_tokens
        self.unused_tokens += max(0, reserved_tokens - produced_tokens)
        self.overrun_tokens += max(0, produced_tokens - reserved_tokens)
        return outcome

    @property
    def num_exact(self) -> int:
        return self.num_calls - self.num_short - self.num_wasteful

    def count(self, outcome: ReservationVerdict) -> int:
        return {"short": self.num_short, "wasteful": self.num_wasteful, "exact": self.num_exact}[outcome]

    def share(self, outcome: ReservationVerdict) -> float:
        """Share of the calls with this verdict (0 before any call)."""
        return self.count(outcome) / self.num_calls if self.num_calls else 0.0

    @property
    def unused_tokens_per_call(self) -> float:
        return self.unused_tokens / self.num_calls if self.num_calls else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.num_calls,
            "short": self.num_short,
            "wasteful": self.num_wasteful,
            "exact": self.num_exact,
            "short_share": self.share("short"),
            "wasteful_share": self.share("wasteful"),
            "reserved_tokens": self.reserved_tokens,
            "produced_tokens": self.produced_tokens,
            "unused_tokens": self.unused_tokens,
            "overrun_tokens": self.overrun_tokens,
            "unused_tokens_per_call": self.unused_tokens_per_call,
        }
