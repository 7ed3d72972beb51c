"""PNG plots of benchmark results: latency CDFs per tier and P99 against load, one line per policy or label.

Every plot carries a caller-given note under its title (how the numbers were made: "SIMULATOR (virtual
clock, cost model X)" or the live setup), so a picture cannot be taken for something it is not. Figures
are built without pyplot (no global state, no display) and saved by matplotlib's Agg renderer.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from queues.keys import TIERS


def plot_cdf(
    series: Mapping[str, Mapping[str, Sequence[float]]],
    metric: str,
    path: Path,
    *,
    note: str,
    log_x: bool = False,
) -> Path:
    """One panel per tier, one CDF line per label: ``series`` is ``{label: {tier: latencies_ms}}``
    (``bench.stats.by_tier`` gives the inner mapping); ``metric`` names the latency ("E2E", "TTFT")."""
    present = {tier for per_tier in series.values() for tier, values in per_tier.items() if len(values)}
    tiers = [tier for tier in TIERS if tier in present] + sorted(present - set(TIERS))
    fig = Figure(figsize=(5 * max(len(tiers), 1), 4))
    axes = fig.subplots(1, max(len(tiers), 1), squeeze=False)
    for ax, tier in zip(axes[0], tiers, strict=False):
        for label, per_tier in series.items():
            values = np.sort(np.asarray(per_tier.get(tier, []), dtype=float))
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
        ax.set_title(tier)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.01)
        if log_x:
            _plain_log_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{metric} CDF per tier\n{_wrap(note, 45 * max(len(tiers), 1))}")
    return _save(fig, path)


def plot_p99_vs_load(
    rows: Sequence[tuple[str, float, float]],
    path: Path,
    *,
    note: str,
    metric: str = "P99 E2E",
    load_label: str = "load (share of capacity)",
    floor_ms: Mapping[float, float] | None = None,
    log_y: bool = False,
) -> Path:
    """``rows`` of (label, load, p99_ms), one line per label; ``floor_ms`` ({load: ms}) draws what physics
    allows at each load as a short horizontal mark, so each figure is read against its floor."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for label in dict.fromkeys(row[0] for row in rows):
        points = sorted((load, p99_ms) for row_label, load, p99_ms in rows if row_label == label)
        ax.plot([load for load, _ in points], [p99 for _, p99 in points], marker="o", label=label)
    if floor_ms:
        loads = sorted(floor_ms)
        ax.plot(loads, [floor_ms[load] for load in loads], "_", color="black", markersize=24, label="floor")
    ax.set_xlabel(load_label)
    ax.set_ylabel(f"{metric} (ms)")
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(f"{metric} against load\n{_wrap(note, 80)}")
    return _save(fig, path)


def _wrap(note: str, width: int) -> str:
    """The note on as many lines as the figure's width needs."""
    return "\n".join(textwrap.fill(line, width) for line in note.splitlines())


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _plain_log_axis(ax: Axes) -> None:
    """A log x axis labelled 100, 200, 500, 1000 … in plain numbers: within a decade or two matplotlib's
    default labels the minor ticks as 3×10², 4×10² … and they run into each other."""
    ax.set_xscale("log")
    axis = ax.xaxis
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
