"""The sim engine's published cost models and KV sizing (WORKLOADS.md), checked to the microsecond."""

from __future__ import annotations

import pytest

from workers.engines.costmodel import (
    DEFAULT_PROFILE,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    PROFILES,
    CostModel,
    kv_bytes_per_token,
    kv_capacity_tokens,
)


def test_exactly_the_two_published_profiles_h100_by_default() -> None:
    assert set(PROFILES) == {"h100-llama3-8b", "a100-llama3-8b"}
    assert DEFAULT_PROFILE == "h100-llama3-8b"
    for name, model in PROFILES.items():
        assert model.name == name


@pytest.mark.parametrize(
    ("profile", "num_prefill", "num_decode", "expected_us"),
    [
        ("h100-llama3-8b", 0, 0, 5753.0),
        ("h100-llama3-8b", 300, 4, 5753 + 17.25 * 300 + 6.00 * 4),
        ("h100-llama3-8b", 2048, 0, 5753 + 17.25 * 2048),
        ("h100-llama3-8b", 0, 256, 5753 + 6.00 * 256),
        ("a100-llama3-8b", 300, 4, 16442 + 47.84 * 300 + 18.21 * 4),
        ("a100-llama3-8b", 512, 64, 16442 + 47.84 * 512 + 18.21 * 64),
    ],
)
def test_step_time_is_base_plus_prefill_tokens_plus_decode_seqs(
    profile: str, num_prefill: int, num_decode: int, expected_us: float
) -> None:
    assert PROFILES[profile].step_us(num_prefill, num_decode) == expected_us


def test_worked_example_in_microseconds() -> None:
    assert PROFILES["h100-llama3-8b"].step_us(300, 4) == 10_952.0


def test_negative_step_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        CostModel("x", 1.0, 1.0, 1.0).step_us(-1, 0)


def test_llama3_8b_kv_is_128_kib_per_token() -> None:
    assert LLAMA3_8B_KV_BYTES_PER_TOKEN == 128 * 1024
    assert kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2) == 128 * 1024


def test_an_80_gb_card_at_0_9_holds_about_427_000_tokens_of_llama3_8b() -> None:
    tokens = kv_capacity_tokens()
    assert tokens == (72 * 10**9 - 16 * 10**9) // (128 * 1024) == 427_246
    assert tokens // 16 == 26_702  # "26,700 blocks of 16"


def test_kv_capacity_follows_its_parameters() -> None:
    assert kv_capacity_tokens(gpu_memory_bytes=40 * 10**9, gpu_memory_utilization=0.5, kv_bytes_per_token=1000) == (
        4 * 10**9 // 1000
    )
    with pytest.raises(ValueError, match="no room"):
        kv_capacity_tokens(gpu_memory_bytes=16 * 10**9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity_tokens(gpu_memory_utilization=1.5)
