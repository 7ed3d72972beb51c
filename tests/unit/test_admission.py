"""The one admission path (pure parts): buckets, tiers, context length, shedding, learning (no Redis)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from admission.admitter import Admitter
from admission.config import AdmissionConfig, BucketEdges
from admission.request import ChatPrompt, GenerationRequest, ServedModel, TokenPrompt
from admission.settings import AdmissionSettings
from admission.shedding import ShedLimits
from queues.keys import Tier
from queues.messages import SamplingOptions
from tailcut.errors import InvalidRequestError, ModelNotFoundError, OverloadedError


class Depth:
    """A fixed queue depth per tier (the API reads it from Redis, the simulator from its queue), and
    how long the oldest of each tier's has waited (``waited_ms``)."""

    def __init__(self, waited_ms: dict[Tier, float] | None = None, **waiting: int) -> None:
        self._waiting = waiting
        self._waited_ms = waited_ms or {}

    def waiting(self, tier: Tier) -> int:
        return self._waiting.get(tier, 0)

    def oldest_wait_ms(self, tier: Tier) -> float:
        return self._waited_ms.get(tier, 0.0)

    def retry_after_s(self, tier: Tier, limit: int) -> int:
        return 7


def admitter(*, context: int = 1000, depth: Depth | None = None, shed: ShedLimits | None = None) -> Admitter:
    config = AdmissionConfig(shed=shed or ShedLimits())
    return Admitter(config, ServedModel("m", context), queue_depth=depth)


def tokens(count: int, **fields: object) -> GenerationRequest:
    return GenerationRequest(prompt=TokenPrompt(list(range(count))), reply_to="api-1", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_tokens", "bucket"), [(1, "short"), (127, "short"), (128, "medium"), (512, "medium"), (513, "long")]
)
def test_bucket_edges(num_tokens: int, bucket: str) -> None:
    assert BucketEdges().of(num_tokens) == bucket


def test_bucket_thresholds_must_leave_room_for_medium() -> None:
    with pytest.raises(ValidationError, match="must be below long_min_tokens"):
        AdmissionSettings(short_max_tokens=600, long_min_tokens=512)


def test_a_message_carries_tier_tenant_bucket_deadline_and_sampling() -> None:
    message = admitter().admit_tokens(
        tokens(100, tier="realtime", tenant="acme", max_tokens=20, sampling=SamplingOptions(temperature=0.0)),
        request_id="r1",
        at_ms=1_000,
    )
    assert (message.id, message.tier, message.tenant, message.reply_to) == ("r1", "realtime", "acme", "api-1")
    # 100 prompt tokens + a prediction of at most max_tokens (20): short stays below 128.
    assert message.predicted_output_tokens == 20 and message.bucket == "short"
    assert (message.enqueued_at_ms, message.deadline_ms) == (1_000, 6_000)
    assert (message.sampling.max_tokens, message.sampling.temperature) == (20, 0.0)


def test_no_tier_means_the_default_and_an_unknown_one_is_refused_by_name() -> None:
    assert admitter().admit_tokens(tokens(5)).tier == "normal"
    with pytest.raises(InvalidRequestError, match="unknown tier 'gold' in X-Tailcut-Tier header") as caught:
        admitter().admit_tokens(tokens(5, tier="gold", tier_source="X-Tailcut-Tier header"))
    assert caught.value.param == "tier"


def test_the_context_length_bounds_prompt_plus_output() -> None:
    # No max_tokens: whatever the context leaves.
    assert admitter(context=100).admit_tokens(tokens(60)).sampling.max_tokens == 40
    with pytest.raises(InvalidRequestError, match="you requested 110 tokens") as caught:
        admitter(context=100).admit_tokens(tokens(60, max_tokens=50))
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(InvalidRequestError, match="your prompt has 100") as caught:
        admitter(context=100).admit_tokens(tokens(100))
    assert caught.value.param == "prompt"


def test_min_tokens_never_exceeds_max_tokens() -> None:
    message = admitter().admit_tokens(tokens(5, max_tokens=8, sampling=SamplingOptions(min_tokens=50)))
    assert message.sampling.min_tokens == 8


def test_a_full_tier_is_shed_with_its_retry_after_and_others_are_not() -> None:
    full = admitter(depth=Depth(background=ShedLimits().background))
    with pytest.raises(OverloadedError) as caught:
        full.admit_tokens(tokens(5, tier="background"))
    assert (caught.value.tier, caught.value.retry_after_s) == ("background", 7)
    assert full.admit_tokens(tokens(5, tier="realtime")).tier == "realtime"
    # 0 turns shedding off.
    assert admitter(depth=Depth(background=10_000), shed=ShedLimits.never()).admit_tokens(tokens(5, tier="background"))


def test_a_tier_whose_oldest_request_waited_its_bound_is_shed_however_short_its_queue() -> None:
    bounded = ShedLimits(normal_wait_ms=2_000)
    backed_up = admitter(depth=Depth(waited_ms={"normal": 3_400, "background": 60_000}, normal=3), shed=bounded)
    with pytest.raises(OverloadedError, match=r"oldest request has waited 3\.4 s, limit 2 s") as caught:
        backed_up.admit_tokens(tokens(5, tier="normal"))
    # The queue has had 1.4 s over the bound to drain by then: come back in 2 s.
    assert (caught.value.tier, caught.value.retry_after_s) == ("normal", 2)
    # A tier without a wait bound is not timed however long its oldest waited.
    assert backed_up.admit_tokens(tokens(5, tier="background")).tier == "background"
    assert admitter(depth=Depth(waited_ms={"normal": 1_999}), shed=bounded).admit_tokens(tokens(5, tier="normal"))
    # Retry-After stays within 1..30 s.
    with pytest.raises(OverloadedError) as caught:
        admitter(depth=Depth(waited_ms={"normal": 600_000}), shed=bounded).admit_tokens(tokens(5, tier="normal"))
    assert caught.value.retry_after_s == 30
    # Off by default: a slow engine's queue waits seconds, and a closed-loop client should not be refused.
    assert admitter(depth=Depth(waited_ms={"normal": 600_000})).admit_tokens(tokens(5, tier="normal"))


class Uncountable(Depth):
    """A queue too long to count: only the tiers that are shed may ask (the simulator's saturation
    runs queue thousands per tier, and counting them at every arrival was quadratic)."""

    def waiting(self, tier: Tier) -> int:
        if tier != "background":
            raise AssertionError(f"counted the {tier} queue, which is never shed")
        return 0

    def oldest_wait_ms(self, tier: Tier) -> float:
        if tier != "normal":
            raise AssertionError(f"timed the {tier} queue, which has no wait bound")
        return 0.0


def test_a_tier_that_is_never_shed_is_not_counted() -> None:
    shed = ShedLimits(realtime=0, normal=0, background=64, normal_wait_ms=2_000)
    admit = admitter(depth=Uncountable(), shed=shed)
    assert [admit.admit_tokens(tokens(5, tier=tier)).tier for tier in ("realtime", "normal", "background")] == [
        "realtime",
        "normal",
        "background",
    ]


def test_observing_real_lengths_moves_the_prediction() -> None:
    admit = admitter()
    first = admit.admit_tokens(tokens(10, tier="realtime", tenant="a", max_tokens=500))
    assert first.predicted_output_tokens == 64  # the realtime prior
    assert admit.observe(first, 10) == 54
    second = admit.admit_tokens(tokens(10, tier="realtime", tenant="a", max_tokens=500))
    assert second.predicted_output_tokens == 10


def test_the_model_must_be_the_served_one() -> None:
    admitter().check_model(None)
    admitter().check_model("m")
    with pytest.raises(ModelNotFoundError, match="serves 'm'"):
        admitter().check_model("other")


async def test_prompts_without_a_tokenizer_must_be_token_ids() -> None:
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        await admitter().prompt_ids(ChatPrompt([{"role": "user", "content": "hi"}]))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        admitter().admit_tokens(tokens(0))
