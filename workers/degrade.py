"""Degrade, never stall: when a request's output stops flowing, the client gets a bounded summary (pure).

Every request in decode beats at each chunk. A watchdog in the worker (its own task, not the engine's
loop) checks the gap since the last beat; past its tier's limit, the worker stops full decoding and
asks the engine for a summary of the prompt and the text so far — a summarisation prompt, at most
``summary_max_tokens``, ahead of the rest of its tier — streamed as the rest of the same response and
marked ``degraded`` (the event, and the final chunk's ``tailcut`` object). A continuation waiting to
resume counts its wait since its last output the same way.

Defaults: realtime and normal requests degrade after 500 ms without output (a chat user and a reader
of a document both watch the text appear); background requests never do (no one watches them, and
their answer is the point). A request degrades only while its summary would be shorter than what it
still has to generate, and only once the engine had produced a token of the current call (so a long
prefill is not taken for a stall).
"""

from __future__ import annotations

from dataclasses import dataclass

from queues.keys import Tier

SUMMARY_SYSTEM_PROMPT = (
    "You finish interrupted answers. The reader has already seen the beginning of the answer below; "
    "complete it with a short summary of what remains, in a few sentences, without repeating it."
)


@dataclass(frozen=True, slots=True)
class DegradeConfig:
    # Longest gap between two chunks of a request in decode before it degrades to a summary (0: never).
    realtime_heartbeat_ms: int = 500
    normal_heartbeat_ms: int = 500
    background_heartbeat_ms: int = 0
    summary_max_tokens: int = 64
    # How often the watchdog looks.
    watch_interval_ms: int = 50
    # Most characters of the prompt and of the answer so far that the summarisation prompt quotes
    # (their ends: the question is usually last, and the text so far leads into the summary).
    quote_chars: int = 4000

    def heartbeat_ms(self, tier: Tier) -> int:
        limits: dict[Tier, int] = {
            "realtime": self.realtime_heartbeat_ms,
            "normal": self.normal_heartbeat_ms,
            "background": self.background_heartbeat_ms,
        }
        return limits[tier]

    def is_late(self, tier: Tier, gap_ms: float, remaining_tokens: int) -> bool:
        """Whether a request in decode, silent for ``gap_ms`` with ``remaining_tokens`` still to make,
        should finish with a summary instead."""
        limit = self.heartbeat_ms(tier)
        return limit > 0 and gap_ms > limit and remaining_tokens > self.summary_max_tokens


def summary_messages(prompt_text: str, answer_so_far: str, *, quote_chars: int) -> list[dict[str, str]]:
    """The chat messages that ask for the summary."""
    user = (
        f"Request:\n{prompt_text[-quote_chars:]}\n\nAnswer so far:\n{answer_so_far[-quote_chars:]}\n\n"
        "Finish the answer briefly."
    )
    return [{"role": "system", "content": SUMMARY_SYSTEM_PROMPT}, {"role": "user", "content": user}]
