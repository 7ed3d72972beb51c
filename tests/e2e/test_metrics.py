"""/metrics after a short load, on the API and on a worker: every family carries samples, read by
Prometheus's own text parser."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailcut.exposition import serve_metrics
from tests.stack import running_stack
from workers.engines.vllm_engine import VllmEngine
from workers.metrics import worker_registry

pytestmark = pytest.mark.engine


async def test_a_worker_exports_its_state_and_vllms_metrics_after_a_short_load(
    redis_url: str, tiny_model: Path, engine: VllmEngine
) -> None:
    body = {"model": "tiny", "prompt": list(range(10, 30)), "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with running_stack(redis_url, tiny_model, engine) as stack:
        (worker,) = stack.workers
        server = serve_metrics(worker_registry(worker), host="127.0.0.1", port=0)
        assert server is not None
        try:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                tiers = ["realtime", "normal", "background"] * 2
                answers = await asyncio.gather(
                    *(client.post("/v1/completions", json={**body, "tier": tier}) for tier in tiers)
                )
                assert all(answer.status_code == 200 for answer in answers)
                # A reply reaches its client before its worker has acknowledged it and counted it.
                async with asyncio.timeout(10):
                    while worker.running_ids:
                        await asyncio.sleep(0.02)
                text = (await client.get(f"http://127.0.0.1:{server.server_port}/metrics")).text
                # The loop watch measures every 250 ms: on a fast machine the load can be over sooner.
                for _ in range(50):
                    api_text = (await client.get("/metrics")).text
                    if 'tailcut_event_loop_lag_seconds_count{process="api"} 0.0' not in api_text:
                        break
                    await asyncio.sleep(0.1)
        finally:
            server.shutdown()
            server.server_close()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        wanted = {"worker": worker.worker_id, **labels}
        found = [v for (n, got), v in samples.items() if n == name and wanted.items() <= dict(got).items()]
        assert found, f"no sample {name}{labels} in the worker's /metrics"
        return sum(found)

    outcomes = {
        dict(labels)["outcome"]: v for (n, labels), v in samples.items() if n == "tailcut_worker_requests_total"
    }
    assert outcomes == {"final": 6}, outcomes
    assert value("tailcut_worker_engine_calls_total") >= 6
    assert value("tailcut_worker_kv_capacity_tokens") > 0
    assert value("tailcut_worker_step_seconds") > 0
    assert value("tailcut_worker_token_budget_tokens") > 0
    assert value("tailcut_worker_running_requests", tier="realtime") == 0
    assert value("tailcut_worker_waiting_requests", tier="background") == 0
    for name in (
        "tailcut_worker_preemptions_total",
        "tailcut_worker_yields_total",
        "tailcut_worker_degradations_total",
        "tailcut_worker_keepalive_touches_total",
        "tailcut_worker_keepalive_returns_total",
        "tailcut_worker_keepalive_evicted_total",
        "tailcut_worker_keepalive_kept_tokens",
    ):
        assert value(name) >= 0
    assert value("tailcut_breaker_state", tier="realtime") == 0
    vllm = {name for name, _labels in samples if name.startswith("vllm:")}
    assert "vllm:kv_cache_usage_perc" in vllm, sorted(vllm)
    queries = sum(v for (n, _l), v in samples.items() if n == "vllm:prefix_cache_queries_total")
    tokens = sum(v for (n, _l), v in samples.items() if n == "vllm:generation_tokens_total")
    assert queries > 0 and tokens >= 6 * 24, (queries, tokens)

    api = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(api_text)
        for sample in family.samples
    }

    def api_value(name: str, **labels: str) -> float:
        found = [v for (n, got), v in api.items() if n == name and labels.items() <= dict(got).items()]
        assert found, f"no sample {name}{labels} in the API's /metrics"
        return sum(found)

    for tier in ("realtime", "normal", "background"):
        assert api_value("tailcut_requests_admitted_total", tier=tier) == 2
        assert api_value("tailcut_requests_finished_total", tier=tier, outcome="final") == 2
        assert api_value("tailcut_ttft_seconds_count", tier=tier, bucket="short") == 2
        assert api_value("tailcut_e2e_seconds_count", tier=tier, bucket="short") == 2
        assert api_value("tailcut_prediction_error_tokens_count", tier=tier) == 2
    assert api_value("tailcut_inter_chunk_gap_seconds_count") > 0
    assert api_value("tailcut_queue_depth_requests", tier="realtime", bucket="short") == 0
    assert api_value("tailcut_queued_tokens", tier="realtime", bucket="short") == 0
    for tier in ("realtime", "normal", "background"):
        # Each finished request met or missed its tier's SLO (the latencies of two cores decide which).
        met = api_value("tailcut_slo_requests_total", tier=tier, result="met")
        assert met + api_value("tailcut_slo_requests_total", tier=tier, result="missed") == 2
    assert api_value("tailcut_slo_requests_total", tier="background", result="met") == 2  # no latency target
    assert api_value("tailcut_open_streams") == 0
    assert api_value("tailcut_event_loop_lag_seconds_count", process="api") > 0
