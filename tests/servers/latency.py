"""Cancel latencies the real-server tests measure (client close -> the app stopped, and ->
the `on_cancelled` hook: the token fired), printed in the terminal summary. With
`ASGI_CANCEL_LATENCY_LOG=path` they are appended to `path` as JSON lines, which this module
turns into the table in docs/servers.md:

    rm -f /tmp/latency.jsonl
    for i in 1 2 3 4 5; do
        ASGI_CANCEL_LATENCY_LOG=/tmp/latency.jsonl .venv/bin/pytest tests/servers -m servers -q
    done
    .venv/bin/python -m tests.servers.latency /tmp/latency.jsonl
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

LATENCY_LOG_ENV = "ASGI_CANCEL_LATENCY_LOG"
CLOSE_ORDER = ["fin", "rst", "half", "rst-stream", "conn-fin", "close1000", "close4001"]


@dataclass(frozen=True)
class Measurement:
    server: str
    scenario: str
    close: str
    cancel_ms: float
    fired_ms: float


class Latencies:
    """A pytest plugin: the `latencies` fixture, and the table in the terminal summary."""

    def __init__(self) -> None:
        self.measurements: list[Measurement] = []

    def add(
        self, server: str, scenario: str, close: str, closed_at: float, *, stopped: float,
        fired: float,
    ) -> None:  # fmt: skip
        """The client left at `closed_at`, the app stopped at `stopped`, the token fired at
        `fired` (each an event's `t`, `time.monotonic()`)."""
        cancel_ms, fired_ms = (round((t - closed_at) * 1e3, 3) for t in (stopped, fired))
        self.measurements.append(Measurement(server, scenario, close, cancel_ms, fired_ms))

    @pytest.fixture
    def latencies(self) -> Latencies:
        return self

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.measurements:
            return
        groups: dict[tuple[str, str, str], list[Measurement]] = defaultdict(list)
        for item in self.measurements:
            groups[item.server, item.scenario, item.close].append(item)
        write = terminalreporter.write_line
        terminalreporter.section("asgi-cancel: client close -> app stopped (ms)")
        write(f"{'server':<20} {'scenario':<44} {'close':<10} {'n':>3} {'median':>8} {'max':>8}")
        for (server, scenario, close), items in sorted(groups.items()):
            cancel = [item.cancel_ms for item in items]
            fired = statistics.median(item.fired_ms for item in items)
            write(
                f"{server:<20} {scenario:<44} {close:<10} {len(items):>3} "
                f"{statistics.median(cancel):>8.2f} {max(cancel):>8.2f}  (fired {fired:.2f})"
            )
        path = os.environ.get(LATENCY_LOG_ENV)
        if path:
            with open(path, "a") as log:
                log.writelines(json.dumps(asdict(item)) + "\n" for item in self.measurements)


def register(config: pytest.Config) -> None:
    """Register the plugin once per run, from each folder's conftest that measures."""
    if not config.pluginmanager.has_plugin("asgi-cancel-latencies"):
        config.pluginmanager.register(Latencies(), "asgi-cancel-latencies")


def summarize(path: Path) -> str:
    """The markdown table of docs/servers.md: median / max per server, scenario and close."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in path.read_text().splitlines():
        item = json.loads(line)
        cells[item["server"], item["scenario"]][item["close"]].append(item["cancel_ms"])
    closes = [c for c in CLOSE_ORDER if any(c in row for row in cells.values())]
    lines = [
        "| server | scenario | " + " | ".join(closes) + " |",
        "|---|---|" + "---|" * len(closes),
    ]
    for (server, scenario), row in sorted(cells.items()):
        values = [
            f"{statistics.median(row[c]):.1f} / {max(row[c]):.1f}" if row.get(c) else ""
            for c in closes
        ]
        lines.append(f"| {server} | {scenario} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(summarize(Path(sys.argv[1])))
