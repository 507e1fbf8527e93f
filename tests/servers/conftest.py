"""Collect the cancel latencies the tests measure (tests/servers/latency.py)."""

from .latency import register as pytest_configure  # noqa: F401  (a hook, by its name)
