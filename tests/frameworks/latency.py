"""Cancel latencies per framework, collected over a run and printed in the terminal summary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    framework: str
    scenario: str
    server: str
    cancel_ms: float  # client FIN -> the app's CancelledError (or a thread saw the token)
    fired_ms: float  # client FIN -> the middleware's on_cancelled hook (the token fired)


class FrameworkLatencies:
    def __init__(self) -> None:
        self.measurements: list[Measurement] = []

    def add(
        self, framework: str, scenario: str, server: str, *, cancel_s: float, fired_s: float
    ) -> None:
        self.measurements.append(
            Measurement(
                framework, scenario, server, round(cancel_s * 1e3, 3), round(fired_s * 1e3, 3)
            )
        )
