"""The one admission path: a ``GenerationRequest`` becomes a ``RequestMessage`` or a clear refusal.

Everything a caller can get wrong is refused here with a message that says what to fix
(``InvalidRequestError``, ``ModelNotFoundError``); a tier whose queue is full is refused with
``OverloadedError``. The API, the batch-job runner and the simulator all admit through ``Admitter``,
and each feeds the output-length predictor what it observes (``observe``).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import get_args

from admission.config import AdmissionConfig
from admission.predictor import OutputLengthPredictor
from admission.request import (
    ChatPrompt,
    GenerationRequest,
    Prompt,
    ServedModel,
    TextPrompt,
    TokenPrompt,
)
from admission.shedding import RETRY_AFTER_MAX_S, QueueDepth
from admission.tokenizer import PromptTokenizer
from queues.keys import Tier
from queues.messages import DEFAULT_TENANT, RequestMessage, SamplingSpec
from tailcut.errors import InvalidRequestError, ModelNotFoundError, OverloadedError

TIER_NAMES: tuple[str, ...] = get_args(Tier)


def now_ms() -> int:
    return int(time.time() * 1000)


class Admitter:
    """``tokenizer``: None admits token prompts only (the simulator); ``queue_depth``: None never sheds."""

    def __init__(
        self,
        config: AdmissionConfig,
        model: ServedModel,
        *,
        tokenizer: PromptTokenizer | None = None,
        predictor: OutputLengthPredictor | None = None,
        queue_depth: QueueDepth | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.predictor = predictor or OutputLengthPredictor()
        self._queue_depth = queue_depth

    # --- the steps, each usable alone -------------------------------------------------------------

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model.name:
            raise ModelNotFoundError(
                f"The model '{requested}' does not exist; this server serves '{self.model.name}' (see GET /v1/models)",
                param="model",
            )

    def tier_of(self, request: GenerationRequest) -> Tier:
        value = request.tier or self.config.default_tier
        if value not in TIER_NAMES:
            raise InvalidRequestError(
                f"unknown tier {value!r} in {request.tier_source}; use one of: {', '.join(TIER_NAMES)}", param="tier"
            )
        return value  # type: ignore[return-value]

    def check_capacity(self, tier: Tier) -> None:
        """Refuse with ``OverloadedError`` (429, ``Retry-After``) while the tier's queue is at its limit:
        as many requests as it may hold, or an oldest one that has waited as long as it may."""
        shed, depth = self.config.shed, self._queue_depth
        if depth is None:
            return  # nothing counts the queue
        # A tier without a bound is not measured (the simulator's saturation runs queue thousands).
        limit = shed.limit(tier)
        if limit > 0 and shed.sheds(tier, waiting := depth.waiting(tier)):
            raise OverloadedError(
                f"the {tier} queue is full ({waiting} requests waiting, limit {limit}); retry later",
                tier=tier,
                retry_after_s=depth.retry_after_s(tier, limit),
            )
        wait_limit_s = shed.wait_limit_ms(tier) / 1000
        if wait_limit_s > 0 and (waited_s := depth.oldest_wait_ms(tier) / 1000) >= wait_limit_s:
            raise OverloadedError(
                f"the {tier} queue is backed up (its oldest request has waited {waited_s:.1f} s, "
                f"limit {wait_limit_s:g} s); retry later",
                tier=tier,
                # By then the queue has had as long as its oldest request is over the bound to drain.
                retry_after_s=max(1, min(RETRY_AFTER_MAX_S, math.ceil(waited_s - wait_limit_s))),
            )

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenized once here with the served model's tokenizer."""
        if isinstance(prompt, ChatPrompt):
            tokenizer = self._tokenizer_for(prompt)
            if not tokenizer.has_chat_template:
                raise InvalidRequestError(
                    "this model has no chat template, which chat messages need; send a text prompt (/v1/completions)"
                )
            return await tokenizer.encode_chat(prompt.messages)
        if isinstance(prompt, TextPrompt):
            if not prompt.text:
                raise InvalidRequestError("prompt is empty; send some text", param=prompt.param)
            return await self._tokenizer_for(prompt).encode_text(prompt.text)
        return self.token_ids(prompt)

    def token_ids(self, prompt: TokenPrompt) -> list[int]:
        ids = prompt.token_ids
        if not ids:
            raise InvalidRequestError("prompt is empty; send some text or token ids", param=prompt.param)
        if self.tokenizer is not None:
            vocab_size = self.tokenizer.vocab_size
            bad = [token for token in ids if not 0 <= token < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param=prompt.param
                )
        return ids

    def _tokenizer_for(self, prompt: Prompt) -> PromptTokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{type(prompt).__name__} needs a tokenizer; send token ids", param=prompt.param)
        return self.tokenizer

    def output_budget(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> int:
        """``max_tokens`` when prompt plus output fit the context (the context's rest when None), else
        ``InvalidRequestError`` with code ``context_length_exceeded``."""
        context = self.model.max_model_len
        if max_tokens is None:
            if context - num_prompt_tokens < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {context} tokens, and your prompt has "
                    f"{num_prompt_tokens}. Shorten the prompt.",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            return context - num_prompt_tokens
        if num_prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Shorten the prompt or lower max_tokens.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return max_tokens

    # --- the whole path -------------------------------------------------------------------------------

    async def admit(self, request: GenerationRequest, *, request_id: str | None = None) -> RequestMessage:
        """Tier, shedding (before any tokenizing), prompt tokens, then the message (under
        ``request_id`` when the caller chose the id, a new uuid4 otherwise)."""
        tier = self.tier_of(request)
        self.check_capacity(tier)
        prompt_ids = await self.prompt_ids(request.prompt)
        return self.message(request, tier, prompt_ids, request_id=request_id)

    def admit_tokens(
        self, request: GenerationRequest, *, request_id: str | None = None, at_ms: int | None = None
    ) -> RequestMessage:
        """``admit`` for a prompt of token ids, synchronously, with the caller's request id and clock if
        given (the simulator names its requests and runs on a virtual clock)."""
        if not isinstance(request.prompt, TokenPrompt):
            raise InvalidRequestError("admit_tokens takes token ids; use admit()", param=request.prompt.param)
        tier = self.tier_of(request)
        self.check_capacity(tier)
        return self.message(request, tier, self.token_ids(request.prompt), request_id=request_id, at_ms=at_ms)

    def message(
        self,
        request: GenerationRequest,
        tier: Tier,
        prompt_ids: list[int],
        *,
        request_id: str | None = None,
        at_ms: int | None = None,
    ) -> RequestMessage:
        num_prompt = len(prompt_ids)
        max_tokens = self.output_budget(
            num_prompt, request.max_tokens, prompt_param=request.prompt.param, max_tokens_param=request.max_tokens_param
        )
        tenant = request.tenant or DEFAULT_TENANT
        predicted = self.predictor.predict(tier=tier, tenant=tenant, prompt_tokens=num_prompt, max_tokens=max_tokens)
        sampling = SamplingSpec.of(request.sampling, max_tokens=max_tokens)
        sampling.min_tokens = min(sampling.min_tokens, max_tokens)
        enqueued_at_ms = now_ms() if at_ms is None else at_ms
        return RequestMessage(
            id=request_id or uuid.uuid4().hex,
            tenant=tenant,
            tier=tier,
            bucket=self.config.buckets.of(num_prompt + predicted),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            predicted_output_tokens=predicted,
            enqueued_at_ms=enqueued_at_ms,
            deadline_ms=enqueued_at_ms + int(self.config.deadlines.of(tier) * 1000),
            reply_to=request.reply_to,
        )

    def observe(self, message: RequestMessage, output_tokens: int) -> int:
        """Teach the predictor a finished request's real output length; returns the prediction's error."""
        self.predictor.observe(
            tier=message.tier,
            tenant=message.tenant,
            prompt_tokens=len(message.prompt_token_ids),
            output_tokens=output_tokens,
        )
        return abs(message.predicted_output_tokens - output_tokens)
