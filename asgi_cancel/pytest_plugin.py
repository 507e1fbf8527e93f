"""The `asgi_client` pytest fixture: httpx clients on ASGI apps whose client can leave
(`asgi_cancel.testing.ASGITransport`), each closed when the test ends.

pytest loads this module by itself wherever asgi-cancel is installed (the package's `pytest11`
entry point, as anyio's plugin is loaded); it imports httpx and anyio (the `testing` extra) only
when a test asks for the fixture. The fixture is synchronous, so the fixture of your app built
on it is a plain one, and its clients are closed in the test's own event loop by whichever
plugin runs the test: anyio's (`@pytest.mark.anyio`, on asyncio and trio) or pytest-asyncio's
(`@pytest.mark.asyncio`).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from ._extras import missing_extra

if TYPE_CHECKING:
    import httpx

    from .types import AnyASGIApp

__all__ = ["ClientFactory", "asgi_client"]


class ClientFactory(Protocol):
    """What the `asgi_client` fixture gives a test: call it with an app for a client."""

    def __call__(
        self, app: AnyASGIApp, *, base_url: str = "http://testserver", **options: Any
    ) -> httpx.AsyncClient:
        """An `httpx.AsyncClient` on `ASGITransport(app, **options)`, closed when the test
        ends."""


@pytest.fixture
def asgi_client(request: pytest.FixtureRequest) -> ClientFactory:
    """Make httpx clients on ASGI apps whose client can leave; each closed when the test ends.

    `asgi_client(app, **options)` returns an `httpx.AsyncClient` on
    `asgi_cancel.testing.ASGITransport(app, **options)` (`exit_timeout`, `after_disconnect`,
    `raise_app_exceptions`, `root_path`, `client`), with `base_url="http://testserver"` unless
    given. When the test ends, every client it made is closed, as leaving
    `async with httpx.AsyncClient(...)` closes one: a response still open is closed (its client
    leaves), its app is awaited, and an app still running `exit_timeout` seconds later
    (`AppStillRunning`), or an app's exception, fails the test at its teardown.

    For async tests run by anyio's pytest plugin or by pytest-asyncio: the clients are closed in
    the test's event loop, by that plugin.
    """
    if "anyio_backend" in request.fixturenames:
        name = "_asgi_clients_anyio"
    elif _runs_on_pytest_asyncio(request):
        name = f"_asgi_clients_asyncio_{_test_loop_scope(request)}"
    else:
        pytest.fail(
            "asgi_client closes its clients in the test's event loop: ask for it from an async "
            "test run by anyio's pytest plugin (@pytest.mark.anyio) or by pytest-asyncio "
            "(0.24 or later)",
            pytrace=False,
        )
    factory: ClientFactory = request.getfixturevalue(name)
    return factory


def _clients_fixture() -> Callable[[], AsyncIterator[ClientFactory]]:
    """The async fixture that makes the clients and closes them: a new function each time, for
    each plugin marks the fixture functions it runs."""

    async def clients() -> AsyncIterator[ClientFactory]:
        try:
            import httpx
        except ImportError as exc:
            raise missing_extra("testing", exc) from exc
        from .testing import ASGITransport  # raises the same without anyio

        async with AsyncExitStack() as made:

            def make(
                app: AnyASGIApp, *, base_url: str = "http://testserver", **options: Any
            ) -> httpx.AsyncClient:
                transport = ASGITransport(app, **options)
                client = httpx.AsyncClient(transport=transport, base_url=base_url)
                made.push_async_callback(client.aclose)
                return client

            yield make

    return clients


def _runs_on_pytest_asyncio(request: pytest.FixtureRequest) -> bool:
    return (
        _PYTEST_ASYNCIO is not None
        and bool(_ASYNCIO_FIXTURES)
        and request.config.pluginmanager.has_plugin("asyncio")
        and bool(_PYTEST_ASYNCIO.is_async_test(request.node))
    )


def _test_loop_scope(request: pytest.FixtureRequest) -> str:
    """The scope of the event loop pytest-asyncio runs the test in: its mark's `loop_scope`,
    else `asyncio_default_test_loop_scope`."""
    marker = request.node.get_closest_marker("asyncio")
    scope = marker and (marker.kwargs.get("loop_scope") or marker.kwargs.get("scope"))
    if scope:
        return str(scope)
    try:
        return str(request.config.getini("asyncio_default_test_loop_scope"))
    except ValueError:  # a pytest-asyncio without that option: the function's loop
        return "function"


def _pytest_asyncio() -> ModuleType | None:
    try:
        # By name: it is optional here, and mypy runs where it may be missing.
        return importlib.import_module("pytest_asyncio")
    except ImportError:
        return None


def _asyncio_fixtures(pytest_asyncio: ModuleType | None) -> dict[str, Any]:
    """pytest-asyncio's fixture once per loop scope: it runs a fixture in the event loop its
    `loop_scope` names, which must be the test's (where the apps run) for the clients to close."""
    if pytest_asyncio is None:
        return {}
    fixtures = {}
    for scope in ("function", "class", "module", "package", "session"):
        name = f"_asgi_clients_asyncio_{scope}"
        try:
            fixtures[name] = pytest_asyncio.fixture(_clients_fixture(), name=name, loop_scope=scope)
        except TypeError:  # before 0.24: no loop_scope
            return {}
    return fixtures


_asgi_clients_anyio = pytest.fixture(name="_asgi_clients_anyio")(_clients_fixture())
_PYTEST_ASYNCIO = _pytest_asyncio()
_ASYNCIO_FIXTURES = _asyncio_fixtures(_PYTEST_ASYNCIO)
globals().update(_ASYNCIO_FIXTURES)  # a plugin's fixtures are its module's names
