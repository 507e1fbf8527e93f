"""Each framework's app under a real server, with the middleware and without it (the control):
the `deploy` fixture, which conftest.py makes this folder's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from ..servers.client import fetch
from ..servers.runner import Server, ServerSpec, serving

Deployment = dict[bool, Server]  # one framework's app under one server: with the middleware?
Deploy = Callable[[str, ServerSpec], Deployment]
MIDDLEWARE = pytest.mark.parametrize("middleware", [True, False], ids=["with", "control"])


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deploy]:
    """`deploy(framework, spec)`: its two servers, with the middleware and without, started at
    the first use, kept for the module (so each starts once, whichever test comes first), logs
    checked at the end."""
    started: dict[tuple[str, ServerSpec], Deployment] = {}
    with ExitStack() as stack:

        def deploy(framework: str, spec: ServerSpec) -> Deployment:
            if (framework, spec) not in started:
                app = f"tests.frameworks.{framework}_app"
                ours = stack.enter_context(serving(spec, f"{app}:app", tmp_path_factory))
                control = stack.enter_context(serving(spec, f"{app}:control", tmp_path_factory))
                started[framework, spec] = {True: ours, False: control}
            return started[framework, spec]

        yield deploy
        for deployment in started.values():
            for server in deployment.values():
                assert_clean_log(server)


def assert_clean_log(server: Server) -> None:
    """No traceback and no 500 in the server's log, and it serves the next request."""
    server.assert_no_traceback()
    assert " 500" not in server.log(), f"{server.spec} logged a 500:\n{server.log()[-4000:]}"
    assert fetch(server.port, "GET", "/hello").body == b"hello"
