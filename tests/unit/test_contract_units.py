"""Pure units: key names, message round trips, settings validation, error bodies."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from api.errors import _describe_validation
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.streaming import coalesced, event_frames, sse
from queues.keys import Keys
from queues.messages import OutputEvent, RequestMessage, SamplingSpec, dumps_events, loads_events
from tailcut.errors import ConfigError
from tailcut.settings import CommonSettings
from workers.engines.vllm_engine import engine_args
from workers.settings import EngineSettings


def test_keys_follow_the_contract() -> None:
    keys = Keys("tc:")
    assert keys.intake("realtime", "short") == "tc:q:realtime:short"
    assert keys.output("abc") == "tc:out:abc"
    assert keys.reply_channel("api-1") == "tc:reply:api-1"
    assert keys.dead_letter == "tc:dlq"
    assert keys.events == "tc:events"
    # Most urgent first: every realtime stream before any normal one, short before long.
    assert keys.intake_all()[:4] == [
        "tc:q:realtime:short",
        "tc:q:realtime:medium",
        "tc:q:realtime:long",
        "tc:q:normal:short",
    ]
    assert len(set(keys.intake_all())) == 9


def test_request_message_survives_a_round_trip() -> None:
    message = RequestMessage(
        id="r1",
        tenant="acme",
        tier="background",
        bucket="long",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingSpec(max_tokens=9, temperature=0.0, stop=["\n"], seed=7),
        predicted_output_tokens=9,
        enqueued_at_ms=10,
        deadline_ms=20,
        reply_to="api-1",
        generated_token_ids=[4, 5],
        next_seq=3,
    )
    assert RequestMessage.loads(message.dumps()) == message


def test_output_events_survive_a_batch_round_trip() -> None:
    events = [
        OutputEvent(rid="r", seq=1, type="chunk", text="hé", token_ids=[5]),
        OutputEvent(rid="r", seq=2, type="final", finish_reason="length", prompt_tokens=3, completion_tokens=1),
    ]
    assert loads_events(dumps_events(events)) == events
    assert [event.terminal for event in events] == [False, True]


def test_key_prefix_must_end_with_a_colon() -> None:
    with pytest.raises(ValidationError, match="must end with ':'"):
        CommonSettings(key_prefix="tc")


def test_engine_args_pick_the_block_size_per_device() -> None:
    settings = EngineSettings()
    cpu = engine_args(Path("/m"), settings, on_cpu=True, max_model_len=None)
    gpu = engine_args(Path("/m"), settings, on_cpu=False, max_model_len=4096)
    assert (cpu["block_size"], cpu["dtype"], cpu["enforce_eager"]) == (32, "float32", True)
    assert cpu["kv_cache_memory_bytes"] == 512 * 1024 * 1024
    assert (gpu["block_size"], gpu["dtype"], gpu["max_model_len"]) == (16, "auto", 4096)
    assert gpu["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in gpu
    assert cpu["scheduling_policy"] == gpu["scheduling_policy"] == "priority"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (EngineSettings(block_size=16), "multiple of 32"),
        (EngineSettings(quantization="fp8"), "needs a GPU"),
        (EngineSettings(dtype="float16"), "float16 is not supported"),
    ],
)
def test_engine_args_refuse_what_the_cpu_cannot_run(settings: EngineSettings, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        engine_args(Path("/m"), settings, on_cpu=True, max_model_len=None)


def test_engine_settings_refuse_cpu_combinations_at_parse_time() -> None:
    with pytest.raises(ValidationError, match="multiple of 32"):
        EngineSettings(device="cpu", block_size=16)


def test_validation_errors_name_the_field() -> None:
    message, param = _describe_validation(
        [{"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "Input should be >= 1"}]
    )
    assert (message, param) == ("`max_tokens`: Input should be >= 1", "max_tokens")
    message, param = _describe_validation([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}])
    assert (message, param) == ("missing required field `messages`", "messages")


def test_renderers_shape_openai_chunks() -> None:
    final = OutputEvent(rid="r", seq=3, type="final", finish_reason="stop", prompt_tokens=4, completion_tokens=2)
    chat = ChatRenderer("r", "m", return_token_ids=True, include_usage=True)
    chunk = chat.content(OutputEvent(rid="r", seq=1, type="chunk", text="hi", token_ids=[7]))
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-r"
    assert chunk["choices"][0]["delta"] == {"content": "hi"} and chunk["choices"][0]["token_ids"] == [7]
    assert chunk["usage"] is None
    assert chat.usage_chunk(final)["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    whole = CompletionRenderer("r", "m", return_token_ids=False, include_usage=False).whole("hi!", [7, 8], final)
    assert whole["choices"][0] == {"index": 0, "text": "hi!", "logprobs": None, "finish_reason": "stop"}


@pytest.mark.parametrize("renderer_kind", [ChatRenderer, CompletionRenderer])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("text", ["hi", "", ' "quoted" \\ back', "new\nline\ttab", "é ünï 漢字 🙂", "\x00\x1f"])
def test_content_frames_from_the_template_are_the_chunks_bytes(
    renderer_kind: type[Renderer], include_usage: bool, text: str
) -> None:
    renderer = renderer_kind("r-1", 'model "x"', return_token_ids=False, include_usage=include_usage)
    event = OutputEvent(rid="r-1", seq=5, type="chunk", text=text, token_ids=[1, 2])
    for _ in range(2):  # the template is made on first use, then reused
        assert renderer.content_json(event) == orjson.dumps(renderer.content(event))
    assert event_frames(event, renderer) == [sse(renderer.content(event), 5)]
    assert event_frames(event, renderer, ids=False) == [sse(renderer.content(event))]
    with_ids = renderer_kind("r-1", "m", return_token_ids=True, include_usage=include_usage)
    assert orjson.loads(with_ids.content_json(event)) == with_ids.content(event)


def test_a_batchs_runs_of_chunks_leave_as_one_chunk_at_the_last_position() -> None:
    def chunk(seq: int) -> OutputEvent:
        return OutputEvent(rid="r", seq=seq, type="chunk", text=f"t{seq}", token_ids=[seq])

    notice = OutputEvent(rid="r", seq=3, type="degraded", degraded={"degraded": "summary"})
    final = OutputEvent(rid="r", seq=6, type="final", finish_reason="stop")
    batch = [chunk(1), chunk(2), notice, chunk(4), chunk(5), final]
    joined = coalesced(batch)
    assert [(event.seq, event.type, event.text, event.token_ids) for event in joined] == [
        (2, "chunk", "t1t2", [1, 2]),
        (3, "degraded", "", []),
        (5, "chunk", "t4t5", [4, 5]),
        (6, "final", "", []),
    ]
    # The batch's own events are untouched (a recorder or the answer cache may hold them).
    assert [(event.seq, event.text, event.token_ids) for event in batch[:2]] == [(1, "t1", [1]), (2, "t2", [2])]
    single = [chunk(7)]
    assert coalesced(single) == single


def test_events_travel_without_their_default_fields() -> None:
    chunk = OutputEvent(rid="r", seq=1, type="chunk", text="hi", token_ids=[7])
    assert orjson.loads(chunk.dumps()) == {"rid": "r", "seq": 1, "type": "chunk", "text": "hi", "token_ids": [7]}
    final = OutputEvent(rid="r", seq=2, type="final", finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    assert orjson.loads(final.dumps()) == {
        "rid": "r",
        "seq": 2,
        "type": "final",
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 1,
    }
    assert loads_events(dumps_events([chunk, final])) == [chunk, final]
    # An event written in full (by an earlier version) reads the same.
    assert OutputEvent.from_dict(orjson.loads(orjson.dumps(final))) == final


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"quantization": "fp8", "dtype": "float32"}, "fp8 quantization computes in 16-bit"),
        ({"block_size": 24}, "power of two"),
        ({"device": "cpu", "dtype": "float16"}, "float16 is not supported by vLLM on CPU"),
    ],
)
def test_engine_settings_refuse_invalid_pools_with_the_fix(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        EngineSettings(**overrides)  # type: ignore[arg-type]


def test_worker_budget_cannot_exceed_the_engine_step_budget() -> None:
    from workers.settings import WorkerSettings

    with pytest.raises(ValidationError, match="exceeds the engine's max_num_batched_tokens"):
        WorkerSettings(engine={"max_num_batched_tokens": 1024})  # type: ignore[arg-type]


def test_hand_packed_commands_are_the_bytes_redis_py_sends() -> None:
    """The output writer's script call is packed by ``queues.scripts.pack_command``: byte for byte what
    redis-py's own packer makes of the same arguments (text, UTF-8 text, integers, bytes, empty values,
    a payload longer than redis-py's buffer cutoff)."""
    from redis.asyncio.connection import Connection

    from queues.scripts import pack_command

    payload = OutputEvent(rid="r" * 32, seq=7, type="chunk", text="héllo ✓\r\n", token_ids=[1, 2, 3]).dumps()
    args: list[bytes | str | int] = [b"EVALSHA", "a" * 40, 2, "tc:fence:x", "tc:out:x", 3600, 0, -1, "", b"", payload]
    args.append(b"x" * 70_000)
    assert pack_command(args) == b"".join(Connection().pack_command(*args))
