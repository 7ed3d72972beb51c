"""Queued tokens per tier and bucket on a real Redis: what the entries no worker has read will cost."""

from __future__ import annotations

import redis.asyncio as aioredis

from admission.shedding import Backlog
from queues import intake
from queues.keys import Keys
from queues.messages import RequestMessage, SamplingSpec


def message(request_id: str, prompt: int, predicted: int, *, tier: str = "normal") -> RequestMessage:
    return RequestMessage(
        id=request_id,
        tenant="t",
        tier=tier,  # type: ignore[arg-type]
        bucket="short",
        prompt_token_ids=list(range(prompt)),
        sampling=SamplingSpec(max_tokens=predicted * 2),
        predicted_output_tokens=predicted,
        enqueued_at_ms=0,
        deadline_ms=0,
        reply_to="api",
    )


async def test_queued_tokens_count_only_what_no_worker_has_read(prefixed_redis: tuple[aioredis.Redis, Keys]) -> None:
    redis, keys = prefixed_redis
    stream = keys.intake("normal", "short")
    # Before any worker opened the stream (no group yet): every entry counts.
    for index, (prompt, predicted) in enumerate([(10, 5), (20, 10), (30, 15)]):
        await intake.enqueue(redis, keys, message(f"r{index}", prompt, predicted))
    assert (await intake.queued_tokens(redis, [stream]))[stream] == 15 + 30 + 45

    await intake.ensure_groups(redis, keys)
    (first,) = await intake.read(redis, keys, "w1", [stream], count=1, block_ms=None)
    assert first.message.id == "r0"
    assert (await intake.queued_tokens(redis, [stream]))[stream] == 30 + 45

    # A continuation handed back costs its context (prompt and what it generated) and the rest of its
    # predicted output; it is queued again.
    continuation = message("r0", 10, 5)
    continuation.generated_token_ids = [1, 2, 3]
    assert continuation.cost_tokens() == 10 + 3 + 2
    assert await intake.requeue(redis, keys, first, continuation) is not None
    assert (await intake.queued_tokens(redis, [stream]))[stream] == 30 + 45 + 15

    # Past the scan limit the rest count at the mean of what was read.
    assert (await intake.queued_tokens(redis, [stream], scan=2))[stream] == round((30 + 45) * 3 / 2)
    missing = keys.intake("background", "long")
    assert (await intake.queued_tokens(redis, [missing]))[missing] == 0


async def test_the_backlog_probe_reports_depth_and_tokens_per_tier_and_bucket(
    prefixed_redis: tuple[aioredis.Redis, Keys],
) -> None:
    redis, keys = prefixed_redis
    await intake.ensure_groups(redis, keys)
    await intake.enqueue(redis, keys, message("a", 100, 50, tier="realtime"))
    await intake.enqueue(redis, keys, message("b", 7, 3, tier="realtime"))
    await intake.enqueue(redis, keys, message("c", 40, 0, tier="background"))
    backlog = Backlog(redis, keys, interval_s=0.1)
    await backlog.probe()
    assert backlog.depth["realtime", "short"] == 2
    assert backlog.tokens["realtime", "short"] == 160
    assert backlog.tokens["background", "short"] == 40
    assert backlog.tokens["normal", "short"] == 0
