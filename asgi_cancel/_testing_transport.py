"""`asgi_cancel.testing.ASGITransport`: an httpx transport whose client can leave."""

from __future__ import annotations

import contextvars
import enum
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import anyio
import anyio.lowlevel
import httpx

from ._backend import library
from ._validate import seconds
from .types import AnyASGIApp, Message, Scope

# What the app may send ahead of the client's reads before `send()` waits: uvicorn's high-water
# mark. A stream then runs with the client, and the client that leaves stops it within 64 KiB.
HIGH_WATER = 65536


class AppStillRunning(Exception):
    """The app was still running `exit_timeout` seconds after its client left or its response
    ended: it was cancelled, and the test is told (an app that ignores `http.disconnect`)."""


class _State(enum.Enum):
    OPEN = "open"  # the client is reading
    COMPLETE = "complete"  # the app sent its final body message
    LEFT = "left"  # the client went away before that


class _Exchange:
    """One request: the app's `receive`/`send` on one side, the client's reads on the other."""

    def __init__(self, request: httpx.Request, after_disconnect: str) -> None:
        assert isinstance(request.stream, httpx.AsyncByteStream)  # an AsyncClient's
        self.request = request
        self._request_body: httpx.AsyncByteStream = request.stream
        self.after_disconnect = after_disconnect
        self.state = _State.OPEN
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.app_error: BaseException | None = None
        self.upload_error: Exception | None = None  # raised by the request body's iterator
        self.closed = False  # by the client's side: finish() ran
        self._uploaded: deque[bytes] = deque()  # request body read from the client, not received
        self._upload_done = False
        self._final_request_sent = False
        self._disconnect_delivered = False
        self._downloaded: deque[bytes] = deque()  # response body sent by the app, not yet read
        self._buffered = 0
        self._changed = anyio.Event()
        self.finished = anyio.Event()
        self._app_scope = anyio.CancelScope()
        self._upload_scope = anyio.CancelScope()

    def start(self, app: AnyASGIApp, scope: Scope) -> None:
        # The app outlives handle_async_request (it streams while the client reads), so it
        # cannot run in a task group of the caller's, and anyio has no task outside one: it runs
        # in tasks of the running loop's own (the package's backend seam), awaited or cancelled
        # by the response's aclose() within exit_timeout. In a context of their own, as under a
        # server, whichever the loop.
        running = library()
        assert running is not None  # an httpx call runs in an event loop
        for work in (self._upload(), self._run(app, scope)):
            contextvars.Context().run(running.spawn_detached, work)

    async def _run(self, app: AnyASGIApp, scope: Scope) -> None:
        try:
            with self._app_scope:
                await app(scope, self.receive, self.send)
        except BaseException as exc:  # handed to the client's side
            self.app_error = exc
        finally:
            self._upload_scope.cancel()
            self.finished.set()
            self._notify()

    async def _upload(self) -> None:
        # The client's side of the body, in its own task so that a receive() cancelled by the
        # app (or interrupted by the disconnect) loses no chunk of an async-iterator body.
        with self._upload_scope:
            try:
                async for chunk in self._request_body:
                    if not chunk:
                        continue
                    self._uploaded.append(chunk)
                    self._notify()
                    while len(self._uploaded) > 1:  # one ahead: the last chunk ends the body
                        await self._wait_changed()
            except Exception as exc:  # the body's own error: to the app, a dropped connection
                self.upload_error = exc
                self.leave()
                return
            self._upload_done = True
            self._notify()

    # -- the server's callables -----------------------------------------------------------------
    async def receive(self) -> Message:
        while self.state is _State.OPEN:
            if self._uploaded:
                body = self._uploaded.popleft()
                more_body = bool(self._uploaded) or not self._upload_done
                self._final_request_sent = not more_body
                self._notify()
                return {"type": "http.request", "body": body, "more_body": more_body}
            if self._upload_done and not self._final_request_sent:
                self._final_request_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self._wait_changed()
        if self._disconnect_delivered and self.after_disconnect == "block":
            await anyio.sleep_forever()
        self._disconnect_delivered = True
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        await anyio.lowlevel.checkpoint()  # a loop of sends lets the client run
        if self.state is _State.LEFT:
            return  # dropped, as servers do
        if self.state is _State.COMPLETE:
            raise RuntimeError(f"{message['type']!r} sent after the response completed")
        if message["type"] == "http.response.start":
            if self.status is not None:
                raise RuntimeError("'http.response.start' sent twice")
            self.status = message["status"]
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            if self.status is None:
                raise RuntimeError("'http.response.body' sent before 'http.response.start'")
            body = bytes(message.get("body", b""))
            if body and self.request.method != "HEAD":
                self._downloaded.append(body)
                self._buffered += len(body)
            if not message.get("more_body", False):
                self.state = _State.COMPLETE
        self._notify()
        while self._buffered >= HIGH_WATER and self.state is _State.OPEN:
            await self._wait_changed()

    # -- the client's side ----------------------------------------------------------------------
    async def wait_response_start(self, read_timeout: float | None) -> None:
        await self._wait(
            lambda: (
                self.status is not None or self.finished.is_set() or self.upload_error is not None
            ),
            read_timeout,
        )

    async def next_chunk(self, read_timeout: float | None) -> bytes | None:
        """The next body chunk; None at the end of the body."""
        await self._wait(
            lambda: (
                bool(self._downloaded) or self.state is not _State.OPEN or self.finished.is_set()
            ),
            read_timeout,
        )
        if self._downloaded:
            chunk = self._downloaded.popleft()
            self._buffered -= len(chunk)
            self._notify()
            return chunk
        return None

    def leave(self) -> None:
        """The client goes away: the app's next (or pending) `receive()` is `http.disconnect`."""
        if self.state is _State.OPEN:
            self.state = _State.LEFT
            self._notify()

    def cancel(self) -> None:
        self._app_scope.cancel()

    async def _wait(self, ready: Callable[[], bool], read_timeout: float | None) -> None:
        with anyio.move_on_after(math.inf if read_timeout is None else read_timeout) as watchdog:
            while not ready():
                await self._wait_changed()
        if watchdog.cancelled_caught:
            raise httpx.ReadTimeout(f"nothing read for {read_timeout}s", request=self.request)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, transport: ASGITransport, exchange: _Exchange, timeout: float | None):
        self._transport = transport
        self._exchange = exchange
        self._timeout = timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange = self._exchange
        while True:
            try:
                chunk = await exchange.next_chunk(self._timeout)
            except httpx.ReadTimeout as timeout:
                await self._transport.finish(exchange, timeout)
                raise
            if chunk is None:
                break
            yield chunk
        if exchange.state is _State.COMPLETE:
            return
        await self._transport.finish(exchange)  # the app ended before its final message
        if exchange.app_error is None:
            raise httpx.RemoteProtocolError(
                "the app returned before its final 'http.response.body' message",
                request=exchange.request,
            )

    async def aclose(self) -> None:
        await self._transport.finish(self._exchange)


class ASGITransport(httpx.AsyncBaseTransport):
    """Like `httpx.ASGITransport`, but streamed, and the client can leave mid-request.

    The app runs concurrently with the client: a streamed response arrives chunk by chunk as
    the app sends it (at most 64 KiB ahead of the client's reads). The client leaves, and the
    app's pending or next `receive()` returns `http.disconnect`, when:

    - a streamed response is closed before its end (leaving `async with client.stream(...)`,
      or `await response.aclose()`);
    - the client's read timeout passes (`timeout=`: `httpx.ReadTimeout` is raised);
    - the task waiting for the response is cancelled (`anyio.move_on_after`, a task group).

    Then, and whenever a response is closed, the transport waits for the app to return (so
    that its cleanup has run when the client's call returns), at most `exit_timeout` seconds:
    an app still running is cancelled and `AppStillRunning` is raised. Request bodies are
    streamed to the app as the client produces them. Works on asyncio and trio.

    Args:
        app: the ASGI application.
        raise_app_exceptions: re-raise an exception from the app in the client (on the call,
            or from the response's iteration or close). False: a 500 if no response started,
            else the body sent so far.
        root_path: the scope's `root_path`.
        client: the scope's `client`.
        exit_timeout: seconds the app may run on after its client left or its response ended.
        after_disconnect: what `receive()` does after it returned `http.disconnect` once:
            `"block"` waits forever (hypercorn, daphne), `"replay"` answers it again
            (uvicorn, granian).

    Raises:
        ValueError: `exit_timeout` is not a positive number, or `after_disconnect` is neither
            mode.
    """

    def __init__(
        self,
        app: AnyASGIApp,
        *,
        raise_app_exceptions: bool = True,
        root_path: str = "",
        client: tuple[str, int] = ("127.0.0.1", 123),
        exit_timeout: float = 5.0,
        after_disconnect: Literal["block", "replay"] = "block",
    ) -> None:
        exit_timeout = seconds("exit_timeout", exit_timeout, positive=True)
        if after_disconnect not in ("block", "replay"):
            raise ValueError(
                f"after_disconnect must be 'block' or 'replay', got {after_disconnect!r}"
            )
        self.app = app
        self.raise_app_exceptions = raise_app_exceptions
        self.root_path = root_path
        self.client = client
        self.exit_timeout = float(exit_timeout)
        self.after_disconnect = after_disconnect
        self._open: set[_Exchange] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scope: Scope = {  # what httpx.ASGITransport gives
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port),
            "client": self.client,
            "root_path": self.root_path,
        }
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        read_timeout: float | None = timeouts.get("read")
        exchange = _Exchange(request, self.after_disconnect)
        self._open.add(exchange)
        exchange.start(self.app, scope)
        try:
            await exchange.wait_response_start(read_timeout)
        except BaseException as exc:  # a timeout, or the caller cancelled: the client leaves
            await self.finish(exchange, exc)
            raise
        if exchange.upload_error is not None:  # raised on the call, as httpx's transport does
            await self.finish(exchange, exchange.upload_error)
            raise exchange.upload_error
        if exchange.status is None:  # the app ended without a response
            await self.finish(exchange)
            if exchange.app_error is None:
                raise httpx.RemoteProtocolError(
                    "the app returned without sending 'http.response.start'", request=request
                )
            return httpx.Response(500, request=request)
        stream = _ResponseStream(self, exchange, read_timeout)
        return httpx.Response(exchange.status, headers=exchange.headers, stream=stream)

    async def finish(self, exchange: _Exchange, cause: BaseException | None = None) -> None:
        """Close one exchange: the client leaves (if the response had not ended), the app is
        awaited within `exit_timeout`, and its exception, if any, raised."""
        if exchange.closed:
            return  # AppStillRunning or the app's exception was raised once, where it happened
        exchange.closed = True
        exchange.leave()
        left = exchange.state is _State.LEFT
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.exit_timeout):
                await exchange.finished.wait()
            still_running = not exchange.finished.is_set()
            if still_running:
                exchange.cancel()
                with anyio.move_on_after(self.exit_timeout):
                    await exchange.finished.wait()
        self._open.discard(exchange)
        request = exchange.request
        if still_running:
            what = "its client left" if left else "its response ended"
            stopped = "cancelled"
            if not exchange.finished.is_set():
                stopped = "it ignored the cancellation too"
            raise AppStillRunning(
                f"{request.method} {request.url.path}: the app was still running "
                f"{self.exit_timeout:g}s after {what} ({stopped})"
            ) from cause
        error = exchange.app_error
        if error is None or not self.raise_app_exceptions:
            return
        if isinstance(error, anyio.get_cancelled_exc_class()):
            return  # the event loop is shutting down
        raise error

    async def aclose(self) -> None:
        """Close every response still open (their clients leave)."""
        for exchange in list(self._open):
            await self.finish(exchange)
