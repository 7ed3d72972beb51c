"""API keys in Redis (TAILCUT_AUTH_REQUIRED) on a real Redis, with a worker on the null engine: the key
decides the tenant and the tiers, a revoked key is refused within a second, the admin route needs an
admin key, and Redis never holds a key itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.settings import ApiSettings
from queues import requests
from queues.apikeys import KEY_PATTERN, KeyStore
from tailcut.logs import formatter
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.stack import Stack, running_api, running_stack
from workers.engines.factory import start_engine
from workers.settings import EngineSettings

SECRET = "a-long-random-deployment-secret"
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 4, "stream": False}


@pytest.fixture
async def stack(redis_url: str, tiny_model: Path) -> AsyncIterator[Stack]:
    engine = start_engine(EngineSettings(kind="null", null_step_ms=1), tiny_model, TEST_MAX_MODEL_LEN)
    try:
        async with running_stack(
            redis_url, tiny_model, engine, auth_required=True, auth_secret=SECRET, admin_key=None
        ) as running:
            yield running
    finally:
        await engine.shutdown()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admitted(metrics: str) -> dict[str, float]:
    return {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tailcut_requests_admitted_total" and sample.value
    }


async def test_without_a_valid_key_only_the_probes_answer(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    key, _ = await store.create("acme")
    other_deployment, _ = await KeyStore(stack.redis, stack.keys, "another-secret").create("acme")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        for headers in ({}, bearer("sk-nothing"), bearer(key[:-1] + "x"), bearer(other_deployment)):
            refused = await client.post("/v1/completions", json=BODY, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["type"] == "authentication_error"
        for path in ("/v1/models", "/v1/jobs/nope", "/v1/requests/nope"):
            assert (await client.get(path)).status_code == 401, path
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code in (200, 503)
        # The API's description is public (the same for every caller, no tenant's data in it).
        assert "/v1/completions" in (await client.get("/openapi.json")).json()["paths"]
        answered = await client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert answered.status_code == 200, answered.text


async def test_the_key_decides_the_tenant_and_the_tiers(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    chat_key, _ = await store.create("acme", tiers=["realtime", "normal"])
    batch_key, _ = await store.create("globex", tiers=["background"], downgrade=True)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        spoofed = {**BODY, "user": "globex", "tier": "realtime"}
        answer = await client.post(
            "/v1/completions", json=spoofed, headers={**bearer(chat_key), "X-Tailcut-Tenant": "x"}
        )
        assert answer.status_code == 200, answer.text
        record = await requests.load(stack.redis, stack.keys, answer.headers["x-tailcut-request-id"])
        assert record is not None and record.tenant == "acme"
        refused = await client.post("/v1/completions", json={**BODY, "tier": "background"}, headers=bearer(chat_key))
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["param"] == "tier" and "realtime, normal" in refused.json()["error"]["message"]
        job = await client.post(
            "/v1/jobs", json={"lines": ["a", "b"], "instruction": "x", "max_tokens": 2}, headers=bearer(chat_key)
        )
        assert job.status_code == 403, job.text
        downgraded = await client.post("/v1/completions", json={**BODY, "tier": "realtime"}, headers=bearer(batch_key))
        assert downgraded.status_code == 200, downgraded.text
        record = await requests.load(stack.redis, stack.keys, downgraded.headers["x-tailcut-request-id"])
        assert record is not None and record.tenant == "globex"
        ops, _ = await store.create("ops", admin=True)  # with keys on, /metrics wants an admin key
        metrics = (await client.get("/metrics", headers=bearer(ops))).text
    assert admitted(metrics) == {"realtime": 1.0, "background": 1.0}


async def test_a_revoked_key_is_refused_within_a_second(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    key, record = await store.create("acme")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        assert (await client.post("/v1/completions", json=BODY, headers=bearer(key))).status_code == 200
        assert await store.revoke(record.key_id)
        revoked_at = asyncio.get_running_loop().time()
        while (await client.post("/v1/completions", json=BODY, headers=bearer(key))).status_code == 200:
            assert asyncio.get_running_loop().time() - revoked_at < 1.5, "a revoked key still worked after 1.5 s"
            await asyncio.sleep(0.05)


async def test_admin_routes_need_an_admin_key_and_redis_never_holds_a_key(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    plain, _ = await store.create("acme")
    admin, _ = await store.create("ops", admin=True)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        assert (await client.get("/debug/stacks")).status_code == 401
        forbidden = await client.get("/debug/stacks", headers=bearer(plain))
        assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
        allowed = await client.get("/debug/stacks", headers=bearer(admin))
        assert allowed.status_code == 200 and "Task" in allowed.text
    held: list[bytes] = []
    async for name in stack.redis.scan_iter(match=f"{stack.keys.prefix}*"):
        kind = await stack.redis.type(name)
        if kind == b"hash":
            held += [*(await stack.redis.hgetall(name)).values()]
        elif kind == b"string":
            held.append(await stack.redis.get(name))
        elif kind == b"set":
            held += list(await stack.redis.smembers(name))
    assert held, "nothing was read: the check proves nothing"
    for key in (plain, admin):
        secret_part = key.split("_", 2)[2].encode()  # the secret may hold "_" itself
        assert len(secret_part) == 43
        assert not [value for value in held if secret_part in value], "a key is stored in Redis"


async def test_a_tenant_reads_only_its_own_requests_and_jobs(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    acme, _ = await store.create("acme")
    globex, _ = await store.create("globex")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        answer = await client.post("/v1/completions", json=BODY, headers={**bearer(acme), "Idempotency-Key": "k1"})
        assert answer.status_code == 200, answer.text
        request_id = answer.headers["x-tailcut-request-id"]
        own = await client.get(f"/v1/requests/{request_id}", params={"stream": "false"}, headers=bearer(acme))
        assert own.status_code == 200, own.text
        for params, headers in (
            ({"stream": "false"}, {}),
            ({}, {"Last-Event-ID": "1"}),
            ({"stream": "false"}, {"X-Tailcut-Tenant": "acme"}),  # the header is not what decides
        ):
            theirs = await client.get(
                f"/v1/requests/{request_id}", params=params, headers={**bearer(globex), **headers}
            )
            assert theirs.status_code == 404, theirs.text
        job = await client.post(
            "/v1/jobs", json={"lines": ["a", "b"], "instruction": "x", "max_tokens": 2}, headers=bearer(acme)
        )
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]
        assert (await client.get(f"/v1/jobs/{job_id}", headers=bearer(acme))).status_code == 200
        assert (await client.get(f"/v1/jobs/{job_id}", headers=bearer(globex))).status_code == 404
        assert (await client.delete(f"/v1/jobs/{job_id}", headers=bearer(globex))).status_code == 404
        assert (await client.get(f"/v1/jobs/{job_id}", headers=bearer(acme))).json()["status"] != "aborted"


async def test_cached_answers_stay_with_the_keys_tenant(redis_url: str, tiny_model: Path) -> None:
    engine = start_engine(EngineSettings(kind="null", null_step_ms=1), tiny_model, TEST_MAX_MODEL_LEN)
    greedy = {**BODY, "temperature": 0}
    try:
        async with running_stack(
            redis_url, tiny_model, engine, auth_required=True, auth_secret=SECRET, cache_enabled=True
        ) as stack:
            store = KeyStore(stack.redis, stack.keys, SECRET)
            acme, _ = await store.create("acme")
            globex, _ = await store.create("globex")
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                for _ in range(2):  # the second is the K-th reference: stored
                    assert (await client.post("/v1/completions", json=greedy, headers=bearer(acme))).status_code == 200
                async with asyncio.timeout(5):
                    while not await stack.redis.zcard(stack.keys.answer_index()):
                        await asyncio.sleep(0.02)
                spoofing = {**greedy, "user": "acme"}
                theirs = await client.post("/v1/completions", json=spoofing, headers=bearer(globex))
                own = await client.post("/v1/completions", json=greedy, headers=bearer(acme))
    finally:
        await engine.shutdown()
    assert theirs.status_code == 200 and "tailcut" not in theirs.json(), theirs.json()
    assert own.json().get("tailcut") == {"cache": "hit"}, own.json()


async def test_limits_are_enforced_per_tenant_with_retry_after(stack: Stack) -> None:
    store = KeyStore(stack.redis, stack.keys, SECRET)
    few, _ = await store.create("acme", limits={"requests_per_minute": 3})
    other, _ = await store.create("globex")
    small, _ = await store.create("initech", limits={"tokens_per_minute": 30})
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        for _ in range(3):
            assert (await client.post("/v1/completions", json=BODY, headers=bearer(few))).status_code == 200
        refused = await client.post("/v1/completions", json=BODY, headers=bearer(few))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "requests per minute" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert (await client.post("/v1/completions", json=BODY, headers=bearer(other))).status_code == 200
        # 9 prompt + 4 output tokens each: two fit in 30, the third does not.
        for _ in range(2):
            assert (await client.post("/v1/completions", json=BODY, headers=bearer(small))).status_code == 200
        assert (await client.post("/v1/completions", json=BODY, headers=bearer(small))).status_code == 429
        too_large = await client.post("/v1/completions", json={**BODY, "max_tokens": 40}, headers=bearer(small))
        assert too_large.status_code == 400 and too_large.json()["error"]["param"] == "max_tokens", too_large.text
        ops, _ = await store.create("ops", admin=True)  # with keys on, /metrics wants an admin key
        metrics = (await client.get("/metrics", headers=bearer(ops))).text
    assert 'tailcut_tenant_limited_total{limit="requests_per_minute"} 1.0' in metrics
    assert 'tailcut_tenant_limited_total{limit="tokens_per_minute"} 1.0' in metrics


async def test_a_tenant_runs_no_more_requests_at_once_than_its_limit(redis_url: str, tiny_model: Path) -> None:
    engine = start_engine(EngineSettings(kind="null", null_step_ms=20), tiny_model, TEST_MAX_MODEL_LEN)
    try:
        async with running_stack(redis_url, tiny_model, engine, auth_required=True, auth_secret=SECRET) as stack:
            key, _ = await KeyStore(stack.redis, stack.keys, SECRET).create("acme", limits={"concurrent_requests": 1})
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
                slow = asyncio.create_task(
                    client.post("/v1/completions", json={**BODY, "max_tokens": 50}, headers=bearer(key))
                )
                await asyncio.sleep(0.3)  # accepted, and running (a token each 20 ms)
                second = await client.post("/v1/completions", json=BODY, headers=bearer(key))
                assert second.status_code == 429 and "at once" in second.json()["error"]["message"], second.text
                assert (await slow).status_code == 200
                async with asyncio.timeout(5):  # released once its reply ended
                    while (await client.post("/v1/completions", json=BODY, headers=bearer(key))).status_code != 200:
                        await asyncio.sleep(0.05)
    finally:
        await engine.shutdown()


async def test_two_api_processes_share_a_tenants_limits(stack: Stack, tiny_model: Path) -> None:
    """The limits live in Redis: a tenant's requests per minute are counted across both API instances."""
    second = ApiSettings(
        redis_url=stack.api_settings.redis_url,
        key_prefix=stack.keys.prefix,
        model=str(tiny_model),
        auth_required=True,
        auth_secret=SECRET,
    )
    few, _ = await KeyStore(stack.redis, stack.keys, SECRET).create("acme", limits={"requests_per_minute": 3})
    async with (
        running_api(second, tiny_model) as other,
        httpx.AsyncClient(base_url=stack.base_url, timeout=30) as one,
        httpx.AsyncClient(base_url=other.base_url, timeout=30) as two,
    ):
        answers = [await client.post("/v1/completions", json=BODY, headers=bearer(few)) for client in (one, two, one)]
        assert [answer.status_code for answer in answers] == [200, 200, 200]
        refused = await two.post("/v1/completions", json=BODY, headers=bearer(few))
    assert refused.status_code == 429 and "requests per minute" in refused.json()["error"]["message"], refused.text


async def test_a_key_without_realtime_never_runs_at_realtime_priority(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Checked where it matters, at the worker: the request asked for realtime with a background-only
    key that downgrades, and the worker read it from the background tier's stream and ran it there."""
    caplog.set_level(logging.INFO, logger="tailcut.worker")
    batch_key, _ = await KeyStore(stack.redis, stack.keys, SECRET).create(
        "globex", tiers=["background"], downgrade=True
    )
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        answer = await client.post("/v1/completions", json={**BODY, "tier": "realtime"}, headers=bearer(batch_key))
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["x-tailcut-request-id"]

    def finals() -> list[str]:
        return [
            record.fields["tier"]  # type: ignore[attr-defined]
            for record in caplog.records
            if record.getMessage() == "request_final" and record.fields["rid"] == request_id  # type: ignore[attr-defined]
        ]

    async with asyncio.timeout(5):  # the worker logs it just after it wrote the reply's end
        while not finals():
            await asyncio.sleep(0.02)
    assert finals() == ["background"]


async def test_no_key_prompt_or_completion_text_reaches_the_logs(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """Every log line of a run (API, worker, Redis helpers; the default INFO level, as the processes
    write them) holds none of: the key's secret, the prompt's text, the completion's text."""
    caplog.set_level(logging.INFO)
    key, _ = await KeyStore(stack.redis, stack.keys, SECRET).create("acme")
    prompt = "my account number is 4242-SECRET-PROMPT-7777, please"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        whole = await client.post("/v1/completions", json=body, headers=bearer(key))
        await asyncio.sleep(0.2)  # the worker's last lines about it
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=bearer(key)) as s:
            assert s.status_code == 200
            await s.aread()
        refused = await client.post("/v1/completions", json={**body, "temperature": -1}, headers=bearer(key))
        bad_key = await client.post("/v1/completions", json=body, headers=bearer(key[:-4] + "zzzz"))
    assert whole.status_code == 200 and refused.status_code == 400 and bad_key.status_code == 401
    completion = whole.json()["choices"][0]["text"]
    assert len(completion.strip()) >= 8, completion  # enough text that finding it would mean something
    lines = [formatter("json").format(record) + " " + formatter("text").format(record) for record in caplog.records]
    assert any("request_final" in line for line in lines)  # the run's lines were captured
    # The secret is URL-safe base64 and may itself hold "_": take it by the key's pattern, not by the last "_".
    match = KEY_PATTERN.match(key)
    assert match is not None, key
    secret = match.group(2)
    assert len(secret) == 43, secret
    for needle in (key, secret, prompt, "4242-SECRET-PROMPT-7777", completion.strip()):
        found = [line for line in lines if needle in line]
        assert not found, (needle, found[:2])
