"""Output events rendered as OpenAI chat or text completion objects (chunks and whole bodies)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from queues.messages import OutputEvent
from queues.requests import RequestRecord

# Stands in for a chunk's text while the content template is made: no model's text contains it.
TEMPLATE_TEXT = "\x00tailcut-text\x00"


class Renderer:
    """Shapes one request's output; subclasses pick chat or text completion."""

    object_chunk = ""
    object_whole = ""
    id_prefix = ""

    def __init__(self, request_id: str, model: str, *, return_token_ids: bool, include_usage: bool) -> None:
        self.id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        # Added to the final chunk's (or the whole body's) ``tailcut`` object: ``{"cache": "hit"}``.
        self.marker: dict[str, Any] | None = None
        self._content_template: tuple[bytes, bytes] | None = None

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object_chunk,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> dict[str, Any] | None:
        return None

    def content(self, event: OutputEvent) -> dict[str, Any]:
        raise NotImplementedError

    def content_json(self, event: OutputEvent) -> bytes:
        """``orjson.dumps(self.content(event))``, the same bytes, from a template made once per request:
        a content chunk differs from the next only in its text (with token ids asked for, the chunk is
        built as a dict each time)."""
        if self.return_token_ids:
            return orjson.dumps(self.content(event))
        if self._content_template is None:
            probe = orjson.dumps(self.content(OutputEvent(rid="", seq=0, type="chunk", text=TEMPLATE_TEXT)))
            head, _, tail = probe.partition(orjson.dumps(TEMPLATE_TEXT))
            self._content_template = head, tail
        head, tail = self._content_template
        return head + orjson.dumps(event.text) + tail

    def finish(self, event: OutputEvent) -> dict[str, Any]:
        """The final chunk; a degraded reply says so in its ``tailcut`` object."""
        chunk = self._chunk(self.empty_choice(event.finish_reason))
        if event.degraded or self.marker:
            chunk["tailcut"] = {**(event.degraded or {}), **(self.marker or {})}
        return chunk

    def notice(self, event: OutputEvent) -> dict[str, Any]:
        """A ``degraded`` event: an empty chunk whose ``tailcut`` object says what follows and why."""
        return {**self._chunk(self.empty_choice(None)), "tailcut": event.degraded}

    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, event: OutputEvent) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object_chunk,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(event),
        }

    def whole_choice(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, text: str, token_ids: list[int], final: OutputEvent) -> dict[str, Any]:
        """The whole response of a non-streaming request."""
        choice = {**self.whole_choice(text), "finish_reason": final.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = {
            "id": self.id,
            "object": self.object_whole,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(final),
        }
        if final.degraded or self.marker:
            body["tailcut"] = {**(final.degraded or {}), **(self.marker or {})}
        return body


def usage(event: OutputEvent) -> dict[str, int]:
    prompt = event.prompt_tokens or 0
    completion = event.completion_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ChatRenderer(Renderer):
    object_chunk = "chat.completion.chunk"
    object_whole = "chat.completion"
    id_prefix = "chatcmpl-"

    def opening(self) -> dict[str, Any]:
        return self._chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def content(self, event: OutputEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": event.text},
            "logprobs": None,
            "finish_reason": None,
        }
        if self.return_token_ids:
            choice["token_ids"] = event.token_ids
        return self._chunk(choice)

    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}

    def whole_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}


class CompletionRenderer(Renderer):
    object_chunk = "text_completion"
    object_whole = "text_completion"
    id_prefix = "cmpl-"

    def content(self, event: OutputEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": None}
        if self.return_token_ids:
            choice["token_ids"] = event.token_ids
        return self._chunk(choice)

    def empty_choice(self, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}

    def whole_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None}


def renderer_for(record: RequestRecord) -> Renderer:
    """The renderer of a request as its record describes it (the route it came by, its options)."""
    kind: type[Renderer] = ChatRenderer if record.route == "chat" else CompletionRenderer
    return kind(record.id, record.model, return_token_ids=record.return_token_ids, include_usage=record.include_usage)
