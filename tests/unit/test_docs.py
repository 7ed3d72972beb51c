"""The README documents every setting a process reads."""

from __future__ import annotations

from pathlib import Path

from api.settings import ApiSettings
from queues.jobs import JobsSettings
from workers.settings import EngineSettings, SchedulerSettings, WorkerSettings

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_readme_lists_every_environment_variable() -> None:
    names = [f"TAILCUT_{name.upper()}" for name in ApiSettings.model_fields]
    names += [f"TAILCUT_{name.upper()}" for name in WorkerSettings.model_fields if name not in ("engine", "scheduler")]
    names += [f"TAILCUT_ENGINE__{name.upper()}" for name in EngineSettings.model_fields]
    names += [f"TAILCUT_{name.upper()}" for name in JobsSettings.model_fields]
    names += ["TAILCUT_API_KEY"]  # read by `tailcut jobs submit`
    names += [f"TAILCUT_SCHEDULER__{name.upper()}" for name in SchedulerSettings.model_fields]
    missing = [name for name in names if f"`{name}`" not in README]
    assert not missing, f"document these in README.md's configuration table: {missing}"
