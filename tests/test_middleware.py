"""The front door: options, non-HTTP scopes, excluded routes, what reaches the server
(docs/contract.md lines 1 and 6) and what a cancellation reports. On asyncio and trio."""

from __future__ import annotations

import asyncio
import logging
import traceback
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import anyio
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelToken, current_token
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import CancelledRequest, Message, Receive, Scope, Send

from .helpers import cleanup_scope, leave, read_body, slow_app, tasks_alive, until, with_watchdog

pytestmark = pytest.mark.anyio
PACKAGE = str(Path(__file__).parents[1] / "asgi_cancel")


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    pass  # pragma: no cover


# -- options (those in seconds: test_validate.py) ------------------------------------------------
BAD_OPTIONS: dict[str, list[Any]] = {
    "read_ahead": [-1, 1.5, "64k", True],
    "on_cancelled": [42],
    "exclude": [(), ("payments",), 42, [b"/x"]],
    "registry": ["yes"],
    "websockets": ["yes", 1, None],
    "timeouts": [5, {"/x": -1}, {"v1": 0.5}, {"": 0.5}, {"/v1": float("inf")}],
    # A header option must be a header name (str): one that is not could never match, or
    # would be forwarded as a forged header.
    "timeout_header": ["X Request Timeout", "x-request-timeout\r\nx-evil: 1", "", b"x-timeout"],
}


@pytest.mark.parametrize(
    ("option", "value"), [(option, v) for option, values in BAD_OPTIONS.items() for v in values]
)
def test_bad_option_is_a_value_error_naming_it(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{option}"):
        CancelOnDisconnectMiddleware(app, **{option: value})


def test_valid_options_are_kept_not_an_app_is_a_type_error() -> None:
    middleware = CancelOnDisconnectMiddleware(
        app, read_ahead=0, grace=0, on_cancelled=print, watch_delay=0
    )
    assert (middleware.read_ahead, middleware.grace, middleware.watch_delay) == (0, 0.0, 0.0)
    assert middleware.app is app
    with pytest.raises(TypeError, match="app must be an ASGI callable"):
        CancelOnDisconnectMiddleware("app")  # type: ignore[arg-type]


# -- 1. http and websocket scopes, and not the excluded routes ----------------------------------
PASSED_THROUGH = {
    "lifespan": ("lifespan", {}),
    "websocket, websockets=False": ("websocket", {"websockets": False}),
    "websocket, excluded": ("websocket", {"exclude": ("/ws",)}),
}


@pytest.mark.parametrize(
    ("scope_type", "options"), PASSED_THROUGH.values(), ids=list(PASSED_THROUGH)
)
async def test_scopes_passed_through_untouched(scope_type: str, options: dict[str, Any]) -> None:
    """The app gets the server's own scope, receive and send; the server, what it returned."""
    seen: list[tuple[Scope, Receive, Send]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> object:
        seen.append((scope, receive, send))
        return "a value"

    async def receive() -> Message:
        raise AssertionError("not called")

    async def send(message: Message) -> None:
        raise AssertionError("not called")

    scope: Scope = {"type": scope_type, "path": "/ws"}
    result = await with_watchdog(CancelOnDisconnectMiddleware(app, **options)(scope, receive, send))
    assert seen == [(scope, receive, send)]
    assert result == "a value"


@pytest.mark.parametrize(
    ("exclude", "path", "excluded"),
    [
        (("/payments/",), "/payments/42", True),
        ("/payments/", "/payments/42", True),
        ("/payments/", "/api/payments/42", True),  # under uvicorn's `--root-path /api`
        (lambda scope: scope["path"].startswith("/payments/"), "/payments/42", True),
        (("/payments/",), "/payment", False),
    ],
    ids=["prefixes", "one-prefix", "under-a-root-path", "predicate", "not-excluded"],
)
async def test_excluded_route_is_passed_through_and_never_cancelled(
    exclude: Any, path: str, excluded: bool
) -> None:
    seen: list[tuple[Receive, Send]] = []
    events: list[str] = []
    inner = slow_app(events, seconds=0.1, read=False)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((receive, send))
        await inner(scope, receive, send)

    middleware = CancelOnDisconnectMiddleware(app, exclude=exclude, watch_delay=0)
    conn = ClientConnection()
    scope = http_scope("POST", path)
    if path.startswith("/api/"):
        scope["root_path"] = "/api"  # the root in both `root_path` and `path`
    await leave(middleware, conn, scope, when=lambda: seen != [])
    assert events == (["finished"] if excluded else ["cancelled"])
    assert (seen == [(conn.receive, conn.send)]) is excluded  # the server's own callables


# -- 6. what reaches the server -----------------------------------------------------------------
async def test_app_exception_propagates_unchanged() -> None:
    error = ValueError("boom")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(0.01)
        raise error

    with pytest.raises(ValueError, match="boom") as info:  # not wrapped in an ExceptionGroup
        await with_watchdog(ClientConnection().run(CancelOnDisconnectMiddleware(app)))
    assert info.value is error


@pytest.mark.parametrize(
    ("path", "awaits"), [("/", True), ("/health", False)], ids=["after-awaiting", "excluded"]
)
async def test_what_the_app_returned_reaches_the_server(path: str, awaits: bool) -> None:
    # A server reports an app that returns a value ("ASGI callable should return None"):
    # behind the middleware it must still see it (as test_scopes_passed_through_untouched does).
    async def app(scope: Scope, receive: Receive, send: Send) -> object:
        if awaits:
            await anyio.sleep(0.001)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return "a value"

    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(app, exclude=("/health",))
    result = await with_watchdog(middleware(http_scope("GET", path), conn.receive, conn.send))
    assert result == "a value"


async def test_middleware_wrapped_twice_cancels_once_and_returns_normally() -> None:
    events: list[str] = []
    tokens: list[CancelToken] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        tokens.append(current_token())
        await read_body(receive)
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            with cleanup_scope():
                await anyio.sleep(0.01)  # not cancelled again by the outer middleware
            events.append("cleanup done")
            raise

    before = tasks_alive()
    doubled = CancelOnDisconnectMiddleware(CancelOnDisconnectMiddleware(app))
    conn = await leave(doubled, ClientConnection(b"x" * 100), http_scope("POST"))
    assert conn.app_exception is None
    assert events == ["cancelled", "cleanup done"]
    assert tokens[0].cancelled
    assert tasks_alive() == before


# -- what a cancellation reports ----------------------------------------------------------------
async def test_a_cancelled_request_is_logged_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[CancelledRequest] = []
    events: list[str] = []
    conn = ClientConnection()
    middleware = CancelOnDisconnectMiddleware(
        slow_app(events, stream=True), on_cancelled=calls.append
    )
    with caplog.at_level(logging.INFO, logger="asgi_cancel"):
        normal = CancelOnDisconnectMiddleware(
            slow_app(events, seconds=0), on_cancelled=calls.append
        )
        await with_watchdog(ClientConnection(after_disconnect="replay").run(normal))
        assert events == ["body:", "finished"]
        assert calls == []  # a request that ends normally: no log line, no call
        assert [r for r in caplog.records if r.name == "asgi_cancel"] == []
        scope = http_scope("POST", "/v1/completions")
        await leave(middleware, conn, scope, when=lambda: conn.body_chunks >= 1)
    assert len(calls) == 1
    call = calls[0]
    assert call.scope["path"] == "/v1/completions"
    assert call.reason == "client disconnected"
    assert call.response_started is True
    assert 0 < call.elapsed < 5
    usage = call.usage  # no binding counted an engine's tokens: zeros
    assert (usage.prompt_tokens, usage.completion_tokens, usage.after_cancel) == (0, 0, 0)
    messages = [r.getMessage() for r in caplog.records if r.name == "asgi_cancel"]
    assert len(messages) == 1
    assert messages[0].startswith("POST /v1/completions cancelled after ")
    assert messages[0].endswith("s mid-stream: client disconnected (499)")
    fields = getattr(caplog.records[-1], "asgi_cancel")  # noqa: B009 (set through extra=)
    request = {"method": "POST", "path": "/v1/completions", "route": "unmatched"}  # no router
    outcome = {"reason": "client disconnected", "response_started": True, "phase": "mid_stream"}
    assert fields == {**request, **outcome, "status": 499, "request_id": None, "elapsed": ANY}
    assert 0 < fields["elapsed"] < 5


# -- the walk from a disconnect to the app's cancellation ---------------------------------------
WALKS = {
    # the watcher stepped by hand (an asyncio.Queue's get is known to await only its futures)
    "asyncio-by-hand": ["_stepped", "_watcher", "_cycle", "_scope", "_asyncio_lane"],
    # the watcher in a task (a receive() it does not know)
    "asyncio-in-a-task": ["_watcher", "_cycle", "_scope", "_asyncio_lane"],
    "trio": ["_watcher", "_cycle", "_scope", "_trio"],
}


@pytest.mark.parametrize(
    ("anyio_backend", "walk"), [(walk.split("-")[0], walk) for walk in WALKS], ids=list(WALKS)
)
async def test_a_disconnect_reaches_the_cancellation_through_each_module_once(
    anyio_backend: str, walk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call stack at the app's cancellation, read as the package's modules it passes
    through: each once, in the order the request's objects are layered (watcher, cycle, cancel
    scope, the loop's lane). A module entered twice would be state or a decision split across
    modules."""
    stacks: list[list[str]] = []

    def record() -> None:
        frames = traceback.extract_stack()[:-2]  # (this function and the patched cancel)
        modules = [Path(frame.filename).stem for frame in frames if PACKAGE in frame.filename]
        stacks.append(
            [module for i, module in enumerate(modules) if modules[i - 1 : i] != [module]]
        )

    if walk == "trio":
        import trio

        cancel = trio.CancelScope.cancel

        def cancel_and_record(self: trio.CancelScope) -> None:
            record()
            cancel(self)

        monkeypatch.setattr(trio.CancelScope, "cancel", cancel_and_record)
    else:

        class Recording(asyncio.Task):  # type: ignore[type-arg]
            def cancel(self, msg: Any = None) -> bool:
                record()
                return super().cancel(msg)

        loop = asyncio.get_running_loop()
        loop.set_task_factory(lambda loop, coro, **kw: Recording(coro, loop=loop, **kw))

    queue: asyncio.Queue[Message] | None = None
    server = ClientConnection()
    receive: Receive = server.receive
    if walk == "asyncio-by-hand":
        queue = asyncio.Queue()
        queue.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        receive = queue.get

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(30)

    middleware = CancelOnDisconnectMiddleware(app, watch_delay=0)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(middleware, http_scope(), receive, server.send)
            await anyio.sleep(0.05)
            stacks.clear()  # (the task group's own cancellations, if any)
            if queue is not None:
                queue.put_nowait({"type": "http.disconnect"})
            else:
                server.disconnect()
            await until(lambda: bool(stacks))
    finally:
        if walk != "trio":
            asyncio.get_running_loop().set_task_factory(None)
    assert stacks[0] == WALKS[walk]
