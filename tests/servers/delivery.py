"""What the real-server websocket tests (tests/servers/test_websockets.py) see besides
latencies, printed in the terminal summary next to latency.py's table:

- messages: per server and route, bare and wrapped, how many numbered messages the client
  sent and how many the app lost, got twice, or got out of order (all 0, or a test failed);
- outcomes: what a server did where there is no single right answer (how a control app that
  only sends learned its client had left, if it did; an oversized frame; a half-sent
  handshake), per server, counted over the runs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest


@dataclass
class Deliveries:
    """A pytest plugin: the `deliveries` fixture, and its tables in the terminal summary."""

    # Per (server, route, side): runs, and messages sent, lost, duplicated and reordered.
    messages: dict[tuple[str, str, str], Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter)
    )
    outcomes: dict[tuple[str, str], Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter)
    )

    def add_messages(
        self, server: str, route: str, side: str, *, sent: int, lost: int, duplicated: int,
        reordered: int,
    ) -> None:  # fmt: skip
        self.messages[server, route, side].update(
            runs=1, sent=sent, lost=lost, duplicated=duplicated, reordered=reordered
        )

    def add_outcome(self, server: str, case: str, outcome: str) -> None:
        self.outcomes[server, case][outcome] += 1

    @pytest.fixture
    def deliveries(self) -> Deliveries:
        return self

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        if self.messages:
            terminalreporter.section("asgi-cancel: websocket messages, client -> app")
            write(
                f"{'server':<26} {'route':<10} {'side':<8} {'runs':>4} {'sent':>7} "
                f"{'lost':>5} {'dup':>5} {'reord':>5}"
            )
            for (server, route, side), tally in sorted(self.messages.items()):
                write(
                    f"{server:<26} {route:<10} {side:<8} {tally['runs']:>4} {tally['sent']:>7} "
                    f"{tally['lost']:>5} {tally['duplicated']:>5} {tally['reordered']:>5}"
                )
        if self.outcomes:
            terminalreporter.section("asgi-cancel: what each server did (websockets)")
            for (server, case), counts in sorted(self.outcomes.items()):
                seen = ", ".join(f"{outcome} x{n}" for outcome, n in sorted(counts.items()))
                write(f"{server:<26} {case:<34} {seen}")


def register(config: pytest.Config) -> None:
    """Register the plugin once per run."""
    if not config.pluginmanager.has_plugin("asgi-cancel-deliveries"):
        config.pluginmanager.register(Deliveries(), "asgi-cancel-deliveries")
