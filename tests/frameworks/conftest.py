"""The framework matrix's latency table, printed at the end of the run."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest

from .latency import FrameworkLatencies, Measurement

FRAMEWORK_LATENCIES = pytest.StashKey[FrameworkLatencies]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FRAMEWORK_LATENCIES] = FrameworkLatencies()


@pytest.fixture
def latencies(request: pytest.FixtureRequest) -> FrameworkLatencies:
    return request.config.stash[FRAMEWORK_LATENCIES]


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    latencies = config.stash.get(FRAMEWORK_LATENCIES, None)
    if latencies is None or not latencies.measurements:
        return
    write = terminalreporter.write_line
    terminalreporter.section("asgi-cancel: client FIN -> app cancelled, per framework (ms)")
    header = f"{'framework':<12} {'scenario':<48} {'n':>3} {'median':>8} {'max':>8}"
    write(f"{header}  {'fired median':>12} {'fired max':>10}")
    by_framework: dict[str, list[Measurement]] = defaultdict(list)
    by_scenario: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for item in latencies.measurements:
        by_framework[item.framework].append(item)
        by_scenario[item.framework, f"{item.scenario} ({item.server})"].append(item)
    rows = [((framework, "all"), items) for framework, items in by_framework.items()]
    rows += list(by_scenario.items())
    for (framework, scenario), items in sorted(rows):
        cancel = [item.cancel_ms for item in items]
        fired = [item.fired_ms for item in items]
        write(
            f"{framework:<12} {scenario:<48} {len(items):>3} {statistics.median(cancel):>8.2f} "
            f"{max(cancel):>8.2f}  {statistics.median(fired):>12.2f} {max(fired):>10.2f}"
        )
