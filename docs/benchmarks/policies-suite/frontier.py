"""Every side run of issue 12 on seed-mix's seed-0 trace in one picture (SIMULATOR; reads files only).

The side runs' ``runs.txt`` files (``side-*/``) print one line per variant; where the variant ran on
seed-mix, the line ends with seed-mix's figures: ``realtime P99 TTFT / fifo at 90% X, realtime P99
E2E / floor at 90% X, background / fifo at 90% X, realtime P99 E2E / vllm-priority at 100% X,
background / vllm-priority at 100% X, realtime attainment at 100% X, realtime attainment at 120% X``.
This collects those of the suite's seed-0 360-second trace (``policies-suite-360s-capacity-30k/seed0``,
named by the command or heading above each line; a file that does not name its trace is skipped) and
plots background at 100% against the lower of the two realtime attainments, each point marked by
whether the line's list of missed targets names any of seed-mix's besides the three of the box (what
WORKLOADS.md asks at 100 and 120%).
From the repository root::

    .venv/bin/python docs/benchmarks/policies-suite/frontier.py docs/benchmarks/policies-suite/frontier

writes ``frontier.png`` and ``frontier.txt`` (every point, best background first) with that prefix.
Variants were run on the code of their own session; each point is a policy that ran on this trace.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
TRACE = re.compile(r"policies-suite(-360s-capacity-30k|-360s)?/(?:seed(\d|\$S|S)/)?suite\.json")
HEADING_SEED = re.compile(r"^(?:==|#+).*?\bseed (\d)\b")
FIGURES = {
    "ttft90": "realtime P99 TTFT / fifo at 90%",
    "tail90": "realtime P99 E2E / floor at 90%",
    "bg90": "background / fifo at 90%",
    "e2e100": "realtime P99 E2E / vllm-priority at 100%",
    "bg100": "background / vllm-priority at 100%",
    "att100": "realtime attainment at 100%",
    "att120": "realtime attainment at 120%",
}


# seed-mix's targets a variant may miss and still count as keeping the others: the box's three.
BOX_TARGETS = frozenset(
    {
        "100%: background throughput, tailcut / vllm-priority",
        "100%: realtime attainment, tailcut",
        "120%: realtime attainment, tailcut",
    }
)


@dataclass(frozen=True)
class Point:
    source: str
    variant: str
    figures: dict[str, float]
    missed: frozenset[str]  # seed-mix's targets the line says were missed (``bench.policies`` names)

    @property
    def attainment(self) -> float:
        return min(self.figures["att100"], self.figures["att120"])

    @property
    def meets_others(self) -> bool:
        """Every seed-mix target but (perhaps) the box's three."""
        return self.missed <= BOX_TARGETS

    @property
    def meets_all(self) -> bool:
        return not self.missed


def seed_mix_missed(line: str) -> frozenset[str]:
    """The targets the line's ``missed:`` list names for seed-mix (``seed-mix 100%: NAME = X; ...``)."""
    listed = line.split("missed: ", 1)[1].split(" ; ", 1)[0]
    items = (item.strip() for item in listed.split("; "))
    return frozenset(
        item.removeprefix("seed-mix ").rsplit(" = ", 1)[0] for item in items if item.startswith("seed-mix ")
    )


def points_of(path: Path) -> list[Point]:
    found: list[Point] = []
    trace: tuple[str, str] | None = None  # (suite, seed) the lines below ran on
    templated = False  # the trace was named as seedS: headings ("# seed 1", "== seed 2") say which
    for line in path.read_text().splitlines():
        if line.startswith(("$", "#", "==")):
            match = TRACE.search(line)
            if match:
                trace = (match.group(1) or "", match.group(2) or "")
                templated = trace[1] in ("$S", "S")
            heading = HEADING_SEED.match(line)
            if heading and trace and templated:
                trace = (trace[0], heading.group(1))
            continue
        if trace != ("-360s-capacity-30k", "0") or "seed-mix: " not in line:
            continue
        figures_text = line.rsplit("seed-mix: ", 1)[1]
        figures = {}
        for key, name in FIGURES.items():
            match = re.search(re.escape(name) + r" ([0-9.]+)", figures_text)
            if match:
                figures[key] = float(match.group(1))
        if len(figures) == len(FIGURES):
            variant = line.split(":", 1)[0]
            found.append(Point(str(path.relative_to(HERE)), variant, figures, seed_mix_missed(line)))
    return found


def main(prefix: str) -> None:
    points: dict[tuple[str, ...], Point] = {}
    for path in sorted(HERE.glob("side-*/*.txt")):
        for point in points_of(path):
            points.setdefault(tuple(f"{value:.4f}" for value in point.figures.values()), point)  # a repeat once
    ordered = sorted(points.values(), key=lambda point: -point.figures["bg100"])
    lines = [
        f"{len(ordered)} variants on seed-mix's seed-0 360-s trace (repeats once); columns: background / "
        "vllm-priority at 100%, min realtime attainment at 100 / 120%, realtime P99 E2E / floor at 90%, "
        "background / fifo at 90%, realtime P99 TTFT / fifo at 90%, meets: 'all' every seed-mix target, "
        "'90' every one but the box's three, '-' not those",
    ]
    for point in ordered:
        f = point.figures
        meets = "all" if point.meets_all else "90" if point.meets_others else "-"
        lines.append(
            f"{f['bg100']:.4f} {point.attainment:.4f} {f['tail90']:.3f} {f['bg90']:.3f} {f['ttft90']:.3f} "
            f"{meets:>3}  {point.variant}  ({point.source})"
        )
    Path(f"{prefix}.txt").write_text("\n".join(lines) + "\n")

    figure, axes = plt.subplots(figsize=(8, 5.5))
    for label, chosen, style in (
        ("misses another target", [p for p in ordered if not p.meets_others], dict(marker="x", color="0.6")),
        ("meets every other target", [p for p in ordered if p.meets_others], dict(marker="o", color="tab:blue")),
        ("meets all 14", [p for p in ordered if p.meets_all], dict(marker="*", color="tab:red", s=140)),
    ):
        xs, ys = [p.figures["bg100"] for p in chosen], [100 * p.attainment for p in chosen]
        axes.scatter(xs, ys, label=label, **style)
    axes.axvline(0.95, color="tab:red", linewidth=0.8)
    axes.axhline(99.0, color="tab:red", linewidth=0.8)
    axes.fill_between([0.95, 1.0], 99.0, 100.2, color="tab:red", alpha=0.08)
    axes.set_xlim(0.75, 1.0)
    axes.set_ylim(93.5, 100.2)
    axes.set_xlabel("background throughput at 100%, tailcut / vllm-priority")
    axes.set_ylabel("realtime attainment, lower of 100% and 120% (%)")
    axes.set_title(f"seed-mix, seed 0: {len(ordered)} policy variants (SIMULATOR); the box is the target")
    axes.legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(f"{prefix}.png", dpi=110)
    print(f"{len(ordered)} points; {sum(p.meets_all for p in ordered)} meet all 14: {prefix}.png, {prefix}.txt")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE / "frontier"))
