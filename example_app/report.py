"""The demo's figures: what each pass of the load cost, and the table that compares two."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .load import Load, Run, planned_leavers


@dataclass(frozen=True)
class EngineConfig:
    step_time: float = 0.01
    max_batch_size: int = 8


@dataclass(frozen=True)
class Summary:
    wasted: float
    generated: float
    aborted: float
    left: int
    stayed: int
    p50: float
    p99: float
    throughput: float
    errors: int


def summarize(run: Run) -> Summary:
    stayed = [result for result in run.results if result.plan.leave is None]
    latencies = sorted(result.latency for result in stayed) or [0.0]
    tokens = sum(result.tokens for result in stayed)
    last = max((result.finished_at for result in stayed), default=0.0)
    return Summary(
        wasted=run.final["example_engine_tokens_wasted_total"],
        generated=run.final["example_engine_tokens_generated_total"],
        aborted=run.final["example_engine_requests_aborted_total"],
        left=sum(result.outcome in ("timed out", "closed") for result in run.results),
        stayed=len(stayed),
        p50=statistics.median(latencies),
        p99=percentile(latencies, 0.99),
        throughput=tokens / last if last else 0.0,
        errors=sum(result.outcome.startswith("error") for result in run.results),
    )


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def format_table(load: Load, engine: EngineConfig, server: str, runs: list[Run]) -> str:
    summaries = [summarize(run) for run in runs]
    planned = planned_leavers(load)
    rows = [
        ("tokens wasted on departed clients", [f"{s.wasted:,.0f}" for s in summaries]),
        (
            "  share of all tokens generated",
            [f"{s.wasted / s.generated:.0%}" if s.generated else "-" for s in summaries],
        ),
        ("engine requests aborted", [f"{s.aborted:,.0f}" for s in summaries]),
        ("clients that left early", [str(s.left) for s in summaries]),
        ("stayed clients: p50 latency", [f"{s.p50:.2f} s" for s in summaries]),
        ("stayed clients: p99 latency", [f"{s.p99:.2f} s" for s in summaries]),
        ("stayed clients: throughput", [f"{s.throughput:,.0f} tok/s" for s in summaries]),
        ("client errors", [str(s.errors) for s in summaries]),
    ]
    header = [
        f"asgi-cancel demo: {load.clients} openai clients; {load.clients - planned} stay to the "
        f"end, {planned} try to leave early",
        "  (non-streaming requests that hit a client timeout, streams closed after a few chunks)",
        f"simulated engine: batch {engine.max_batch_size}, {engine.step_time * 1000:g} ms/step, "
        f"{load.max_tokens} tokens per request; server: {server} on 127.0.0.1",
        "",
        f"{'':36}{runs[0].label:>18}{runs[1].label:>18}",
    ]
    lines = [f"{name:36}" + "".join(f"{cell:>18}" for cell in cells) for name, cells in rows]
    return "\n".join(header + lines)
