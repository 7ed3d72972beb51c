"""Admission: turn a validated OpenAI body into a ``RequestMessage`` (tier, tokens, bucket, deadline).

Everything a client can get wrong is refused here with a message that says what to fix.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import get_args

from api.predictor import OutputLengthPredictor
from api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from api.settings import ApiSettings
from api.tokenize import PromptTokenizer
from queues.keys import Bucket, Tier
from queues.messages import RequestMessage, SamplingSpec
from tailcut.errors import InvalidRequestError, ModelNotFoundError

TIER_HEADER = "x-tailcut-tier"
TENANT_HEADER = "x-tailcut-tenant"
TIER_NAMES: tuple[str, ...] = get_args(Tier)


@dataclass(slots=True)
class ServedModel:
    name: str
    max_model_len: int


def bucket_of(num_tokens: int, settings: ApiSettings) -> Bucket:
    if num_tokens < settings.short_max_tokens:
        return "short"
    if num_tokens > settings.long_min_tokens:
        return "long"
    return "medium"


class Admission:
    def __init__(
        self, settings: ApiSettings, tokenizer: PromptTokenizer, model: ServedModel, predictor: OutputLengthPredictor
    ) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._model = model
        self.predictor = predictor

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self._model.name:
            raise ModelNotFoundError(
                f"The model '{requested}' does not exist; this server serves '{self._model.name}' (see GET /v1/models)",
                param="model",
            )

    def resolve_tier(self, body: GenerationFields, header_tier: str | None) -> Tier:
        value = body.tier or header_tier or self._settings.default_tier
        if value not in TIER_NAMES:
            source = "tier" if body.tier else "X-Tailcut-Tier header"
            raise InvalidRequestError(
                f"unknown tier {value!r} in {source}; use one of: {', '.join(TIER_NAMES)}", param="tier"
            )
        return value  # type: ignore[return-value]

    async def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not self._tokenizer.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions instead")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if not any(m["content"].strip() for m in messages):
            raise InvalidRequestError("every message is empty; send some text in `messages`", param="messages")
        return await self._tokenizer.encode_chat(messages)

    async def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    "only one prompt per request is supported; send one request per prompt", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; send some text", param="prompt")
            return await self._tokenizer.encode_text(prompt)
        ids = [int(token) for token in prompt]  # type: ignore[arg-type]
        if not ids:
            raise InvalidRequestError("prompt is empty; send some text or token ids", param="prompt")
        bad = [t for t in ids if not 0 <= t < self._tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self._tokenizer.vocab_size - 1})",
                param="prompt",
            )
        return ids

    def build(
        self,
        body: GenerationFields,
        prompt_ids: list[int],
        *,
        tier: Tier,
        tenant_header: str | None,
        requested_max_tokens: int | None,
        reply_to: str,
    ) -> RequestMessage:
        if body.n != 1:
            raise InvalidRequestError("n > 1 is not supported; send n requests instead", param="n")
        if body.logprobs:
            raise InvalidRequestError("logprobs are not supported by tailcut yet", param="logprobs")
        context = self._model.max_model_len
        num_prompt = len(prompt_ids)
        if requested_max_tokens is None:
            max_tokens = context - num_prompt
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {context} tokens, and your prompt has "
                    f"{num_prompt}. Shorten the prompt.",
                    param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                    code="context_length_exceeded",
                )
        else:
            max_tokens = requested_max_tokens
            if num_prompt + max_tokens > context:
                raise InvalidRequestError(
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                    "completion). Shorten the prompt or lower max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        tenant = tenant_header or body.user or "default"
        predicted = self.predictor.predict(tier=tier, tenant=tenant, prompt_tokens=num_prompt, max_tokens=max_tokens)
        now_ms = int(time.time() * 1000)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return RequestMessage(
            id=uuid.uuid4().hex,
            tenant=tenant,
            tier=tier,
            bucket=bucket_of(num_prompt + predicted, self._settings),
            prompt_token_ids=prompt_ids,
            sampling=SamplingSpec(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,
                min_p=body.min_p or 0.0,
                seed=body.seed,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                min_tokens=min(body.min_tokens, max_tokens),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
            ),
            predicted_output_tokens=predicted,
            enqueued_at_ms=now_ms,
            deadline_ms=now_ms + int(self._settings.deadline_s(tier) * 1000),
            reply_to=reply_to,
        )
