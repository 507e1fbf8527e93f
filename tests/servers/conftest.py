"""Collect the measured cancel latencies and print them at the end of the run.

Every cancelled request in these tests reports `close -> CancelledError in the app` (and
`close -> on_cancelled hook`, the moment the token fired). The table is printed in the
terminal summary; with `ASGI_CANCEL_LATENCY_LOG=path`, the measurements are also appended to
`path` as JSON lines, which `summarize.py` turns into the table in docs/servers.md.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import asdict

import pytest

from .latency import Latencies, Measurement

LATENCY_LOG_ENV = "ASGI_CANCEL_LATENCY_LOG"


LATENCIES = pytest.StashKey[Latencies]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[LATENCIES] = Latencies()


@pytest.fixture
def latencies(request: pytest.FixtureRequest) -> Latencies:
    return request.config.stash[LATENCIES]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    latencies = config.stash.get(LATENCIES, None)
    if latencies is None or not latencies.measurements:
        return
    groups: dict[tuple[str, str, str], list[Measurement]] = defaultdict(list)
    for measurement in latencies.measurements:
        groups[measurement.server, measurement.scenario, measurement.close].append(measurement)
    write = terminalreporter.write_line
    terminalreporter.section("asgi-cancel: client close -> app CancelledError (ms)")
    write(
        f"{'server':<20} {'scenario':<22} {'close':<10} {'n':>3} {'median':>8} {'max':>8}"
        f"  {'fired median':>12}"
    )
    for (server, scenario, close), items in sorted(groups.items()):
        cancel = [item.cancel_ms for item in items]
        fired = [item.fired_ms for item in items]
        write(
            f"{server:<20} {scenario:<22} {close:<10} {len(items):>3} "
            f"{statistics.median(cancel):>8.2f} {max(cancel):>8.2f}  "
            f"{statistics.median(fired):>12.2f}"
        )
    path = os.environ.get(LATENCY_LOG_ENV)
    if path:
        with open(path, "a") as log:
            for measurement in latencies.measurements:
                log.write(json.dumps(asdict(measurement)) + "\n")
