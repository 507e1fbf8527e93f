"""The soak in CI: ~1,000 requests per server (uvicorn h1, hypercorn h1 and h2c), half leaving.

The long run is `python -m tests.reliability.soak --requests 20000` (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..servers.runner import (
    HYPERCORN_ASYNCIO,
    UVICORN_HTTPTOOLS,
    Server,
    ServerSpec,
    running_server,
)
from .soak import TARGET, report, soak

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

REQUESTS = 1000
RSS_GROWTH_KIB = 20 * 1024


@pytest.fixture(scope="module", params=[UVICORN_HTTPTOOLS, HYPERCORN_ASYNCIO], ids=str)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    spec: ServerSpec = request.param
    with running_server(spec, TARGET, tmp_path_factory.mktemp(spec.name + "-soak")) as server:
        yield server


@pytest.mark.parametrize("h2", [False, True], ids=["h1", "h2c"])
def test_soak_half_the_clients_leaving(server: Server, h2: bool) -> None:
    if h2 and server.spec is not HYPERCORN_ASYNCIO:
        pytest.skip("h2c: hypercorn")
    result = soak(server, requests=REQUESTS, h2=h2)
    print(report(result, "Traceback" in server.log()))  # noqa: T201  (shown with -rA)
    assert result.errors == []
    assert result.completed + sum(result.departures.values()) == result.requests
    assert sum(result.departures.values()) > result.requests // 4
    assert result.before is not None
    assert result.after is not None
    # The middleware's and the app's tasks: the server's own connection tasks are not
    # asserted (hypercorn keeps those of reset connections a long time, with or without us).
    assert result.after.ours <= result.before.ours, f"tasks left behind: {result.after.stacks}"
    assert result.after.rss_kib - result.before.rss_kib < RSS_GROWTH_KIB
    server.assert_no_traceback()
