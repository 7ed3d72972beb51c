"""One request's run on a worker as a pure state machine: deltas in; emit, continue, yield or finish out.

The live worker (``workers.worker``) and the simulator (``bench.simrun``) drive this same object — the
worker with an engine's streamed deltas, the simulator with its virtual-clock steps — so a figure from
the simulator is worth exactly this sameness. It owns the output positions (``seq``), the tokens
generated so far, the slice index and the engine request id; the driver owns the I/O (writing the
events, re-queueing, acknowledging) and the engine calls.

Engine request ids are ``{request id}-{attempt}-{slice}``: the slice index counts every engine call of
the request, continuations included (a continuation carries the next unused index), and the attempt
counts take-overs by other workers, so no engine ever sees one id twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from queues.messages import OutputEvent, RequestMessage, SamplingSpec
from workers.reservation import ReservationRecord
from workers.scheduling import EngineView, SchedRequest, SchedulingPolicy


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One engine request: the original prompt plus every token generated so far, at most one slice."""

    engine_request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: int


@dataclass(frozen=True, slots=True)
class Finished:
    """Emit ``event`` (the final one); the request is done."""

    event: OutputEvent


@dataclass(frozen=True, slots=True)
class Continue:
    """Run ``call`` next, at once."""

    call: EngineCall


@dataclass(frozen=True, slots=True)
class Yield:
    """Hand ``message`` (a continuation) back to the intake stream; this run is over."""

    message: RequestMessage


CallOutcome = Finished | Continue | Yield


class RequestLifecycle:
    def __init__(
        self,
        message: RequestMessage,
        request: SchedRequest,
        scheduler: SchedulingPolicy,
        *,
        reservations: ReservationRecord | None = None,
    ) -> None:
        """``reservations``: where each ended engine call's KV reservation is judged against its
        output (``workers.reservation``); None: not recorded."""
        self.message = message
        self.request = request
        self._scheduler = scheduler
        self._reservations = reservations
        self.seq = message.next_seq  # position of the next event
        self.generated = list(message.generated_token_ids)
        self.slice_index = message.slice_index  # of the next engine call
        self.call_tokens = 0  # tokens the current engine call produced so far
        self.num_calls = 0
        # Set once the request degrades: what the client is told (``workers.degrade``, the breakers).
        self.degraded: dict[str, str | int] | None = None
        self.summarising = False
        self.max_tokens = message.sampling.max_tokens  # lowered by ``cap``
        # Stop strings are found here, across engine calls (``_stop_strings``), not by the engine.
        self._hold_chars = max((len(stop) for stop in message.sampling.stop), default=1) - 1
        self.held_text = message.held_text  # the reply's last characters not sent yet
        self.stopped_here = False  # a stop string ended the reply here: the caller ends the call ("stop")

    @property
    def id(self) -> str:
        return self.message.id

    @property
    def started(self) -> bool:
        """Some output already reached the client (a continuation, or a run taken over)."""
        return bool(self.generated) or self.seq > 1

    def expired(self, now_ms: int) -> bool:
        """Deadlines mean "start by": a request that has started is never expired."""
        return not self.started and now_ms > self.message.deadline_ms

    def error(self, code: str, text: str) -> OutputEvent:
        """The request's one terminal error, at the next position."""
        return error_event(self.id, self.seq, code, text)

    def next_call(self) -> EngineCall:
        limit = self._scheduler.slice_limit(self.request)
        min_tokens = self.message.sampling.min_tokens - len(self.generated)
        call = EngineCall(
            engine_request_id=f"{self.id}-{self.message.attempt}-{self.slice_index}",
            prompt_token_ids=self.message.prompt_token_ids + self.generated,
            sampling=replace(
                self.message.sampling, max_tokens=limit, min_tokens=max(0, min(min_tokens, limit)), stop=[]
            ),
            priority=self._scheduler.engine_priority(self.request),
        )
        self.slice_index += 1
        self.call_tokens = 0
        self.num_calls += 1
        return call

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - len(self.generated)

    def release_held(self) -> OutputEvent | None:
        """The text held back in case it began a stop string, as a chunk of its own, when the reply goes
        on as something no stop string is searched in (a summary); None when nothing is held."""
        if not self.held_text:
            return None
        event = OutputEvent(rid=self.id, seq=self.seq, type="chunk", text=self.held_text)
        self.held_text = ""
        self.seq += 1
        return event

    def degrade(self, *, reason: str, gap_ms: int) -> OutputEvent:
        """Stop full decoding: the ``degraded`` event to emit before the summary (``summary_call``)."""
        self.summarising = True
        return self._notice({"degraded": "summary", "reason": reason, "gap_ms": gap_ms})

    def cap(self, max_tokens: int, *, reason: str) -> OutputEvent | None:
        """Make the reply at most ``max_tokens`` longer than it is (degrade mode); the ``degraded``
        event to emit first, or None when it is not that long anyway."""
        if self.remaining_tokens <= max_tokens:
            return None
        self.max_tokens = len(self.generated) + max_tokens
        self.request.remaining_tokens = min(self.request.remaining_tokens, max_tokens)
        return self._notice({"degraded": "capped", "reason": reason, "max_tokens": max_tokens})

    def _notice(self, degraded: dict[str, str | int]) -> OutputEvent:
        self.degraded = degraded
        event = OutputEvent(rid=self.id, seq=self.seq, type="degraded", degraded=degraded)
        self.seq += 1
        return event

    def summary_call(self, prompt_ids: list[int], *, max_tokens: int) -> EngineCall:
        """The engine call of the summary: greedy, bounded, ahead of the rest of the request's tier."""
        call = EngineCall(
            engine_request_id=f"{self.id}-{self.message.attempt}-{self.slice_index}-summary",
            prompt_token_ids=prompt_ids,
            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0),
            priority=self._scheduler.summary_priority(self.request),
        )
        self.slice_index += 1
        self.call_tokens = 0
        self.num_calls += 1
        return call

    def on_output(
        self,
        token_ids: list[int],
        text: str,
        *,
        event: bool = True,
        unsent: OutputEvent | None = None,
        finish_reason: str | None = None,
    ) -> OutputEvent | None:
        """New output of the current call; the chunk event to emit, if there is anything to say.
        ``event=False``: advance the same, without building the event (the simulator sends nothing).
        ``unsent``: this request's newest chunk, still waiting to be written (``OutputWriter.unsent_chunk``):
        the output joins it, at its position, and there is nothing new to emit. ``finish_reason``: the
        engine's, when this is the call's last output. Afterwards ``stopped_here`` says whether a stop
        string across calls ended the reply (the caller ends the call: its finish reason is "stop")."""
        if not token_ids and not text and not (finish_reason and self.held_text):
            return None
        if self.message.sampling.stop and not self.summarising:
            text = self._stop_strings(text, len(token_ids), finish_reason)
        if not self.call_tokens:
            # Its prompt no longer takes budget: the next round may admit more.
            self._scheduler.prefilled(self.id)
        self.generated += token_ids
        self.call_tokens += len(token_ids)
        if unsent is not None and unsent.rid == self.id and unsent.seq == self.seq - 1 and unsent.type == "chunk":
            unsent.token_ids += token_ids
            unsent.text += text
            unsent.held = self.held_text
            return None
        seq = self.seq
        self.seq += 1
        if not event:
            return None
        return OutputEvent(rid=self.id, seq=seq, type="chunk", text=text, token_ids=token_ids, held=self.held_text)

    def _stop_strings(self, text: str, num_tokens: int, finish_reason: str | None) -> str:
        """The text to send of the current call's new ``text``: the request's stop strings are found
        here, not by the engine (``next_call`` leaves them out of the engine call).

        The engine would find them within one call only: it reads the earlier calls' tokens as prompt,
        so a stop string that began in one call's last characters and ended in the next call's was not
        its to find, and the characters it holds back in case they begin one were lost when a call was
        aborted (a preemption, a stop). So the last ``longest stop − 1`` characters are held here
        (``held_text``, which a continuation and the written chunks carry on) until the text after them
        shows no stop string begins there; a stop string ends the reply where it begins (it is not
        sent, as vLLM's are not), and only past ``min_tokens``, as vLLM does."""
        pending = self.held_text + text
        if len(self.generated) + num_tokens > self.message.sampling.min_tokens:
            starts = [pending.find(stop) for stop in self.message.sampling.stop]
            cut = min((start for start in starts if start >= 0), default=None)
            if cut is not None:
                self.held_text, self.stopped_here = "", True
                return pending[:cut]
        goes_on = finish_reason == "length" and len(self.generated) + num_tokens < self.max_tokens
        if finish_reason is not None and not goes_on:  # the reply ends with this output: nothing to hold
            self.held_text = ""
            return pending
        keep = min(len(pending), self._hold_chars)
        self.held_text = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def end_call(self, finish_reason: str | None, view: Callable[[], EngineView]) -> CallOutcome:
        """The current call ended (``finish_reason`` as the engine said): finish, go on, or yield. A
        summary always finishes the request."""
        if self._reservations is not None and not self.summarising:
            # Before ``advance``: the request still reads as the scheduler counted it for this call.
            config = self._scheduler.config
            reserved = self.request.reserved_output_tokens(config)
            self._reservations.observe(reserved, self.call_tokens, config.kv_block_tokens)
        self._scheduler.advance(self.id, self.call_tokens)
        if self.summarising or finish_reason != "length" or len(self.generated) >= self.max_tokens:
            return Finished(
                OutputEvent(
                    rid=self.id,
                    seq=self.seq,
                    type="final",
                    finish_reason=finish_reason or "stop",
                    prompt_tokens=len(self.message.prompt_token_ids),
                    completion_tokens=len(self.generated),
                    degraded=self.degraded,
                )
            )
        if self._scheduler.at_slice_boundary(self.id, view()):
            return Yield(self.continuation())
        return Continue(self.next_call())

    def continuation(self) -> RequestMessage:
        """The message that resumes this request after the output so far (a yield, a preemption).

        The original arrival time travels on, so a continuation keeps its place in the tier order, and
        the client sees one stream: positions continue at ``seq``, the prompt grows by the tokens it
        already has, and ``max_tokens`` still counts from the original request.
        """
        return replace(
            self.message,
            generated_token_ids=list(self.generated),
            next_seq=self.seq,
            slice_index=self.slice_index,
            held_text=self.held_text,
        )


def error_event(request_id: str, seq: int, code: str, text: str) -> OutputEvent:
    return OutputEvent(rid=request_id, seq=seq, type="error", error_code=code, error_message=text)


def resumed(message: RequestMessage, written: list[OutputEvent]) -> RequestMessage:
    """``message`` taken over from a dead worker: it resumes where its durable output stops (the
    prompt plus every token the client already has), as a new attempt."""
    chunks = [event for event in written if event.type == "chunk"]
    written_tokens = [token for event in chunks for token in event.token_ids]
    return replace(
        message,
        generated_token_ids=written_tokens or message.generated_token_ids,
        next_seq=written[-1].seq + 1 if written else message.next_seq,
        attempt=message.attempt + 1,
        held_text=chunks[-1].held if chunks else message.held_text,
    )
