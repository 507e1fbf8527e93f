"""`asgi_cancel.testing.ASGITransport`: an httpx transport whose client can leave."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import httpx

from ._testing_exchange import Exchange, State
from ._validate import seconds
from .types import AnyASGIApp, Scope


class AppStillRunning(Exception):
    """The app was still running `exit_timeout` seconds after its client left or its response
    ended: it was cancelled, and the test is told (an app that ignores `http.disconnect`)."""


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, transport: ASGITransport, exchange: Exchange, timeout: float | None):
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
        if exchange.state is State.COMPLETE:
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
        self._open: set[Exchange] = set()

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
        exchange = Exchange(request, self.after_disconnect)
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

    async def finish(self, exchange: Exchange, cause: BaseException | None = None) -> None:
        """Close one exchange: the client leaves (if the response had not ended), the app is
        awaited within `exit_timeout`, and its exception, if any, raised."""
        if exchange.closed:
            return  # AppStillRunning or the app's exception was raised once, where it happened
        exchange.closed = True
        exchange.leave()
        left = exchange.state is State.LEFT
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
        """Close every response still open (their clients leave), each of them even when an
        app fails; then raise the first failure."""
        failure: BaseException | None = None
        for exchange in list(self._open):
            try:
                await self.finish(exchange)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
