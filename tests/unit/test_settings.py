"""One source for each default: settings read theirs from the typed configs, and the README's
configuration table states every setting with its real default."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from admission.config import AdmissionConfig
from admission.settings import AdmissionSettings
from api.settings import ApiSettings
from jobs.settings import JobsSettings
from tailcut.jobs_cli import API_KEY_ENV
from workers.degrade import DegradeConfig
from workers.scheduling import SchedulerConfig
from workers.settings import DegradeSettings, EngineSettings, SchedulerSettings, WorkerSettings, engine_block_size

README = (Path(__file__).parents[2] / "README.md").read_text()
# `| `TAILCUT_NAME` | default | meaning |` rows of the configuration table.
ROW = re.compile(r"^\| `(TAILCUT_[A-Z0-9_]+)` \| ([^|]*) \|", re.MULTILINE)
# Environment variables read outside the settings classes (by `tailcut jobs submit`).
OTHER_VARIABLES = {API_KEY_ENV}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TAILCUT_"):
            monkeypatch.delenv(name)


def test_settings_defaults_are_the_typed_configs_defaults() -> None:
    assert AdmissionSettings().admission_config() == AdmissionConfig()
    assert SchedulerSettings().config() == SchedulerConfig()
    assert EngineSettings().long_prefill_token_threshold == SchedulerConfig().prefill_chunk_tokens
    # The engine's block size comes from the engine settings (16 but for vLLM on CPU).
    assert WorkerSettings(engine=EngineSettings(kind="sim")).scheduler_config() == SchedulerConfig()
    engine = EngineSettings()
    assert WorkerSettings().scheduler_config() == replace(SchedulerConfig(), kv_block_tokens=engine_block_size(engine))
    assert DegradeSettings().config() == DegradeConfig()


def test_the_scheduler_counts_kv_in_the_engines_blocks() -> None:
    assert engine_block_size(EngineSettings(block_size=64)) == 64
    assert engine_block_size(EngineSettings(device="cpu")) == 32
    assert engine_block_size(EngineSettings(device="cuda")) == 16
    assert engine_block_size(EngineSettings(kind="sim")) == 16
    settings = WorkerSettings(engine=EngineSettings(device="cpu"), scheduler=SchedulerSettings(kv_reservation="max"))
    config = settings.scheduler_config()
    assert (config.kv_block_tokens, config.kv_reservation) == (32, "max")


def settings_fields() -> Iterator[tuple[str, type[BaseModel], str]]:
    """(environment variable, settings class, field) of every setting a process reads, nested
    groups (``TAILCUT_ENGINE__NAME``) included."""
    for cls in (ApiSettings, WorkerSettings, JobsSettings):
        for name, field in cls.model_fields.items():
            nested = field.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                for inner in nested.model_fields:
                    yield f"TAILCUT_{name.upper()}__{inner.upper()}", nested, inner
            else:
                yield f"TAILCUT_{name.upper()}", cls, name


def written(value: object) -> set[str]:
    """How a default may be written in the table."""
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, float):
        return {repr(value), f"{value:g}"} | ({str(int(value))} if value.is_integer() else set())
    if isinstance(value, list | tuple | dict):
        return {json.dumps(value), json.dumps(value, separators=(",", ":"))}
    return {str(value)}


def test_readme_table_states_every_setting_with_its_real_default() -> None:
    table = dict(ROW.findall(README))
    missing = sorted({env for env, _cls, _name in settings_fields()} - set(table))
    assert not missing, f"document these in README.md's configuration table: {missing}"
    wrong = []
    for env, cls, name in settings_fields():
        default = cls.model_fields[name].default
        if default is None or default is PydanticUndefined:
            continue  # computed at start (a default_factory) or derived: the table says how, in words
        if not any(f"`{text}`" in table[env] for text in written(default)):
            wrong.append(f"{env}: table says {table[env].strip()!r}, {cls.__name__} defaults to {default!r}")
    assert not wrong, "fix README.md's configuration table:\n" + "\n".join(wrong)


def test_readme_table_lists_no_setting_that_does_not_exist() -> None:
    known = {env for env, _cls, _name in settings_fields()} | OTHER_VARIABLES
    stale = sorted(set(dict(ROW.findall(README))) - known)
    assert not stale, f"README.md's configuration table lists settings no process reads: {stale}"
