"""Pure units of batch jobs: chunking, the request body's checks, the JSON serializer, aggregation, the CLI."""

from __future__ import annotations

import asyncio
import pickle

import orjson
import pytest
from arq.jobs import deserialize_result, serialize_job, serialize_result
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.schemas import JobRequest
from jobs.prompts import chunk_messages
from jobs.runner import aggregate, redis_failure
from jobs.settings import JobsSettings
from queues.jobs import Answer, JobSpec, dumps_job, loads_job, split_chunks
from queues.keys import Keys
from tailcut.cli import build_parser
from tailcut.errors import InvalidRequestError, JobFailedError


def test_job_keys_live_under_the_prefix() -> None:
    keys = Keys("tc:")
    assert keys.arq_queue == "tc:arq"
    assert keys.job("abc") == "tc:job:abc"
    assert keys.job_chunks("abc") == "tc:job:abc:chunks"


def test_split_chunks_keeps_order_and_line_numbers() -> None:
    lines = [f"line {number}" for number in range(1, 8)]
    chunks = split_chunks(lines, 3)
    assert [chunk.index for chunk in chunks] == [0, 1, 2]
    assert [(chunk.first_line, chunk.last_line) for chunk in chunks] == [(1, 3), (4, 6), (7, 7)]
    assert [line for chunk in chunks for line in chunk.lines] == lines
    messages = chunk_messages("find errors", chunks[1], len(chunks))
    assert messages[0]["role"] == "system"
    assert "Log lines 4-6 (part 2 of 3)" in messages[1]["content"]
    assert messages[1]["content"].startswith("find errors")
    assert "line 5" in messages[1]["content"]


def test_job_spec_round_trips_as_json_and_counts_requests() -> None:
    spec = JobSpec(lines=["a", "b", "c"], instruction="x", chunk_lines=2, max_tokens=5, reduce=True)
    again = JobSpec.from_payload(orjson.loads(orjson.dumps(spec.to_payload())))
    assert again == spec
    assert spec.num_requests == 3  # two chunks and the combining request


@pytest.mark.parametrize(
    ("body", "words", "param"),
    [
        ({"instruction": "x"}, "exactly one of `logs`", "logs"),
        ({"instruction": "x", "logs": "a", "lines": ["a"]}, "exactly one of `logs`", "logs"),
        ({"instruction": "x", "lines": []}, "`lines` holds no text", "lines"),
        ({"instruction": "x", "lines": [" ", ""]}, "`lines` holds no text", "lines"),
    ],
)
def test_job_request_refuses_unusable_logs(body: dict[str, object], words: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        JobRequest.model_validate(body).log_lines()
    assert words in caught.value.message
    assert caught.value.param == param


@pytest.mark.parametrize("body", [{"instruction": "x", "logs": "\n  \n"}, {"instruction": "   ", "lines": ["a"]}])
def test_blank_text_is_refused_by_the_schema_itself(body: dict[str, object]) -> None:
    # The OpenAPI document states it (pattern \S); the API answers "`logs` is blank" (test_jobs_api.py).
    with pytest.raises(ValidationError, match="string_pattern_mismatch"):
        JobRequest.model_validate(body)


def test_job_request_reads_text_as_lines_and_checks_ranges() -> None:
    body = JobRequest.model_validate({"instruction": "x", "logs": "a\nb\r\nc\n", "unknown": 1})
    assert body.log_lines() == ["a", "b", "c"]
    with pytest.raises(ValidationError):
        JobRequest.model_validate({"instruction": "x", "lines": ["a"], "chunk_lines": 0})
    with pytest.raises(ValidationError):
        JobRequest.model_validate({"lines": ["a"]})


def test_serializer_is_json_and_rebuilds_only_known_exceptions() -> None:
    payload = JobSpec(lines=["a"], instruction="x", chunk_lines=1, max_tokens=1).to_payload()
    job = serialize_job("analyze_logs", (payload,), {}, 1, 123, serializer=dumps_job)
    assert not job.startswith(b"\x80"), "a pickle"
    assert orjson.loads(job)["a"] == [payload]

    def result(value: BaseException) -> BaseException:
        data = serialize_result("f", (), {}, 1, 0, False, value, 0, 1, "ref", "q", "id", serializer=dumps_job)
        assert data is not None
        assert orjson.loads(data)["r"]["exc_type"] == type(value).__name__
        rebuilt = deserialize_result(data, deserializer=loads_job).result
        assert isinstance(rebuilt, BaseException)
        return rebuilt

    assert isinstance(result(asyncio.CancelledError()), asyncio.CancelledError)
    failed = result(KeyError("boom"))
    assert isinstance(failed, JobFailedError) and "KeyError" in failed.message
    with pytest.raises(TypeError):
        dumps_job({"r": object()})
    # A pickled payload is refused, never unpickled.
    with pytest.raises(orjson.JSONDecodeError):
        loads_job(pickle.dumps({"a": 1}))


def test_aggregate_orders_answers_by_chunk_and_reports_errors() -> None:
    chunks = split_chunks(["a", "b", "c"], 1)
    answers = {
        2: Answer(text="three", finish_reason="length", completion_tokens=3, prompt_tokens=10),
        0: Answer(text="one", finish_reason="stop", completion_tokens=1, prompt_tokens=10),
        1: Answer(error_code="expired", error_message="too late", prompt_tokens=10),
    }
    result = aggregate(chunks, answers, None)
    assert [chunk["text"] for chunk in result["chunks"]] == ["one", "", "three"]
    assert result["chunks"][1]["error"] == {"code": "expired", "message": "too late"}
    assert result["num_failed"] == 1
    assert result["usage"] == {"prompt_tokens": 30, "completion_tokens": 4}
    assert orjson.loads(dumps_job(result)) == result


def test_jobs_settings_refuse_bad_values() -> None:
    with pytest.raises(ValidationError, match="jobs_max_in_flight"):
        JobsSettings(jobs_max_in_flight=0)
    assert JobsSettings(jobs_chunk_lines=7).jobs_chunk_lines == 7


def test_cli_parses_jobs_and_submit() -> None:
    parser = build_parser()
    worker = parser.parse_args(["jobs", "--redis-url", "redis://x:1/0"])
    assert worker.func.__name__ == "cmd_jobs" and worker.redis_url == "redis://x:1/0"
    submit = parser.parse_args(["jobs", "submit", "app.log", "--chunk-lines", "20", "--url", "http://h:1"])
    assert submit.func.__name__ == "cmd_submit"
    assert (submit.file, submit.chunk_lines, submit.url) == ("app.log", 20, "http://h:1")


def test_a_redis_error_inside_a_chunks_task_group_is_redis_failing_not_the_job() -> None:
    """A chunk's task that meets a Redis timeout ends the job's task group with an ExceptionGroup: the
    job is interrupted (arq runs it again), not failed; any other error in the group fails it."""
    timeout = RedisTimeoutError("Timeout reading from 127.0.0.1:6379")
    closed = RedisConnectionError("Connection closed by server.")
    assert redis_failure(timeout)
    assert redis_failure(ExceptionGroup("chunks", [timeout, closed]))
    assert not redis_failure(ExceptionGroup("chunks", [timeout, ValueError("bad chunk")]))
    assert not redis_failure(ValueError("bad chunk"))
