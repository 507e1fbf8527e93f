"""Real reverse proxies in front of uvicorn and hypercorn: does a client's abort reach the app?

Each proxy (proxies.py) listens with its defaults and `tuned`; a raw-socket client leaves in each
scenario (harness.py) and the app (app.py) records its cancellation. `EXPECTED` is the table of
docs/proxies.md: a change in any proxy's behaviour fails here, and every "never" or "not started"
names the proxy's reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from ..servers.runner import HYPERCORN_ASYNCIO, UVICORN_HTTPTOOLS, Server, running_server
from .harness import (
    BODY,
    CANCELLED,
    CONFIGS,
    DEFAULTS,
    FIRST_BYTE,
    NEVER,
    NOT_STARTED,
    SCENARIOS,
    SSE,
    TUNED,
    UPLOAD,
    RunningProxy,
    measure,
    running_proxy,
)
from .proxies import APACHE, APACHE_H2C, CADDY, H2O, HAPROXY, NGINX, PROXIES, VARNISH, Proxy

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

# A cancellation the proxy passes on is expected in milliseconds; this bound only tells "passed
# on" from "passed on by accident, much later".
BOUND_MS = 1000.0
APP = "tests.proxies.app:app"
BACKENDS = (UVICORN_HTTPTOOLS, HYPERCORN_ASYNCIO)
# mod_proxy_http2 speaks h2c upstream: hypercorn does, uvicorn does not.
COMBOS = [
    (proxy, backend) for proxy in PROXIES for backend in BACKENDS
    if not proxy.h2c or backend is HYPERCORN_ASYNCIO
]  # fmt: skip

C, N, S = CANCELLED, NEVER, NOT_STARTED
# (proxy, config): the outcome for (first-byte, sse, body, upload), on either server.
EXPECTED: dict[tuple[Proxy, str], tuple[str, str, str, str]] = {
    (NGINX, DEFAULTS): (C, C, C, S),
    (NGINX, TUNED): (C, C, C, C),
    (HAPROXY, DEFAULTS): (N, C, C, C),
    (HAPROXY, TUNED): (N, C, C, C),
    (CADDY, DEFAULTS): (C, C, C, C),
    (CADDY, TUNED): (N, C, C, C),
    (APACHE, DEFAULTS): (N, C, C, C),
    (APACHE, TUNED): (N, C, C, C),
    (APACHE_H2C, DEFAULTS): (N, C, C, C),
    (APACHE_H2C, TUNED): (N, C, C, C),
    (H2O, DEFAULTS): (N, C, C, S),
    (H2O, TUNED): (N, C, C, S),
    (VARNISH, DEFAULTS): (N, C, N, C),
    (VARNISH, TUNED): (C, C, C, C),
}
# Why the app never hears of the client leaving: (proxy, scenario), or (proxy, config, scenario).
WHY = {
    (NGINX, DEFAULTS, UPLOAD): "proxy_request_buffering on: nginx reads the whole body before "
    "it connects upstream, so the app is never called",
    (HAPROXY, FIRST_BYTE): "HAProxy 2.6 waits for the server's answer whoever is left: a "
    "client's FIN (or RST) before it starts is not passed on, abortonclose or not",
    (CADDY, TUNED, FIRST_BYTE): "flush_interval -1: Caddy stops tying the upstream request to "
    "the client, and notices only when a write to the client fails",
    (APACHE, FIRST_BYTE): "mod_proxy_http waits on the backend alone until the response starts; "
    "it notices the client only when a write to it fails",
    (APACHE_H2C, FIRST_BYTE): "mod_proxy_http2 as mod_proxy_http: the client is not watched "
    "until the response starts",
    (H2O, FIRST_BYTE): "h2o 2.2 does not watch the client while it waits for the upstream's "
    "response",
    (H2O, UPLOAD): "h2o 2.2 reads the whole request body before it connects upstream, so the "
    "app is never called",
    (VARNISH, DEFAULTS, FIRST_BYTE): "a backend fetch is Varnish's own, not the client's: it "
    "waits for the answer whoever is left",
    (VARNISH, DEFAULTS, BODY): "a cacheable answer is fetched to the end to fill the cache, "
    "whoever is left",
}

# The answer may not reach the client before it leaves: proxy_buffering on (nginx's default)
# held the SSE events back from hypercorn's stream, not from uvicorn's.
MAY_HOLD_BACK = {(NGINX, DEFAULTS)}


def why(proxy: Proxy, config: str, scenario: str) -> str:
    return WHY.get((proxy, config, scenario)) or WHY.get((proxy, scenario), "")


# hypercorn 0.18's h2 protocol, behind mod_proxy_http2, sometimes logs an event for a stream it
# already removed (`KeyError` in `_handle_events`); only that connection ends, the app is not
# involved.
HYPERCORN_H2_KEYERROR = re.compile(
    r"Unhandled exception in client_connected_cb\n.*?\| KeyError: \d+\n\s*\+-+\n", re.DOTALL
)


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with (
        running_server(UVICORN_HTTPTOOLS, APP, tmp_path_factory.mktemp("uvicorn")) as uvicorn,
        running_server(HYPERCORN_ASYNCIO, APP, tmp_path_factory.mktemp("hypercorn")) as hypercorn,
    ):
        yield {uvicorn.spec.name: uvicorn, hypercorn.spec.name: hypercorn}
        for server in (uvicorn, hypercorn):
            log = HYPERCORN_H2_KEYERROR.sub("", server.log())
            assert "Traceback" not in log, f"{server.spec} logged a traceback:\n{log[-4000:]}"


@pytest.fixture(scope="module", params=COMBOS, ids=lambda combo: f"{combo[0]}-{combo[1]}")
def running(
    request: pytest.FixtureRequest,
    backends: dict[str, Server],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningProxy]:
    proxy, backend = request.param
    if proxy.path() is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{proxy.binary} is not installed, and CI=true: .ci/run installs it")
        pytest.skip(f"{proxy.binary} is not installed")
    workdir = tmp_path_factory.mktemp(f"{proxy}-{backend}")
    with running_proxy(proxy, backends[backend.name], workdir) as running:
        yield running


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("config", CONFIGS)
def test_the_app_hears_the_client_leave_through_the_proxy(
    running: RunningProxy, config: str, scenario: str
) -> None:
    proxy = running.proxy
    expected = EXPECTED[proxy, config][SCENARIOS.index(scenario)]
    result = measure(running, config, scenario)
    assert result.outcome == expected, why(proxy, config, scenario) or result
    if result.outcome == CANCELLED:
        assert result.ms is not None, result
        assert 0 < result.ms <= BOUND_MS, result
    if scenario in (SSE, BODY) and (proxy, config) not in MAY_HOLD_BACK:
        assert result.seen, f"{proxy} {config} held the answer back: {result}"


def test_every_never_names_its_reason() -> None:
    for (proxy, config), outcomes in EXPECTED.items():
        for scenario, outcome in zip(SCENARIOS, outcomes, strict=True):
            named = bool(why(proxy, config, scenario))
            assert (outcome == CANCELLED) != named, (proxy, config, scenario)
    assert {proxy for proxy, _ in EXPECTED} == set(PROXIES)
