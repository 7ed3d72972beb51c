"""vLLM's /tokenize and /detokenize on the API: the ids admission queues for the same input, a round
trip back to the text, the pool's threads, and OpenAI-shaped errors (real Redis, no workers)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from api import tokenization
from queues.messages import RequestMessage
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import Stack, running_stack

CHAT = [
    {"role": "system", "content": "you answer questions about the queue"},
    {"role": "user", "content": "why is the tail latency high when a long prompt arrives?"},
]
TEXT = "hello world, the queue is short today"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def queued_prompt_ids(stack: Stack, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[int]:
    """Send a streamed request (no worker runs it, so it stays queued) and read the token ids that admission
    put into its intake message."""
    request = {**body, "max_tokens": 4, "stream": True}
    async with client.stream("POST", path, json=request, timeout=5) as response:
        assert response.status_code == 200, await response.aread()
        request_id = response.headers["x-tailcut-request-id"]
    for stream in stack.keys.intake_all():
        for _, fields in await stack.redis.xrange(stream):
            message = RequestMessage.loads(fields[b"d"])
            if message.id == request_id:
                return message.prompt_token_ids
    raise AssertionError(f"request {request_id} is not in any intake stream")


async def test_tokenize_counts_what_admission_queues_and_detokenize_gives_the_text_back(
    redis_url: str, tiny_model: Path
) -> None:
    async with running_stack(redis_url, tiny_model, None, max_model_len=TEST_MAX_MODEL_LEN) as stack:
        model = stack.api.state.model.name
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            chat = (await client.post("/tokenize", json={"model": model, "messages": CHAT})).json()
            assert set(chat) == {"count", "max_model_len", "tokens", "token_strs"}
            assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == TEST_MAX_MODEL_LEN
            assert chat["token_strs"] is None
            assert chat["tokens"] == await queued_prompt_ids(stack, client, "/v1/chat/completions", {"messages": CHAT})

            text = (await client.post("/tokenize", json={"prompt": TEXT})).json()
            assert text["tokens"] == await queued_prompt_ids(stack, client, "/v1/completions", {"prompt": TEXT})

            # Round trips: a text's ids decode to the text; a chat's to its template around the messages.
            bare = (await client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})).json()
            back = await client.post("/detokenize", json={"model": model, "tokens": bare["tokens"]})
            assert back.status_code == 200 and back.json() == {"prompt": TEXT}
            chat_text = (await client.post("/detokenize", json={"tokens": chat["tokens"]})).json()["prompt"]
            assert all(message["content"] in chat_text for message in CHAT)
            assert chat_text.endswith("<|im_start|>assistant\n")

            # vLLM's options: no generation prompt leaves the assistant's opening off; token strings.
            no_prompt = {"messages": CHAT, "add_generation_prompt": False, "return_token_strs": True}
            plain = (await client.post("/tokenize", json=no_prompt)).json()
            assert chat["tokens"][: plain["count"]] == plain["tokens"] and plain["count"] < chat["count"]
            assert len(plain["token_strs"]) == plain["count"] and all(isinstance(s, str) for s in plain["token_strs"])


async def test_tokenizing_runs_in_the_tokenizer_pool(
    redis_url: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    text_ids, chat_ids, decoded = tokenization.text_ids, tokenization.chat_ids, tokenization.decoded

    def noting(function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(tokenization, "text_ids", noting(text_ids))
    monkeypatch.setattr(tokenization, "chat_ids", noting(chat_ids))
    monkeypatch.setattr(tokenization, "decoded", noting(decoded))
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            long_text = " ".join(["the queue is long and the tail is slow"] * 2000)
            response = await client.post("/tokenize", json={"prompt": long_text})
            assert response.status_code == 200 and response.json()["count"] > 10_000
            assert (await client.post("/tokenize", json={"messages": CHAT})).status_code == 200
            assert (await client.post("/detokenize", json={"tokens": [5, 6, 7]})).status_code == 200
    assert len(threads) == 3 and all(name.startswith("tokenize") for name in threads), threads


BAD: list[tuple[str, str, dict[str, Any] | bytes, int, str, str | None]] = [
    # (name, path, body, status, words in the message, param)
    ("neither", "/tokenize", {"model": None}, 400, "send `prompt` (a text) or `messages`", "prompt"),
    ("both", "/tokenize", {"prompt": "a", "messages": CHAT}, 400, "one of the two", "prompt"),
    ("prompt not text", "/tokenize", {"prompt": 5}, 400, "valid string", "prompt"),
    ("empty messages", "/tokenize", {"messages": []}, 400, "at least 1 item", "messages"),
    (
        "unknown role",
        "/tokenize",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "'system'",
        "messages.0.role",
    ),
    (
        "open and continued",
        "/tokenize",
        {"messages": CHAT, "continue_final_message": True},
        400,
        "cannot both be true",
        "continue_final_message",
    ),
    ("unknown model", "/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "'gpt-9' does not exist", "model"),
    ("malformed json", "/tokenize", b'{"prompt": ', 400, "not valid JSON", None),
    ("no tokens", "/detokenize", {"model": None}, 400, "missing required field `tokens`", "tokens"),
    ("token not a number", "/detokenize", {"tokens": ["a"]}, 400, "valid integer", "tokens.0"),
    ("token out of vocab", "/detokenize", {"tokens": [1, 999999]}, 400, "outside the vocabulary", "tokens"),
    ("negative token", "/detokenize", {"tokens": [-1]}, 400, "greater than or equal to 0", "tokens.0"),
    ("unknown model", "/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "'gpt-9' does not exist", "model"),
]


async def test_bad_input_gets_an_openai_shaped_error_that_says_what_to_fix(redis_url: str, tiny_model: Path) -> None:
    async with running_stack(redis_url, tiny_model, None) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            for name, path, body, status, words, param in BAD:
                if isinstance(body, bytes):
                    response = await client.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    response = await client.post(path, json=body)
                assert response.status_code == status, (name, response.text)
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, name
                assert words in error["message"], (name, error["message"])
                assert error["param"] == param, (name, error)
