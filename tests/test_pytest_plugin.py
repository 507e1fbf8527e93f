"""asgi_cancel.pytest_plugin: the `asgi_client` fixture, here under anyio's pytest plugin (on
asyncio and trio), and in pytester runs of their own where a test fails at its teardown, or runs
under pytest-asyncio (where that is installed)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

import asgi_cancel
from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.testing import AppStillRunning
from asgi_cancel.types import Receive, Scope, Send

from .test_packaging import HIDE
from .test_testing_transport import Seen, streamer

if TYPE_CHECKING:  # imported by pytest_plugins below first, for pytest to rewrite its asserts
    from asgi_cancel.pytest_plugin import ClientFactory

# Installed, the package's pytest11 entry point loads the plugin; a checkout installed before
# the entry point existed loads it here (the same name: never twice).
pytest_plugins = ("pytester", "asgi_cancel.pytest_plugin")
NO_CACHE = ("-p", "no:cacheprovider")

pytestmark = [
    # Leaving `async for` over an httpx stream early leaves httpx's async generators to the
    # garbage collector, which trio's finalizer warns about: not ours.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


def plugin_args() -> tuple[str, ...]:
    """What a pytester run needs to have the plugin: nothing once the package is installed
    with its entry point, else `-p` naming the module."""
    installed = any(
        entry.value == "asgi_cancel.pytest_plugin" for entry in entry_points(group="pytest11")
    )
    return () if installed else ("-p", "asgi_cancel.pytest_plugin")


@pytest.mark.anyio
async def test_a_client_on_the_app_whose_client_can_leave(asgi_client: ClientFactory) -> None:
    seen = Seen()
    client = asgi_client(streamer(seen))
    assert client.base_url == "http://testserver"
    with anyio.fail_after(5):
        async with client.stream("GET", "/") as response:
            async for _ in response.aiter_raw():
                break
    assert seen.ended  # already, when the block is left
    assert seen.received == ["http.disconnect"]


@pytest.mark.anyio
async def test_options_go_to_the_transport_and_the_base_url_to_the_client(
    asgi_client: ClientFactory,
) -> None:
    async def stubborn(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(30)

    client = asgi_client(stubborn, base_url="http://api.test/v1", exit_timeout=0.05)
    with anyio.fail_after(5), pytest.raises(AppStillRunning, match=r"GET /v1/x: .* 0\.05s"):
        await client.get("x", timeout=0.05)


@pytest.fixture
def seen_after_teardown() -> Iterator[Seen]:
    """Set up before `asgi_client`, so checked after its clients were closed."""
    seen = Seen()
    yield seen
    assert seen.ended
    assert seen.received == ["http.disconnect"]


@pytest.mark.anyio
async def test_a_response_left_open_is_closed_when_the_test_ends(
    seen_after_teardown: Seen, asgi_client: ClientFactory
) -> None:
    client = asgi_client(CancelOnDisconnectMiddleware(streamer(seen_after_teardown)))
    response = await client.send(client.build_request("GET", "/"), stream=True)
    await response.aiter_raw().__anext__()
    assert not seen_after_teardown.ended  # never closed here: the teardown does it


@pytest.mark.anyio
async def test_a_client_closed_by_the_test_is_left_closed(asgi_client: ClientFactory) -> None:
    async with asgi_client(streamer(Seen(), chunks=1)) as client:
        assert (await client.get("/")).status_code == 200
    assert client.is_closed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_app_still_running_when_the_test_ends_fails_it_there(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import anyio
        import pytest


        async def stubborn(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await anyio.sleep(30)


        @pytest.mark.anyio
        async def test_leaves_a_stream_open(asgi_client):
            client = asgi_client(stubborn, exit_timeout=0.05)
            response = await client.send(client.build_request("GET", "/s"), stream=True)
            assert response.status_code == 200
        """
    )
    result = pytester.runpytest_inprocess(*plugin_args(), "-p", "no:asyncio", *NO_CACHE)
    result.assert_outcomes(passed=2, errors=2)  # on asyncio and trio: the test, then its teardown
    result.stdout.fnmatch_lines(["*AppStillRunning: GET /s: the app was still running 0.05s*"])


def test_outside_an_async_test_it_says_what_it_needs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_sync(asgi_client):\n    pass\n")
    result = pytester.runpytest_inprocess(*plugin_args(), "-p", "no:asyncio", *NO_CACHE)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*asgi_client closes its clients in the test's event loop*"])


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_under_pytest_asyncio_in_the_tests_own_loop(pytester: pytest.Pytester, mode: str) -> None:
    """In pytest-asyncio's loop of the test's scope (the function's, a module's): a stream the
    test left open is closed there, its app told, at the test's end."""
    pytest.importorskip("pytest_asyncio")
    pytester.makepyfile(
        """
        import pytest

        ENDED = []


        async def streamer(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                if (await receive())["type"] == "http.disconnect":
                    ENDED.append(scope["path"])
                    return


        @pytest.fixture
        def client(asgi_client):
            return asgi_client(streamer, exit_timeout=1)


        @pytest.mark.asyncio
        async def test_the_client_leaves(client):
            async with client.stream("GET", "/left") as response:
                async for _ in response.aiter_raw():
                    break
            assert ENDED == ["/left"]


        @pytest.mark.asyncio(loop_scope="module")
        async def test_a_stream_left_open_in_a_modules_loop(client):
            response = await client.send(client.build_request("GET", "/open"), stream=True)
            assert response.status_code == 200


        def test_it_was_closed_at_the_end_of_the_test():
            assert ENDED == ["/left", "/open"]
        """
    )
    options = ["-o", "asyncio_default_fixture_loop_scope=function", "-o", f"asyncio_mode={mode}"]
    result = pytester.runpytest_inprocess(*plugin_args(), "-p", "asyncio", *NO_CACHE, *options)
    result.assert_outcomes(passed=3)


def test_without_httpx_the_fixture_names_its_extra(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh interpreter, which must import this checkout's package, not another install's.
    monkeypatch.setenv("PYTHONPATH", str(Path(asgi_cancel.__file__).parent.parent))
    pytester.makeconftest(
        HIDE.replace("HIDDEN", "('httpx',)") + "\nassert 'httpx' not in sys.modules\n"
    )
    pytester.makepyfile(
        "import pytest\n\n\n@pytest.mark.anyio\nasync def test_it(asgi_client):\n    pass\n"
    )
    result = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:asyncio")
    result.assert_outcomes(errors=2)  # asyncio and trio
    result.stdout.fnmatch_lines(
        ["*asgi_cancel.testing needs packages that are not installed (httpx is missing)*"]
    )
