"""The GPU memory monitor and the VRAM-leak detector, with a fake reader and clock (no GPU, no sleeps)."""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from workers.gpu_memory import MIB, GpuMemory, GpuMemoryMonitor, LeakDetector, nvml_reader

GIB = 1 << 30
TOTAL_BYTES = 80 * GIB
BASE_BYTES = 70 * GIB


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class FakeGpus:
    """A reader of ``len(used_bytes)`` GPUs whose used memory the test sets."""

    def __init__(self, *used_bytes: int) -> None:
        self.used_bytes = list(used_bytes)

    def __call__(self) -> list[GpuMemory]:
        return [
            GpuMemory(index, "FAKE-80GB", used, TOTAL_BYTES - used, TOTAL_BYTES)
            for index, used in enumerate(self.used_bytes)
        ]


class Warnings:
    def __init__(self) -> None:
        self.received: list[dict[str, object]] = []

    async def __call__(self, warning: dict[str, object]) -> None:
        self.received.append(warning)


def value(registry: CollectorRegistry, name: str, gpu: str = "0") -> float | None:
    return registry.get_sample_value(name, {"gpu": gpu})


class Rig:
    """A monitor of one fake GPU with the default leak detector, one sample a second on a fake clock."""

    def __init__(self, load: Callable[[], float] | None = None) -> None:
        self.gpus, self.clock, self.warnings, self.registry = (
            FakeGpus(BASE_BYTES),
            FakeClock(),
            Warnings(),
            CollectorRegistry(),
        )
        self.monitor = GpuMemoryMonitor(
            self.gpus,
            registry=self.registry,
            detector=LeakDetector(),
            load=load,
            on_warning=self.warnings,
            clock=self.clock,
        )

    async def drive(self, seconds: int, bytes_per_s: float) -> None:
        """One sample a second for ``seconds``, used memory changing by ``bytes_per_s``."""
        for _ in range(seconds):
            self.clock.now_s += 1.0
            self.gpus.used_bytes[0] += int(bytes_per_s)
            await self.monitor.sample_once()

    def suspected(self) -> float | None:
        return value(self.registry, "tailcut_gpu_memory_leak_suspected")

    def warnings_total(self) -> float | None:
        return value(self.registry, "tailcut_gpu_memory_leak_warnings_total")


async def test_the_gauges_carry_each_gpus_latest_reading() -> None:
    registry = CollectorRegistry()
    gpus = FakeGpus(10 * GIB, 20 * GIB)
    monitor = GpuMemoryMonitor(gpus, registry=registry)
    await monitor.sample_once()
    gpus.used_bytes[1] = 30 * GIB
    await monitor.sample_once()
    assert value(registry, "tailcut_gpu_memory_used_bytes", "0") == 10 * GIB
    assert value(registry, "tailcut_gpu_memory_free_bytes", "0") == 70 * GIB
    assert value(registry, "tailcut_gpu_memory_used_bytes", "1") == 30 * GIB, "the newest reading"
    assert value(registry, "tailcut_gpu_memory_free_bytes", "1") == 50 * GIB
    assert value(registry, "tailcut_gpu_memory_total_bytes", "1") == TOTAL_BYTES


async def test_the_log_file_gets_one_epoch_seconds_used_mib_line_per_gpu_per_sample(tmp_path: Path) -> None:
    log_path = tmp_path / "gpu.log"
    log_path.write_text("1717999999,1\n")
    gpus, wall = FakeGpus(20 * GIB, 512 * MIB + 123), FakeClock(1718000000.75)
    monitor = GpuMemoryMonitor(gpus, registry=CollectorRegistry(), log_path=log_path, wall_clock=wall)
    await monitor.sample_once()
    wall.now_s += 1.0
    gpus.used_bytes[0] += MIB
    await monitor.sample_once()
    assert log_path.read_text().splitlines() == [
        "1717999999,1",  # appended to, not overwritten
        "1718000000,20480",
        "1718000000,512",
        "1718000001,20481",
        "1718000001,512",
    ]


async def test_a_reader_that_raises_does_not_stop_the_loop() -> None:
    registry = CollectorRegistry()
    gpus = FakeGpus(10 * GIB)
    calls = 0
    recovered = asyncio.Event()

    def flaky() -> list[GpuMemory]:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("NVML hiccup")
        if calls >= 4:
            recovered.set()
        return gpus()

    monitor = GpuMemoryMonitor(flaky, registry=registry, interval_s=0.0)
    monitor.start()
    try:
        await asyncio.wait_for(recovered.wait(), timeout=5)
    finally:
        await monitor.stop()
    assert value(registry, "tailcut_gpu_memory_used_bytes") == 10 * GIB


async def test_a_failing_reader_logs_once_a_minute_not_every_sample(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> list[GpuMemory]:
        raise RuntimeError("GPU is lost")

    clock = FakeClock()
    monitor = GpuMemoryMonitor(broken, registry=CollectorRegistry(), clock=clock)
    with caplog.at_level(logging.WARNING, logger="tailcut.gpu"):
        for _ in range(120):
            await monitor.sample_once()
            clock.now_s += 1.0
    failures = [record for record in caplog.records if record.getMessage() == "gpu_memory_read_failed"]
    assert [record.fields["failures"] for record in failures] == [1, 60], "the first, then one a minute with the count"  # type: ignore[attr-defined]


def test_without_nvml_the_reader_is_none_and_one_line_says_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with caplog.at_level(logging.INFO, logger="tailcut.gpu"):
        assert nvml_reader() is None
    assert [(record.getMessage(), record.levelno) for record in caplog.records] == [
        ("gpu_memory_unavailable", logging.INFO)
    ]
    assert "pynvml" in caplog.records[0].fields["reason"]  # type: ignore[attr-defined]


def test_nvml_without_a_gpu_gives_no_reader(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetCount=lambda: 0,
        nvmlShutdown=lambda: calls.append("shutdown"),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with caplog.at_level(logging.INFO, logger="tailcut.gpu"):
        assert nvml_reader() is None
    assert calls == ["init", "shutdown"]
    assert [record.fields["reason"] for record in caplog.records] == ["NVML sees no GPU"]  # type: ignore[attr-defined]


def test_this_machines_nvml_reads_every_gpu_or_says_in_one_line_why_not(caplog: pytest.LogCaptureFixture) -> None:
    """The real pynvml: on a CPU machine (no driver) None and one line; on a GPU machine, real readings."""
    with caplog.at_level(logging.INFO, logger="tailcut.gpu"):
        reader = nvml_reader()
    if reader is None:
        assert [record.getMessage() for record in caplog.records] == ["gpu_memory_unavailable"]
        return
    readings = reader()
    assert readings and all(0 < gpu.used_bytes < gpu.total_bytes for gpu in readings)
    assert [gpu.index for gpu in readings] == list(range(len(readings)))


async def test_no_reader_registers_no_metric_families_and_starts_nothing() -> None:
    registry = CollectorRegistry()
    monitor = GpuMemoryMonitor(None, registry=registry, detector=LeakDetector())
    monitor.start()
    await monitor.sample_once()
    await monitor.stop()
    assert list(registry.collect()) == []


async def test_a_steady_climb_at_constant_load_warns_once() -> None:
    rig = Rig(load=lambda: 8.0)
    await rig.drive(600, bytes_per_s=2 * MIB)
    assert len(rig.warnings.received) == 1, "once, not every sample while it lasts"
    warning = rig.warnings.received[0]
    assert warning.keys() == {"type", "gpu", "slope_bytes_per_s", "window_s"}
    assert warning["type"] == "gpu_memory_leak" and warning["gpu"] == "0" and warning["window_s"] == 300.0
    assert warning["slope_bytes_per_s"] == pytest.approx(2 * MIB, rel=1e-3)
    assert rig.warnings_total() == 1
    assert rig.suspected() == 1


async def test_the_same_climb_while_the_load_changes_is_not_a_leak() -> None:
    samples = iter(range(1_000))
    rig = Rig(load=lambda: float(next(samples) // 60))  # one more running request a minute
    await rig.drive(600, bytes_per_s=2 * MIB)
    assert rig.warnings.received == []
    assert rig.suspected() == 0 and rig.warnings_total() == 0


async def test_a_flat_line_is_not_a_leak() -> None:
    rig = Rig()
    await rig.drive(600, bytes_per_s=0)
    assert rig.warnings.received == []
    assert rig.suspected() == 0


async def test_a_climb_shorter_than_the_window_is_not_a_leak_yet() -> None:
    rig = Rig()
    await rig.drive(300, bytes_per_s=2 * MIB)  # first sample to last: 299 s
    assert rig.warnings.received == [] and rig.suspected() == 0
    await rig.drive(1, bytes_per_s=2 * MIB)  # 300 s: the window is full
    assert len(rig.warnings.received) == 1


async def test_recovery_clears_the_gauge_and_a_new_climb_warns_again() -> None:
    rig = Rig()
    await rig.drive(400, bytes_per_s=2 * MIB)
    assert rig.suspected() == 1
    await rig.drive(400, bytes_per_s=0)
    assert rig.suspected() == 0, "flat again: cleared"
    assert len(rig.warnings.received) == 1
    await rig.drive(400, bytes_per_s=2 * MIB)
    assert len(rig.warnings.received) == 2 and rig.warnings_total() == 2


async def test_a_load_change_clears_a_suspected_leak() -> None:
    load = [3.0]
    rig = Rig(load=lambda: load[0])
    await rig.drive(400, bytes_per_s=2 * MIB)
    assert rig.suspected() == 1
    load[0] = 10.0
    await rig.drive(1, bytes_per_s=2 * MIB)
    assert rig.suspected() == 0


def test_a_slope_hovering_at_the_threshold_stays_one_suspicion() -> None:
    """Hysteresis: suspected at the threshold, cleared only under half of it."""
    detector = LeakDetector(window_s=10, min_slope_bytes_per_s=100, load_tolerance=0)
    verdicts = [detector.observe("0", t, 100 * t) for t in range(11)]
    assert verdicts[-1].suspected and verdicts[-1].changed and verdicts[-1].slope_bytes_per_s == pytest.approx(100)
    # 60 bytes/s from here: the fitted slope falls below 100 but stays above 50.
    verdicts = [detector.observe("0", t, 1000 + 60 * (t - 10)) for t in range(11, 21)]
    assert all(verdict.suspected for verdict in verdicts) and not any(verdict.changed for verdict in verdicts)
    assert verdicts[-1].slope_bytes_per_s == pytest.approx(60)
    # 40 bytes/s: under half the threshold, cleared.
    verdicts = [detector.observe("0", t, 1600 + 40 * (t - 20)) for t in range(21, 31)]
    assert not verdicts[-1].suspected and sum(verdict.changed for verdict in verdicts) == 1
