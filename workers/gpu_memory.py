"""GPU memory every second from NVML, as Prometheus gauges and an optional plain log, with a VRAM-leak detector.

- **Reading**: a ``Reader`` returns one ``GpuMemory`` per GPU. ``nvml_reader()`` builds one from NVML
  (``pynvml``); without NVML (a CPU machine, no driver, no device) it logs one
  ``gpu_memory_unavailable`` line saying why and returns None — the monitor then does nothing and
  registers no metric families.
- **Metrics** (``gpu`` is the NVML index): ``tailcut_gpu_memory_used_bytes``, ``..._free_bytes``,
  ``..._total_bytes``, ``tailcut_gpu_memory_leak_suspected`` (1 while a leak is suspected, else 0) and
  ``tailcut_gpu_memory_leak_warnings_total``.
- **Leak**: memory that keeps growing while the work stays the same. vLLM allocates its weights and
  KV cache up front, so at a constant load used memory is flat; ``LeakDetector`` fits a least-squares
  slope over a sliding window per GPU and suspects a leak when the slope is steep and the load did not
  move. The monitor warns once per episode (``on_warning``, a log line, the counter), not every sample.

A reading that fails is logged (at most once a minute, with the count) and the loop carries on: the
monitor never takes the worker down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from tailcut.logs import log_event

log = logging.getLogger("tailcut.gpu")

MIB = 1 << 20
# A failing reading is logged at most this often (the loop samples every second).
ERROR_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class GpuMemory:
    index: int
    name: str
    used_bytes: int
    free_bytes: int
    total_bytes: int


Reader = Callable[[], list[GpuMemory]]
WarningSink = Callable[[dict[str, object]], Awaitable[None]]


def nvml_reader() -> Reader | None:
    """A reader of every GPU NVML sees, or None (logged once, with the reason) when there is none."""
    try:
        import pynvml
    except ImportError as error:
        log_event(log, "gpu_memory_unavailable", reason=f"pynvml is not installed ({error})")
        return None
    try:
        pynvml.nvmlInit()
        num_gpus = int(pynvml.nvmlDeviceGetCount())
        if num_gpus == 0:
            pynvml.nvmlShutdown()
            log_event(log, "gpu_memory_unavailable", reason="NVML sees no GPU")
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(num_gpus)]
        names = [_text(pynvml.nvmlDeviceGetName(handle)) for handle in handles]
    except pynvml.NVMLError as error:
        log_event(log, "gpu_memory_unavailable", reason=f"NVML: {error}")
        return None

    def read() -> list[GpuMemory]:
        readings = []
        for index, (handle, name) in enumerate(zip(handles, names, strict=True)):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(GpuMemory(index, name, int(memory.used), int(memory.free), int(memory.total)))
        return readings

    log_event(log, "gpu_memory_monitored", gpus=",".join(f"{index}:{name}" for index, name in enumerate(names)))
    return read


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class LeakVerdict:
    """The detector's view of one GPU after a sample."""

    suspected: bool
    # True on the sample where ``suspected`` flipped (either way).
    changed: bool
    # None until the window spans ``window_s``.
    slope_bytes_per_s: float | None


@dataclass(slots=True)
class _Window:
    samples: deque[tuple[float, int, float]] = field(default_factory=deque)  # (t_s, used_bytes, load)
    suspected: bool = False


class LeakDetector:
    """Suspects a VRAM leak on a GPU whose used memory climbs while the load stays the same (pure).

    Defaults: a climb of at least 1 MiB/s sustained over 5 minutes (300 MiB) at a load that moved by no
    more than 1 (the worker's unit: running requests). vLLM's weights and KV cache are allocated at
    start-up, so a healthy worker is flat at a steady load; the caching allocator's step-wise growth
    (2-20 MiB blocks) fits a slope far below 1 MiB/s over 5 minutes, while a real 1 MiB/s leak is
    3.5 GiB an hour — an out-of-memory within hours on a GPU that vLLM filled to 90%. Five minutes of
    one sample a second smooths the bursts a prefill makes. A load that changes explains the growth
    (more sequences, larger activations), so it is not suspected; without a load signal (always 0)
    the slope alone decides. A suspicion clears when the load moves or the slope falls under half the
    threshold (hysteresis: a slope hovering at the threshold warns once, not on every crossing).
    """

    def __init__(
        self, window_s: float = 300.0, min_slope_bytes_per_s: float = 1.0 * MIB, load_tolerance: float = 1.0
    ) -> None:
        if window_s <= 0 or min_slope_bytes_per_s <= 0 or load_tolerance < 0:
            raise ValueError(
                f"LeakDetector needs window_s > 0, min_slope_bytes_per_s > 0 and load_tolerance >= 0, got "
                f"{window_s}, {min_slope_bytes_per_s}, {load_tolerance}"
            )
        self.window_s = window_s
        self.min_slope_bytes_per_s = min_slope_bytes_per_s
        self.load_tolerance = load_tolerance
        self._windows: dict[str, _Window] = {}

    def observe(self, gpu: str, t_s: float, used_bytes: int, load: float = 0.0) -> LeakVerdict:
        window = self._windows.setdefault(gpu, _Window())
        samples = window.samples
        samples.append((t_s, used_bytes, load))
        # Keep the newest sample at least ``window_s`` old as the oldest: the window spans ``window_s``.
        while len(samples) > 2 and t_s - samples[1][0] >= self.window_s:
            samples.popleft()
        if t_s - samples[0][0] < self.window_s:
            return LeakVerdict(suspected=window.suspected, changed=False, slope_bytes_per_s=None)
        slope = _slope(samples)
        loads = [sample[2] for sample in samples]
        steady = max(loads) - min(loads) <= self.load_tolerance
        if window.suspected:
            suspected = steady and slope >= self.min_slope_bytes_per_s / 2
        else:
            suspected = steady and slope >= self.min_slope_bytes_per_s
        changed = suspected != window.suspected
        window.suspected = suspected
        return LeakVerdict(suspected=suspected, changed=changed, slope_bytes_per_s=slope)


def _slope(samples: deque[tuple[float, int, float]]) -> float:
    """Least-squares slope of used bytes over time (times taken from the first, for precision)."""
    t0 = samples[0][0]
    count = len(samples)
    mean_t = sum(t - t0 for t, _, _ in samples) / count
    mean_used = sum(used for _, used, _ in samples) / count
    covariance = sum((t - t0 - mean_t) * (used - mean_used) for t, used, _ in samples)
    variance = sum((t - t0 - mean_t) ** 2 for t, _, _ in samples)
    return covariance / variance if variance > 0 else 0.0


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.used = Gauge("tailcut_gpu_memory_used_bytes", "GPU memory in use (NVML).", ["gpu"], registry=registry)
        self.free = Gauge("tailcut_gpu_memory_free_bytes", "GPU memory free (NVML).", ["gpu"], registry=registry)
        self.total = Gauge("tailcut_gpu_memory_total_bytes", "GPU memory in all (NVML).", ["gpu"], registry=registry)
        self.leak_suspected = Gauge(
            "tailcut_gpu_memory_leak_suspected",
            "1 while used memory climbs at a steady load (a suspected VRAM leak), else 0.",
            ["gpu"],
            registry=registry,
        )
        self.leak_warnings = Counter(
            "tailcut_gpu_memory_leak_warnings_total",
            "Times a VRAM leak became suspected.",
            ["gpu"],
            registry=registry,
        )


class GpuMemoryMonitor:
    """Samples every GPU each ``interval_s`` into gauges, an optional log file and the leak detector.

    ``log_path`` gets the source tool's plain lines, appended, one per GPU per sample in index order:
    ``<epoch seconds, integer>,<used MiB, integer>`` (``1718000000,20480``), no header. With no reader
    (``nvml_reader()`` found no GPU) nothing is registered and ``start()`` starts nothing.
    """

    def __init__(
        self,
        reader: Reader | None,
        *,
        registry: CollectorRegistry,
        interval_s: float = 1.0,
        log_path: Path | None = None,
        detector: LeakDetector | None = None,
        load: Callable[[], float] | None = None,
        on_warning: WarningSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.reader = reader
        self.interval_s = interval_s
        self.log_path = log_path
        self.detector = detector
        self.load = load
        self.on_warning = on_warning
        self.clock = clock
        self.wall_clock = wall_clock
        self._metrics = _Metrics(registry) if reader is not None else None
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._last_failure_log_s: float | None = None

    def start(self) -> None:
        if self.reader is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="gpu-memory-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    async def sample_once(self) -> None:
        """One sample: read, publish, log, detect. A failure is logged (rate-limited), never raised."""
        if self.reader is None or self._metrics is None:
            return
        now_s = self.clock()
        try:
            readings = self.reader()
            load = self.load() if self.load is not None else 0.0
        except Exception as error:
            self._failed("gpu_memory_read_failed", error)
            return
        for reading in readings:
            gpu = str(reading.index)
            self._metrics.used.labels(gpu=gpu).set(reading.used_bytes)
            self._metrics.free.labels(gpu=gpu).set(reading.free_bytes)
            self._metrics.total.labels(gpu=gpu).set(reading.total_bytes)
        if self.log_path is not None:
            self._append_log(self.log_path, readings)
        if self.detector is not None:
            for reading in readings:
                await self._detect(self.detector, self._metrics, str(reading.index), now_s, reading.used_bytes, load)

    def _failed(self, event: str, error: Exception) -> None:
        """Logs the first failure, then at most one line each ``ERROR_LOG_INTERVAL_S`` with the count since."""
        self._failures += 1
        now_s = self.clock()
        if self._last_failure_log_s is not None and now_s - self._last_failure_log_s < ERROR_LOG_INTERVAL_S:
            return
        log_event(log, event, logging.WARNING, error=f"{type(error).__name__}: {error}", failures=self._failures)
        self._last_failure_log_s = now_s
        self._failures = 0

    def _append_log(self, path: Path, readings: list[GpuMemory]) -> None:
        epoch_s = int(self.wall_clock())
        lines = "".join(f"{epoch_s},{reading.used_bytes // MIB}\n" for reading in readings)
        try:
            with path.open("a") as file:
                file.write(lines)
        except OSError as error:
            self._failed("gpu_memory_log_failed", error)

    async def _detect(
        self, detector: LeakDetector, metrics: _Metrics, gpu: str, now_s: float, used_bytes: int, load: float
    ) -> None:
        verdict = detector.observe(gpu, now_s, used_bytes, load)
        warnings_total = metrics.leak_warnings.labels(gpu=gpu)  # at 0 from the first sample, not the first leak
        metrics.leak_suspected.labels(gpu=gpu).set(1 if verdict.suspected else 0)
        if not verdict.changed:
            return
        if not verdict.suspected:
            log_event(log, "gpu_memory_leak_cleared", gpu=gpu, slope_bytes_per_s=verdict.slope_bytes_per_s)
            return
        warnings_total.inc()
        slope = round(verdict.slope_bytes_per_s or 0.0, 1)
        log_event(log, "gpu_memory_leak_suspected", logging.WARNING, gpu=gpu, slope_bytes_per_s=slope)
        if self.on_warning is None:
            return
        warning: dict[str, object] = {
            "type": "gpu_memory_leak",
            "gpu": gpu,
            "slope_bytes_per_s": slope,
            "window_s": detector.window_s,
        }
        try:
            await self.on_warning(warning)
        except Exception as error:
            log_event(log, "gpu_memory_warning_failed", logging.WARNING, error=f"{type(error).__name__}: {error}")
