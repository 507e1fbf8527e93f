"""Collect the cancel latencies the tests measure (tests/servers/latency.py); deploy each
framework's app under a real server once per module (tests/frameworks/deployment.py)."""

from ..servers.latency import register as pytest_configure  # noqa: F401  (a hook, by its name)
from .deployment import deploy  # noqa: F401  (a fixture, by its name)
