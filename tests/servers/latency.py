"""Measured cancel latencies, collected over a run and printed in the terminal summary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    server: str
    scenario: str
    close: str
    cancel_ms: float  # client close -> CancelledError in the app
    fired_ms: float  # client close -> the middleware's on_cancelled hook (the token fired)


class Latencies:
    def __init__(self) -> None:
        self.measurements: list[Measurement] = []

    def add(
        self, server: str, scenario: str, close: str, *, cancel_s: float, fired_s: float
    ) -> None:
        self.measurements.append(
            Measurement(server, scenario, close, round(cancel_s * 1e3, 3), round(fired_s * 1e3, 3))
        )
