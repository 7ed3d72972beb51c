"""What ``tailcut chaos`` found: counts, the faults and what each cost, as a table and as one JSON object."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.chaos import TIERS, ChaosResult
from bench.chaos_client import StreamTrace

# The keys the issue names come first in --json, in this order.
HEADLINE = (
    "accepted",
    "completed",
    "degraded",
    "failed",
    "lost",
    "duplicate_chunks",
    "missing_tokens",
    "different_from_reference",
)


def outcome(trace: StreamTrace) -> str:
    if trace.terminal is None:
        return "lost"
    if trace.terminal == "error":
        return "failed"
    return "degraded" if trace.degraded else "completed"


def summary(result: ChaosResult) -> dict[str, Any]:
    accepted = [trace for trace in result.traces if trace.accepted]
    outcomes = [outcome(trace) for trace in accepted]
    completed = [trace for trace in accepted if outcome(trace) == "completed"]
    different = [trace for trace in completed if trace.token_ids() != result.references[trace.spec.index]]
    repeats = [trace for trace in accepted if trace.replayed_as is not None]
    repeat_violations = [
        trace
        for trace in repeats
        if trace.replayed_as != trace.request_id
        or (
            trace.replay_tokens is not None
            and outcome(trace) == "completed"
            and trace.replay_tokens != trace.token_ids()
        )
    ]
    killed = [fault for fault in result.faults if fault.kind == "kill_worker"]
    kills = [fault.next_token_s for fault in killed if fault.next_token_s is not None]
    kills_by_tier: dict[str, float] = {}
    for fault in killed:
        for tier, wait_s in fault.next_token_by_tier.items():
            kills_by_tier[tier] = max(kills_by_tier.get(tier, 0.0), wait_s)
    counts: dict[str, Any] = {
        "accepted": len(accepted),
        "completed": outcomes.count("completed"),
        "degraded": outcomes.count("degraded"),
        "failed": outcomes.count("failed"),
        "lost": outcomes.count("lost"),
        "duplicate_chunks": sum(trace.duplicates for trace in accepted),
        "missing_tokens": sum(trace.missing() for trace in accepted),
        "different_from_reference": len(different),
    }
    counts |= {
        "refused_before_acceptance": sum(1 for trace in result.traces if not trace.accepted),
        "refusals": sorted({str(trace.rejected_status) for trace in result.traces if not trace.accepted}),
        "resumed": sum(1 for trace in accepted if trace.resumes),
        "repeated_idempotency_keys": len(repeats),
        "idempotency_violations": len(repeat_violations),
        "failures": sorted({trace.error or "" for trace in accepted if outcome(trace) == "failed"}),
        "poison_sent": len(result.poison),
        "poison_answered_4xx": sum(1 for _what, _status, shaped in result.poison if shaped),
        "poison": [{"what": what, "status": status, "ok": shaped} for what, status, shaped in result.poison],
        "kill_to_next_token_s": {"max": max(kills, default=None), "each": kills, "by_tier": kills_by_tier},
        "faults": [asdict(fault) | {"at": None, "next_token_s": fault.next_token_s} for fault in result.faults],
        "job": {key: result.job.get(key) for key in ("status", "progress", "error")},
        "duration_s": result.config.duration_s,
        "load_s": round(result.load_s, 1),
        "ready_s": round(result.ready_s, 1),
        "workers": result.config.num_workers,
        "concurrency": result.config.concurrency,
        "seed": result.config.seed,
    }
    return counts


def print_summary(console: Console, counts: dict[str, Any]) -> None:
    table = Table(title=f"tailcut chaos: {counts['load_s']:.0f} s of load, {counts['workers']} workers, faults below")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in HEADLINE:
        style = (
            "bold red"
            if key in ("lost", "duplicate_chunks", "missing_tokens", "different_from_reference", "failed")
            and counts[key]
            else ""
        )
        table.add_row(key, f"[{style}]{counts[key]}[/]" if style else str(counts[key]))
    table.add_row("refused before acceptance (429/503)", str(counts["refused_before_acceptance"]))
    table.add_row("resumed after a drop or a fault", str(counts["resumed"]))
    table.add_row(
        "repeated Idempotency-Keys (violations)",
        f"{counts['repeated_idempotency_keys']} ({counts['idempotency_violations']})",
    )
    table.add_row("poison answered with a 4xx", f"{counts['poison_answered_4xx']} of {counts['poison_sent']}")
    kill = counts["kill_to_next_token_s"]["max"]
    by_tier = counts["kill_to_next_token_s"].get("by_tier", {})
    table.add_row(
        "worst kill → next token",
        "—" if kill is None else f"{kill:.2f} s" + (f" ({tier_waits(by_tier)})" if by_tier else ""),
    )
    table.add_row("batch job", str(counts["job"]["status"]))
    console.print(table)
    faults = Table(title="faults")
    faults.add_column("at")
    faults.add_column("fault")
    faults.add_column("what happened")
    for fault in counts["faults"]:
        extra = ""
        if fault.get("next_token_s") is not None:
            extra = f"; next token {fault['next_token_s']:.2f} s later"
            if fault.get("next_token_by_tier"):
                extra += f" ({tier_waits(fault['next_token_by_tier'])})"
        faults.add_row(f"{fault['at_s']:.0f} s", fault["kind"], fault["detail"] + extra)
    console.print(faults)
    if counts["failures"]:
        console.print("explicit failures: " + "; ".join(counts["failures"]))


def tier_waits(by_tier: dict[str, float]) -> str:
    """``realtime 0.41 s, background 22.90 s``: per tier, in the tiers' order."""
    tiers = sorted(by_tier, key=lambda tier: (TIERS.index(tier) if tier in TIERS else len(TIERS), tier))
    return ", ".join(f"{tier} {by_tier[tier]:.2f} s" for tier in tiers)
