"""vLLM's ``/tokenize`` and ``/detokenize``, answered with the API's own tokenizer.

Shapes as vLLM 0.32's OpenAI server (``vllm/entrypoints/serve/tokenize``): ``POST /tokenize`` takes
``{"model", "prompt", "add_special_tokens": true}`` or ``{"model", "messages", "add_generation_prompt": true,
"continue_final_message": false, "add_special_tokens": false}`` (plus ``return_token_strs``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``POST /detokenize`` takes ``{"model", "tokens"}``
and answers ``{"prompt"}``. A text prompt is tokenized as admission tokenizes it (the tokenizer's special
tokens added), a chat through the same template call (``tailcut.models.encode_chat``), so ``count`` is
the number of prompt tokens a completion request with the same input is charged, bucketed and
scheduled by. Tokenizing runs in the admission tokenizer's thread pool, off the event loop. Bad input
gets the API's OpenAI-shaped 400; an unknown model a 404.

``vllm bench serve`` asks ``/tokenize`` first, to check that its tokenizer counts prompts as the server
does (without it, it warns "/tokenize unavailable, skipping alignment"). It sends no API key there: with
``TAILCUT_API_KEYS`` set these routes, like every other, answer 401, and vLLM's client skips the check.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import ConfigDict, Field

from admission.tokenizer import PromptTokenizer
from api.auth import check_auth, get_state
from api.responses import OrjsonResponse
from api.schemas import ChatMessage, RequestModel, TokenId
from api.state import ApiState
from tailcut.errors import InvalidRequestError
from tailcut.models import encode_chat

router = APIRouter(dependencies=[Depends(check_auth)])

Params = ParamSpec("Params")
Result = TypeVar("Result")


class TokenizeRequest(RequestModel):
    """Either of vLLM's two bodies: ``prompt`` (text) or ``messages`` (a chat); unknown fields are ignored.
    The schema says one of the two (``oneOf``), as the route checks."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
            ],
            # Continuing the final message means not opening the assistant's turn (whose default is to).
            "if": {
                "properties": {"continue_final_message": {"const": True}, "messages": {"type": "array"}},
                "required": ["continue_final_message", "messages"],
            },
            "then": {"properties": {"add_generation_prompt": {"const": False}}, "required": ["add_generation_prompt"]},
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM's defaults: True for a text prompt; False for a chat (its template adds what the model needs).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> OrjsonResponse:
    state = get_state(request)
    state.admitter.check_model(body.model)
    tokenizer = tokenizer_of(state)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send `prompt` (a text) or `messages` (a chat), one of the two", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise InvalidRequestError("`messages` is empty; send at least one message", param="messages")
        if body.add_generation_prompt and body.continue_final_message:
            raise InvalidRequestError(
                "`add_generation_prompt` and `continue_final_message` cannot both be true",
                param="continue_final_message",
            )
        if not tokenizer.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template, which chat messages need; send a text `prompt`", param="messages"
            )
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        ids = await in_pool(
            tokenizer,
            chat_ids,
            tokenizer.tokenizer,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
        )
    else:
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await in_pool(tokenizer, text_ids, tokenizer.tokenizer, body.prompt, add_special_tokens=special)
    token_strs = None
    if body.return_token_strs:
        token_strs = list(tokenizer.tokenizer.convert_ids_to_tokens(ids))
    return OrjsonResponse(
        {"count": len(ids), "max_model_len": state.model.max_model_len, "tokens": ids, "token_strs": token_strs}
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> OrjsonResponse:
    state = get_state(request)
    state.admitter.check_model(body.model)
    tokenizer = tokenizer_of(state)
    bad = [token for token in body.tokens if not 0 <= token < tokenizer.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", param="tokens"
        )
    text = await in_pool(tokenizer, decoded, tokenizer.tokenizer, body.tokens)
    return OrjsonResponse({"prompt": text})


def tokenizer_of(state: ApiState) -> PromptTokenizer:
    if state.admitter.tokenizer is None:  # the API always loads one; only a token-only admitter has none
        raise InvalidRequestError("this server has no tokenizer")
    return state.admitter.tokenizer


async def in_pool(
    tokenizer: PromptTokenizer, function: Callable[Params, Result], *args: Params.args, **kwargs: Params.kwargs
) -> Result:
    """``function(*args, **kwargs)`` in the tokenizer's threads (a long prompt takes milliseconds of CPU)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(tokenizer.pool, functools.partial(function, *args, **kwargs))


def chat_ids(
    hf_tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
) -> list[int]:
    """A chat's ids: vLLM's defaults are exactly admission's ``encode_chat``; other flags change the template
    call as vLLM changes it."""
    if add_generation_prompt and not continue_final_message and not add_special_tokens:
        return encode_chat(hf_tokenizer, messages)
    text = hf_tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return list(hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))


def text_ids(hf_tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    return list(hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))


def decoded(hf_tokenizer: Any, tokens: list[int]) -> str:
    return str(hf_tokenizer.decode(tokens))
