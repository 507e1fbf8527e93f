"""Collect what the real-server tests measure: cancel latencies (tests/servers/latency.py) and
websocket deliveries (tests/servers/delivery.py)."""

from __future__ import annotations

import pytest

from . import delivery, latency


def pytest_configure(config: pytest.Config) -> None:
    latency.register(config)
    delivery.register(config)
