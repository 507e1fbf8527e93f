"""Collect the cancel latencies the tests measure (tests/servers/latency.py); deploy each
framework's app under a real server once per module (tests/frameworks/deployment.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..servers.latency import register as pytest_configure  # noqa: F401  (a hook, by its name)
from .deployment import Deploy, deployments


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deploy]:
    """`deploy(framework, spec)`: its two servers, with the middleware and without."""
    with deployments(tmp_path_factory) as deploy:
        yield deploy
