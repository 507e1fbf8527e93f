"""The example server (`python -m example_app serve`) as a subprocess on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from example_app.launch import ServerProcess

from .helpers import SERVERS


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=SERVERS)
def api_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The example server with the middleware and fast engine steps, always terminated."""
    args = ("--step-time", "0.002", "--log-level", "warning")
    with ServerProcess(*args, server=request.param) as process:
        yield process
