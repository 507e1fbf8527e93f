"""The soak in CI: 1,000 requests per server (uvicorn h1, hypercorn h1 and h2c), half leaving.

The long run is `python -m tests.reliability.soak --requests 20000` (docs/reliability.md).
"""

from __future__ import annotations

import pytest

from ..servers.runner import ServerSpec, serving
from .soak import SPECS, TARGET, report, soak

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

REQUESTS = 1000
RSS_GROWTH_KIB = 20 * 1024


@pytest.mark.parametrize(
    ("spec", "h2"), SPECS, ids=[f"{s}-{'h2c' if h2 else 'h1'}" for s, h2 in SPECS]
)
def test_soak_half_the_clients_leaving(
    spec: ServerSpec, h2: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with serving(spec, TARGET, tmp_path_factory) as server:
        result = soak(server, requests=REQUESTS, h2=h2)
    print(report(result, traceback=False))  # noqa: T201  (the figures, shown with -rA)
    assert result.errors == []
    assert result.completed + sum(result.departures.values()) == result.requests
    assert sum(result.departures.values()) > result.requests // 4
    assert result.after is not None
    # The middleware's and the app's tasks: the server's own connection tasks are not
    # asserted (hypercorn keeps those of reset connections a long time, with or without us).
    assert result.after.ours <= result.before.ours, f"tasks left behind: {result.after.stacks}"
    assert result.after.rss_kib - result.before.rss_kib < RSS_GROWTH_KIB
