"""``tailcut bench load`` against vLLM's own benchmark code (the installed vLLM, no engine started): the
same ShareGPT samples as ``ShareGPTDataset``, the same send times as ``get_request``, the same figures as
``calculate_metrics``, for the same inputs. If vLLM changes a rule, these say which."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from bench.datasets import read_sharegpt, sample_requests
from bench.loadgen import send_offsets
from bench.serve_result import result_fields
from bench.stats import RequestRecord, Status


def test_the_same_sharegpt_samples_as_vllms_dataset(tiny_model: Path, tmp_path: Path) -> None:
    from vllm.benchmarks.datasets.datasets import ShareGPTDataset

    words = "hello world question answer please thanks what why how when where which who the a queue".split()
    rng = np.random.default_rng(0)
    entries = []
    for number in range(400):
        roles = ["human", "gpt"] if number % 3 else ["gpt", "human"]
        turns = [
            {"from": roles[position % 2], "value": " ".join(rng.choice(words, size=int(rng.integers(1, 40))))}
            for position in range(int(rng.integers(1, 5)))
        ]
        entries.append({"id": f"c{number}", "conversations": turns})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    conversations = read_sharegpt(path).conversations
    for seed, num_requests, output_len in ((0, 50, None), (5, 120, 16), (9, 1000, None)):  # 1000: oversampled
        theirs = ShareGPTDataset(random_seed=seed, dataset_path=str(path)).sample(
            tokenizer=tokenizer, num_requests=num_requests, output_len=output_len
        )
        ours = sample_requests(conversations, tokenizer, num_requests, seed=seed, output_len=output_len)
        assert [(s.prompt, s.prompt_len, s.expected_output_len) for s in ours] == [
            (s.prompt, s.prompt_len, s.expected_output_len) for s in theirs
        ]


@pytest.mark.parametrize(("rate", "burstiness"), [(4.0, 1.0), (10.0, 0.3), (2.0, 5.0), (3.0, float("inf"))])
async def test_the_same_send_times_as_vllms_get_request(
    monkeypatch: pytest.MonkeyPatch, rate: float, burstiness: float
) -> None:
    from vllm.benchmarks import serve

    clock = SimpleNamespace(now=1000.0)

    async def sleep(seconds: float) -> None:
        clock.now += seconds

    monkeypatch.setattr(serve, "time", SimpleNamespace(time=lambda: clock.now))
    monkeypatch.setattr(serve, "asyncio", SimpleNamespace(sleep=sleep))
    np.random.seed(11)  # what vllm bench serve's main does with --seed 11
    sent = [clock.now - 1000.0 async for _ in serve.get_request(list(range(60)), rate, burstiness)]
    assert send_offsets(60, rate, burstiness=burstiness, seed=11) == pytest.approx(sent, rel=1e-9, abs=1e-9)


def random_records(count: int, seed: int) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for index in range(count):
        output = int(rng.choice([1, 2, int(rng.integers(3, 60))]))
        ttft_ms = float(rng.uniform(5, 400))
        gaps = [float(gap) for gap in rng.uniform(1, 60, size=output - 1)]
        e2e_ms = ttft_ms + sum(gaps) + float(rng.uniform(0, 2))
        status: Status = "ok" if rng.random() > 0.1 else "error"
        records.append(
            RequestRecord(
                index=index,
                tier="normal",
                bucket="short",
                tenant="t",
                prompt_tokens=int(rng.integers(4, 900)),
                output_tokens=output,
                sent_s=float(rng.uniform(0, 20)),
                ttft_ms=ttft_ms,
                e2e_ms=e2e_ms,
                tpot_ms=(e2e_ms - ttft_ms) / (output - 1) if output > 1 else None,
                gaps_ms=gaps,
                status=status,
                error=None if status == "ok" else "x",
            )
        )
    return records


def test_the_same_figures_as_vllms_calculate_metrics() -> None:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    records = random_records(300, seed=2)
    outputs = [
        RequestFuncOutput(
            success=record.status == "ok",
            latency=(record.e2e_ms or 0) / 1000,
            output_tokens=record.output_tokens,
            ttft=(record.ttft_ms or 0) / 1000,
            itl=[gap / 1000 for gap in record.gaps_ms],
            prompt_len=record.prompt_tokens,
            start_time=record.sent_s,
        )
        for record in records
    ]
    goodput = {"ttft": 200.0, "tpot": 30.0, "e2el": 1500.0}
    theirs, _ = calculate_metrics(
        input_requests=[],
        outputs=outputs,
        dur_s=25.0,
        tokenizer=None,
        selected_percentiles=[50.0, 90.0, 99.0],
        goodput_config_dict=goodput,
    )
    ours = result_fields(records, duration_s=25.0, goodput=goodput, percentiles=(50.0, 90.0, 99.0))
    assert ours["completed"] == theirs.completed and ours["failed"] == theirs.failed
    assert ours["total_input_tokens"] == theirs.total_input
    assert ours["total_output_tokens"] == theirs.total_output
    for name in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput"):
        assert ours[name] == pytest.approx(getattr(theirs, name)), name
    assert ours["max_output_tokens_per_s"] == theirs.max_output_tokens_per_s
    assert ours["max_concurrent_requests"] == theirs.max_concurrent_requests
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            name = f"{stat}_{metric}_ms"
            assert ours[name] == pytest.approx(getattr(theirs, name)), name
        for percentile, value in getattr(theirs, f"percentiles_{metric}_ms"):
            assert ours[f"p{int(percentile)}_{metric}_ms"] == pytest.approx(value), (metric, percentile)
