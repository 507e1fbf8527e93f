"""asgi_cancel.testing.ASGITransport: streamed responses, and a client that leaves (closing the
stream, a read timeout, a cancelled call). Each behaviour has its control: httpx's own
ASGITransport, which buffers the response and never makes the client leave."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import httpx
import pytest

import asgi_cancel.testing
from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.testing import AppStillRunning, ASGITransport
from asgi_cancel.types import ASGIApp, Message, Receive, Scope, Send

from .helpers import DISCONNECT, REQUEST_DONE
from .test_packaging import run_hidden

# Leaving `async for` over an httpx stream early (what these tests do, and users) leaves httpx's
# async generators to the garbage collector, which trio's finalizer warns about: not ours.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

TEXT = [(b"content-type", b"text/plain")]
START = {"type": "http.response.start", "status": 200, "headers": TEXT}


@dataclass
class Seen:
    """What a test app went through."""

    chunks_sent: int = 0
    received: list[str] = field(default_factory=list)
    complete: bool = False
    ended: bool = False


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def streamer(seen: Seen, chunks: int = 200) -> ASGIApp:
    """Streams `chunks` chunks while listening for the disconnect, as Starlette does."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await receive()
            await send(START)
            async with anyio.create_task_group() as tg:

                async def listen() -> None:
                    await wait_disconnect(receive)
                    seen.received.append("http.disconnect")
                    tg.cancel_scope.cancel()

                tg.start_soon(listen)
                for index in range(chunks):
                    await send(
                        {"type": "http.response.body", "body": b"%d," % index, "more_body": True}
                    )
                    seen.chunks_sent += 1
                    await anyio.sleep(0.001)
                await send({"type": "http.response.body", "body": b""})
                seen.complete = True
        finally:
            seen.ended = True

    return app


def waiter(seen: Seen, sleep: float = 0.3, *, mid_stream: bool = False) -> ASGIApp:
    """Answers (or ends its stream) after `sleep` seconds, unless the client leaves first."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if mid_stream:
            await send(START)
            await send({"type": "http.response.body", "body": b"early ", "more_body": True})
        with anyio.move_on_after(sleep):
            await wait_disconnect(receive)
            seen.received.append("http.disconnect")
            return
        if not mid_stream:
            await send(START)
        await send({"type": "http.response.body", "body": b"late"})
        seen.complete = True

    return app


TRANSPORTS = [ASGITransport, httpx.ASGITransport]
IDS = ["ours", "control-httpx"]


def client(transport: httpx.AsyncBaseTransport, **kwargs: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, base_url="http://testserver", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", TRANSPORTS, ids=IDS)
async def test_a_stream_runs_with_the_client_not_before_it(transport: type) -> None:
    read_first = anyio.Event()
    chunks: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(START)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await read_first.wait()  # the client has it before the app goes on
        await send({"type": "http.response.body", "body": b"second"})

    # The control buffers the whole response: its client never gets the first chunk.
    with anyio.move_on_after(5 if transport is ASGITransport else 0.5) as watchdog:
        async with client(transport(app)) as http, http.stream("GET", "/") as response:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                read_first.set()
    assert watchdog.cancelled_caught is (transport is httpx.ASGITransport)
    assert chunks == ([b"first", b"second"] if transport is ASGITransport else [])


@pytest.mark.parametrize(
    ("transport", "how"),
    [(ASGITransport, "break"), (ASGITransport, "aclose"), (httpx.ASGITransport, "break")],
    ids=["break", "aclose", "control-httpx"],
)
async def test_closing_a_stream_delivers_the_disconnect_then_the_app_has_ended(
    transport: type, how: str
) -> None:
    seen = Seen()
    with anyio.fail_after(5 if transport is ASGITransport else 10):
        async with client(transport(streamer(seen))) as http:
            if how == "break":
                async with http.stream("GET", "/") as response:
                    async for _ in response.aiter_raw():
                        break
            else:
                response = await http.send(http.build_request("GET", "/"), stream=True)
                await response.aiter_raw().__anext__()
                await response.aclose()
            assert seen.ended  # already, when the client's call returns
    if transport is httpx.ASGITransport:  # the whole stream made for a client that read one chunk
        assert (seen.complete, seen.chunks_sent) == (True, 200)
    else:
        assert (seen.received, seen.complete) == (["http.disconnect"], False)
        assert seen.chunks_sent < 200


@pytest.mark.parametrize(
    ("transport", "mid_stream"),
    [(ASGITransport, False), (ASGITransport, True), (httpx.ASGITransport, False)],
    ids=["before-the-response", "mid-stream", "control-httpx"],
)
async def test_a_read_timeout_is_the_client_leaving(transport: type, mid_stream: bool) -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with client(transport(waiter(seen, mid_stream=mid_stream)), timeout=0.05) as http:
            if transport is httpx.ASGITransport:  # the control ignores the timeout
                assert (await http.get("/")).content == b"late"
                assert seen.received == []
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await http.get("/")
                assert seen.received == ["http.disconnect"]  # before the ReadTimeout reached us
    assert seen.complete is (transport is httpx.ASGITransport)


async def test_a_cancelled_call_is_the_client_leaving() -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with client(ASGITransport(waiter(seen, sleep=3))) as http:
            with anyio.move_on_after(0.05):
                await http.get("/")
            assert seen.received == ["http.disconnect"]


@pytest.mark.parametrize("middleware", [False, True], ids=["reported", "under-the-middleware"])
async def test_an_app_that_ignores_the_disconnect_is_cancelled(middleware: bool) -> None:
    """Alone, the transport cancels it `exit_timeout` after the client left and says so; under
    the middleware, the middleware has stopped it when the client's call returns."""
    cleanup: list[str] = []

    async def stubborn(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await anyio.sleep(30)
        finally:
            cleanup.append("cancelled")

    app = CancelOnDisconnectMiddleware(stubborn) if middleware else stubborn
    transport = ASGITransport(app, exit_timeout=2 if middleware else 0.1)
    reported = r"GET /x: .* 0\.1s after its client left \(cancelled\)"
    with anyio.fail_after(5):
        async with client(transport, timeout=0.05) as http:
            if middleware:
                with pytest.raises(httpx.ReadTimeout):
                    await http.get("/x")
            else:
                with pytest.raises(AppStillRunning, match=reported):
                    await http.get("/x")
            assert cleanup == ["cancelled"]


async def test_it_is_reported_once_where_the_client_left() -> None:
    async def stubborn_stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send(START)
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await anyio.sleep(30)

    transport = ASGITransport(stubborn_stream, exit_timeout=0.05)
    with anyio.fail_after(5):
        async with client(transport, timeout=0.05) as http:
            with pytest.raises(AppStillRunning) as caught:
                async with http.stream("GET", "/") as response:
                    await response.aread()  # the timeout, then the close: one report
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)
    assert caught.value.__context__ is caught.value.__cause__


@pytest.mark.parametrize("slow", ["client", "app"])
async def test_a_streamed_request_body_arrives_whole_in_order_once(slow: str) -> None:
    parts = [b"a" * 10, b"", b"b" * 70_000, b"c", b"d", b"e"]
    received: list[Message] = []

    async def echo(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            if slow == "app":
                await anyio.sleep(0.005)
            # Cancelled receives (a middleware polling, a timeout) must lose no chunk.
            with anyio.move_on_after(0.001):
                message = await receive()
                received.append(message)
                if not message.get("more_body", False):
                    break
        body = b"".join(m["body"] for m in received)
        await send(START)
        await send({"type": "http.response.body", "body": body})

    async def upload() -> AsyncIterator[bytes]:
        for part in parts:
            if slow == "client":
                await anyio.sleep(0.005)
            yield part

    with anyio.fail_after(5):
        async with client(ASGITransport(echo)) as http:
            response = await http.post("/", content=upload())
    assert response.content == b"".join(parts)
    assert [m["more_body"] for m in received] == [True] * (len(received) - 1) + [False]
    assert all(m["type"] == "http.request" for m in received)


async def test_a_request_without_a_body_is_one_message_then_the_disconnect() -> None:
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        received.append(await receive())
        await send(START)
        await send({"type": "http.response.body", "body": b"ok"})
        received.append(await receive())

    with anyio.fail_after(5):
        async with client(ASGITransport(app)) as http:
            assert (await http.get("/")).text == "ok"
    assert received == [REQUEST_DONE, DISCONNECT]


async def boom_before(scope: Scope, receive: Receive, send: Send) -> None:
    raise ValueError("before the response")


async def boom_mid_stream(scope: Scope, receive: Receive, send: Send) -> None:
    await send(START)
    await send({"type": "http.response.body", "body": b"partial", "more_body": True})
    raise ValueError("mid-stream")


@pytest.mark.parametrize("app", [boom_before, boom_mid_stream], ids=["before", "mid-stream"])
@pytest.mark.parametrize("transport", [ASGITransport, httpx.ASGITransport], ids=["ours", "httpx"])
async def test_app_exceptions_propagate_as_with_httpx(app: ASGIApp, transport: type) -> None:
    with anyio.fail_after(5):
        async with client(transport(app)) as http:
            with pytest.raises(ValueError, match=r"^(before the response|mid-stream)$"):
                await http.get("/")
        async with client(transport(app, raise_app_exceptions=False)) as http:
            response = await http.get("/")
    if app is boom_before:
        assert (response.status_code, response.content) == (500, b"")
    else:
        assert (response.status_code, response.content) == (200, b"partial")


async def test_closing_the_client_closes_the_streams_left_open() -> None:
    seen = Seen()
    with anyio.fail_after(5):
        async with client(ASGITransport(streamer(seen))) as http:
            await http.send(http.build_request("GET", "/"), stream=True)  # never closed
    assert seen.ended
    assert seen.received == ["http.disconnect"]


async def test_a_client_that_reads_nothing_holds_the_app_at_64_kib() -> None:
    sent = 0
    held = anyio.Event()

    async def firehose(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal sent
        await send(START)
        while True:
            with anyio.move_on_after(0.1) as blocked:
                await send({"type": "http.response.body", "body": b"x" * 1024, "more_body": True})
                sent += 1024
            if blocked.cancelled_caught:
                held.set()
                await wait_disconnect(receive)
                return

    with anyio.fail_after(5):
        async with client(ASGITransport(firehose, exit_timeout=0.5)) as http:
            async with http.stream("GET", "/"):
                await held.wait()
    assert 60 * 1024 <= sent < 64 * 1024  # the send that reached 64 KiB waits


@pytest.mark.parametrize(("mode", "second"), [("block", "blocked"), ("replay", "http.disconnect")])
async def test_after_disconnect_mimics_the_servers(mode: str, second: str) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send(START)
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append((await receive())["type"])
        with anyio.move_on_after(0.05):
            seen.append((await receive())["type"])
            return
        seen.append("blocked")

    with anyio.fail_after(5):
        async with client(ASGITransport(app, after_disconnect=mode)) as http:  # type: ignore[arg-type]
            async with http.stream("GET", "/") as response:
                await response.aiter_raw().__anext__()
    assert seen == ["http.disconnect", second]


async def test_head_gets_the_headers_and_no_body() -> None:
    async def hello(scope: Scope, receive: Receive, send: Send) -> None:
        await send(START)
        await send({"type": "http.response.body", "body": b"hello"})

    with anyio.fail_after(5):
        async with client(ASGITransport(hello)) as http:
            assert (await http.head("/")).content == b""
            assert (await http.get("/")).content == b"hello"


async def start(send: Send) -> None:
    await send(START)


async def body(send: Send) -> None:
    await send({"type": "http.response.body", "body": b""})


async def cut(send: Send) -> None:
    await send({"type": "http.response.body", "body": b"cut", "more_body": True})


@pytest.mark.parametrize(
    ("steps", "error", "match"),
    [
        ([body], RuntimeError, "'http.response.body' sent before 'http.response.start'"),
        ([start, start], RuntimeError, "'http.response.start' sent twice"),
        (
            [start, body, body],
            RuntimeError,
            "'http.response.body' sent after the response completed",
        ),
        ([start, cut], httpx.RemoteProtocolError, "final 'http.response.body'"),
        ([], httpx.RemoteProtocolError, "'http.response.start'"),
    ],
    ids=["body-first", "start-twice", "after-the-end", "no-final-body", "no-response"],
)
async def test_messages_out_of_order_or_missing_are_errors(
    steps: list[Callable[[Send], Awaitable[None]]], error: type[Exception], match: str
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        for step in steps:
            await step(send)

    with anyio.fail_after(5):
        async with client(ASGITransport(app)) as http:
            with pytest.raises(error, match=re.escape(match)):
                await http.get("/")


async def test_an_app_that_ignores_the_cancellation_too_is_reported_and_left() -> None:
    async def shielded(scope: Scope, receive: Receive, send: Send) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.5)

    with anyio.fail_after(5):
        async with client(ASGITransport(shielded, exit_timeout=0.05), timeout=0.05) as http:
            with pytest.raises(AppStillRunning, match="ignored the cancellation too"):
                await http.get("/")
        await anyio.sleep(0.5)  # it ends on its own


def test_an_unknown_after_disconnect_is_a_value_error() -> None:  # exit_timeout: test_validate
    with pytest.raises(ValueError, match="after_disconnect"):
        ASGITransport(boom_before, after_disconnect="sometimes")  # type: ignore[arg-type]


def test_without_httpx_the_transport_names_its_extra_and_client_connection_still_imports() -> None:
    body = (
        "import asgi_cancel.testing as testing\n"
        "assert testing.ClientConnection\n"
        "try:\n    from asgi_cancel.testing import ASGITransport\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    message = run_hidden(("httpx",), body)
    assert message.startswith("asgi_cancel.testing needs ")
    assert "(httpx is missing)" in message
    assert message.endswith("pip install 'asgi-cancel[testing]'")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        asgi_cancel.testing.Nope  # noqa: B018


async def test_a_failing_request_body_is_raised_on_the_call_and_the_app_sees_a_disconnect() -> None:
    """The body's iterator fails mid-upload: to the app, the connection dropped (it is told,
    not left waiting for the rest of the body); to the client, the iterator's error."""
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            received.append(await receive())
            if received[-1]["type"] == "http.disconnect":
                return

    async def body() -> AsyncIterator[bytes]:
        yield b"a"
        raise OSError("the file went away")

    async with client(ASGITransport(app)) as http:
        with anyio.fail_after(5):  # the watchdog: this hung before
            with pytest.raises(OSError, match="the file went away"):
                await http.post("/", content=body())
    assert received[-1]["type"] == "http.disconnect"
    assert all(m["more_body"] for m in received[:-1]), "never told the body was whole"


async def test_closing_the_client_closes_every_open_response_even_when_an_app_fails() -> None:
    ended: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await receive()  # the client leaves
        ended.append(scope["path"])
        raise RuntimeError(f"cleanup of {scope['path']} failed")

    http = client(ASGITransport(app, exit_timeout=1))
    with anyio.fail_after(10):
        await http.send(http.build_request("GET", "/a"), stream=True)
        await http.send(http.build_request("GET", "/b"), stream=True)
        with pytest.raises(RuntimeError, match=r"cleanup of /[ab] failed"):
            await http.aclose()  # the first failure, once every app was told
    assert sorted(ended) == ["/a", "/b"]
