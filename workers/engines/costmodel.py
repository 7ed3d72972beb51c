"""Step-time cost models and KV-cache sizing for the ``sim`` engine (published calibrations, pure).

One continuous-batching iteration costs ``base_us + prefill_token_us·P + decode_seq_us·D`` where P is
the number of prefill tokens computed in the step and D the number of sequences that decode one token
in it (WORKLOADS.md, "Cost model for the ``sim`` engine").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear step-time model of one engine iteration, in microseconds."""

    name: str
    base_us: float
    prefill_token_us: float
    decode_seq_us: float

    def step_us(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        """Duration of one step that prefills ``num_prefill_tokens`` and decodes ``num_decode_seqs``."""
        if num_prefill_tokens < 0 or num_decode_seqs < 0:
            raise ValueError(f"step sizes cannot be negative: P={num_prefill_tokens}, D={num_decode_seqs}")
        return self.base_us + self.prefill_token_us * num_prefill_tokens + self.decode_seq_us * num_decode_seqs


PROFILES: dict[str, CostModel] = {
    # Source: BLIS blackbox fit on vLLM 0.8.4, Llama-3.1-8B, TP=1, H100 (WORKLOADS.md).
    "h100-llama3-8b": CostModel("h100-llama3-8b", base_us=5753.0, prefill_token_us=17.25, decode_seq_us=6.00),
    # Source: the same BLIS blackbox fit, A100-80GB (WORKLOADS.md).
    "a100-llama3-8b": CostModel("a100-llama3-8b", base_us=16442.0, prefill_token_us=47.84, decode_seq_us=18.21),
}
DEFAULT_PROFILE = "h100-llama3-8b"


# --- KV-cache sizing ------------------------------------------------------------------------------

GB = 10**9  # card memory and weights are quoted in decimal gigabytes

# Llama-3.1-8B: 32 layers, 8 KV heads (GQA), head dim 128, K and V, 2 bytes (bf16) → 128 KiB per token.
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
# Llama-3.1-8B weights in bf16: about 16 GB.
LLAMA3_8B_WEIGHTS_BYTES = 16 * GB
# An H100 or A100 with 80 GB of memory.
GPU_80GB_BYTES = 80 * GB
# vLLM's default ``gpu_memory_utilization``.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV-cache bytes one token occupies: a key and a value vector per KV head per layer."""
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def kv_capacity_tokens(
    *,
    gpu_memory_bytes: int = GPU_80GB_BYTES,
    weights_bytes: int = LLAMA3_8B_WEIGHTS_BYTES,
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> int:
    """Tokens the KV cache holds: the card's usable memory minus the weights, divided by the per-token
    size. The defaults (Llama-3.1-8B on an 80 GB card at 0.9) give about 427,000 tokens."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free_bytes = int(gpu_memory_bytes * gpu_memory_utilization) - weights_bytes
    if free_bytes <= 0 or kv_bytes_per_token <= 0:
        raise ValueError(
            f"no room for a KV cache: {gpu_memory_bytes} B x {gpu_memory_utilization} - {weights_bytes} B of weights"
        )
    return free_bytes // kv_bytes_per_token
