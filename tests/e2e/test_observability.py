"""The stack as an operator sees it, after a short load: a real Prometheus scraping the API, a worker and the
jobs process with the repository's own scrape config (only the targets' addresses are this machine's),
every PromQL expression of the Grafana dashboard answering, and the status page rendered by a real
headless Chromium showing the numbers that /metrics and Prometheus show.

Set ``TAILCUT_STATUS_SCREENSHOT=docs/status.png`` to keep the page's screenshot (the README's).
"""

from __future__ import annotations

import asyncio
import html.parser
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from queues.keys import BUCKETS, TIERS
from tailcut.exposition import serve_metrics
from tailcut.processes import Child, free_port, start_child, stop_child
from tests.stack import Stack, running_jobs, running_stack
from workers.engines.vllm_engine import VllmEngine
from workers.metrics import worker_registry

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tailcut.json"
# Grafana's own variables, as Grafana would substitute them for a short range.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
BREAKER_STATES = {0: "closed", 1: "half_open", 2: "open"}


def tool(name: str, *alternatives: str) -> str:
    for candidate in (name, *alternatives):
        found = shutil.which(candidate)
        if found:
            return found
    pytest.fail(f"`{name}` is not installed: ./scripts/test installs it (scripts/ensure-tools, Debian packages)")


# --- Prometheus ----------------------------------------------------------------------------------


def scrape_config(addresses: dict[str, str], storage: Path) -> Path:
    """The repository's scrape config with each job's targets replaced by this test's process (keeping
    the first target group's labels: the worker's pool)."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == set(addresses), f"the scrape config's jobs {sorted(jobs)} are not the stack's {sorted(addresses)}"
    for job in config["scrape_configs"]:
        labels = job["static_configs"][0].get("labels", {})
        job["static_configs"] = [{"targets": [addresses[job["job_name"]]], "labels": labels}]
    path = storage / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def prometheus_binary() -> str:
    return tool("prometheus")


async def start_prometheus(binary: str, config: Path, storage: Path) -> tuple[Child, str]:
    port = free_port()
    child = start_child(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={storage / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log_path=storage / "prometheus.log",
    )
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2) as client:
        for _ in range(300):
            assert child.process.poll() is None, child.log_tail()
            try:
                if (await client.get(f"{base}/-/ready")).status_code == 200:
                    return child, base
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    pytest.fail(f"Prometheus was not ready: {child.log_tail()}")


async def query(client: httpx.AsyncClient, base: str, expr: str) -> list[dict[str, Any]]:
    answer = await client.get(f"{base}/api/v1/query", params={"query": expr})
    body = answer.json()
    assert answer.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def panels(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every panel (rows' nested ones included) with whether it sits in, or is, a GPU-only one."""
    gpu_row = False
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            gpu_row = is_gpu(panel)
            for nested in panel.get("panels", []):
                yield nested, gpu_row or is_gpu(nested)
            continue
        yield panel, gpu_row or is_gpu(panel)


def is_gpu(panel: dict[str, Any]) -> bool:
    text = f"{panel.get('title', '')} {panel.get('description', '')}"
    return "GPU only" in text or (panel.get("type") == "row" and "GPU" in panel.get("title", ""))


def substitute(expr: str, dashboard: dict[str, Any]) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    # Dashboard variables (a tier or worker picker): all values.
    for variable in dashboard.get("templating", {}).get("list", []):
        expr = re.sub(rf"\$\{{?{re.escape(variable['name'])}\}}?", ".*", expr)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


# --- the status page ---------------------------------------------------------------------------------


class Fields(html.parser.HTMLParser):
    """Text of every element with a ``data-field`` attribute, and whether the page finished loading."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}
        self.loaded = False
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "body" and named.get("data-loaded") == "1":
            self.loaded = True
        field = named.get("data-field")
        self._open.append(field)
        if field is not None:
            self.fields[field] = ""

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for field in self._open:
            if field is not None:
                self.fields[field] += data


def chromium(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def screenshot_path(tmp_path: Path) -> Path:
    return Path(os.environ.get("TAILCUT_STATUS_SCREENSHOT") or tmp_path / "status.png").resolve()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(value for (n, got), value in found.items() if n == name and labels.items() <= dict(got).items())


# --- the test ----------------------------------------------------------------------------------------


@pytest.fixture
async def observed(redis_url: str, tiny_model: Path, engine: VllmEngine) -> AsyncIterator[tuple[Stack, dict[str, str]]]:
    """The stack, a jobs process, and the metrics addresses of its three kinds of process."""
    async with running_stack(redis_url, tiny_model, engine) as stack:
        async with running_jobs(stack, tiny_model, jobs_max_in_flight=4) as runner:
            (worker,) = stack.workers
            servers = [
                serve_metrics(worker_registry(worker), host="127.0.0.1", port=0),
                serve_metrics(runner.metrics.registry, host="127.0.0.1", port=0),
            ]
            assert all(server is not None for server in servers)
            addresses = {
                "api": stack.base_url.removeprefix("http://"),
                "worker": f"127.0.0.1:{servers[0].server_port}",  # type: ignore[union-attr]
                "jobs": f"127.0.0.1:{servers[1].server_port}",  # type: ignore[union-attr]
            }
            try:
                yield stack, addresses
            finally:
                for server in servers:
                    server.shutdown()  # type: ignore[union-attr]
                    server.server_close()  # type: ignore[union-attr]


async def load(client: httpx.AsyncClient) -> int:
    """A short mixed load: each tier, two lengths, streamed and whole; and one small batch job (whose
    chunks the jobs process admits itself). Returns how many requests the API served."""
    body = {"model": "tiny", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    requests = [
        {**body, "tier": tier, "prompt": list(range(10, 10 + length)), "stream": stream}
        for tier in TIERS
        for length in (20, 200)
        for stream in (False, True)
    ]
    answers = await asyncio.gather(*(client.post("/v1/completions", json=request) for request in requests))
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
    job = {"lines": [f"10:00:0{i} worker-{i} WARN queue depth {i}" for i in range(6)], "chunk_lines": 2}
    created = await client.post("/v1/jobs", json={**job, "instruction": "Which workers warn?", "max_tokens": 4})
    assert created.status_code == 202, created.text
    for _ in range(600):
        view = (await client.get(f"/v1/jobs/{created.json()['id']}")).json()
        if view["status"] in ("complete", "failed", "aborted"):
            break
        await asyncio.sleep(0.1)
    assert view["status"] == "complete", f"{view}"
    return len(requests)


async def test_prometheus_scrapes_every_process_the_dashboard_answers_and_the_status_page_agrees(
    observed: tuple[Stack, dict[str, str]], prometheus_binary: str, tmp_path: Path
) -> None:
    stack, addresses = observed
    browser = tool("chromium", "chromium-browser", "google-chrome")
    config = scrape_config(addresses, tmp_path)
    check = await asyncio.to_thread(
        subprocess.run, [tool("promtool"), "check", "config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    prometheus, prom = await start_prometheus(prometheus_binary, config, tmp_path)
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            finished = await load(client)
            # Prometheus has the load once its latest scrape of the API counts every request.
            for _ in range(600):
                found = await query(client, prom, "sum(tailcut_requests_finished_total)")
                if found and float(found[0]["value"][1]) >= finished:
                    break
                await asyncio.sleep(0.2)
            assert found and float(found[0]["value"][1]) == finished, found
            interval_s = float(str(yaml.safe_load(SCRAPE_CONFIG.read_text())["global"]["scrape_interval"])[:-1])
            await asyncio.sleep(2 * interval_s + 1)  # two more scrapes: rates over them are defined

            targets = (await client.get(f"{prom}/api/v1/targets")).json()["data"]["activeTargets"]
            assert {target["labels"]["job"] for target in targets} == set(addresses), targets
            assert all(target["health"] == "up" for target in targets), targets

            dashboard = json.loads(DASHBOARD.read_text())
            checked = 0
            for panel, gpu_only in panels(dashboard):
                for target in panel.get("targets", []):
                    expr = substitute(target["expr"], dashboard)
                    result = await query(client, prom, expr)
                    if gpu_only:
                        # No GPU here: NVML is absent, so are its series (the worker logged why).
                        assert result == [], f"{panel['title']}: {expr} answered {result} without a GPU"
                    else:
                        assert result, f"panel {panel['title']!r}: {expr} returned no data after the load"
                    checked += 1
            assert checked >= 10, "the dashboard has fewer queries than the issue's panels need"

            page = f"{stack.base_url}/status"
            # Chromium runs in a thread: this event loop serves the page it loads.
            dom = (await asyncio.to_thread(chromium, browser, "--virtual-time-budget=10000", "--dump-dom", page)).stdout
            metrics = samples((await client.get("/metrics")).text)
            worker_metrics = samples((await client.get(f"http://{addresses['worker']}/metrics")).text)
            latency = {
                (kind, tier): await query(
                    client,
                    prom,
                    f'histogram_quantile(0.99, sum by (le) (tailcut_{kind}_seconds_bucket{{tier="{tier}"}}))',
                )
                for kind in ("ttft", "e2e")
                for tier in TIERS
            }
            screenshot = screenshot_path(tmp_path)
            size = ("--window-size=1400,820", f"--screenshot={screenshot}")
            await asyncio.to_thread(chromium, browser, "--virtual-time-budget=10000", *size, page)
    finally:
        stop_child(prometheus)

    parser = Fields()
    parser.feed(dom)
    assert parser.loaded, dom[:2000]
    shown = parser.fields
    assert shown["problems"] == "", shown["problems"]
    for tier in TIERS:
        met = total(metrics, "tailcut_slo_requests_total", tier=tier, result="met")
        missed = total(metrics, "tailcut_slo_requests_total", tier=tier, result="missed")
        assert met + missed > 0
        assert int(shown[f"tiers.{tier}.finished"]) == met + missed
        assert int(shown[f"tiers.{tier}.met"]) == met and int(shown[f"tiers.{tier}.missed"]) == missed
        assert shown[f"tiers.{tier}.attainment"] == f"{100 * met / (met + missed):.1f}%"
        for kind in ("ttft", "e2e"):
            (series,) = latency[kind, tier]
            expected_ms = float(series["value"][1]) * 1000
            assert not math.isnan(expected_ms)
            assert float(shown[f"tiers.{tier}.{kind}_p99_ms"]) == pytest.approx(expected_ms, abs=0.051), (kind, tier)
        state = total(metrics, "tailcut_breaker_state", tier=tier)
        assert shown[f"breakers.{tier}.state"] == BREAKER_STATES[int(state)]
        for bucket in BUCKETS:
            depth = total(metrics, "tailcut_queue_depth_requests", tier=tier, bucket=bucket)
            tokens = total(metrics, "tailcut_queued_tokens", tier=tier, bucket=bucket)
            assert int(shown[f"queues.{tier}.{bucket}.requests"]) == depth
            assert int(shown[f"queues.{tier}.{bucket}.tokens"]) == tokens
    (worker,) = stack.workers
    assert shown["workers.0.id"] == worker.worker_id
    assert shown["workers.0.engine"] == "vllm"
    assert int(shown["workers.0.running"]) == total(worker_metrics, "tailcut_worker_running_requests")
    assert int(shown["open_streams"]) == total(metrics, "tailcut_open_streams")
    assert screenshot.stat().st_size > 20_000, "the screenshot looks empty"
