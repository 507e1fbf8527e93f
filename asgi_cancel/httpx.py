"""Carry a request's cancellation to the next hop: an httpx transport bound to its token.

```python
import httpx
from asgi_cancel.httpx import CancelTransport

client = httpx.AsyncClient(transport=CancelTransport())
```

Inside a request handled by `CancelOnDisconnectMiddleware`, every request this client sends
is bound to that request's token: when it fires (client gone, cancelled by id, deadline
passed), the upstream request is closed at once, streaming or not, so the next hop's own
asgi-cancel sees its client (us) disconnect and stops its work. The request id and the
remaining deadline are forwarded as headers. Outside a request the transport is a plain
pass-through. httpx is imported only by this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

import anyio
import httpx

from ._token import CancelToken, current_token

__all__ = ["CancelTransport", "UpstreamCancelled"]


class UpstreamCancelled(httpx.TransportError, asyncio.CancelledError):
    """The upstream request was closed because the request it serves was cancelled.

    An `httpx.TransportError` for code that handles upstream failures, and an
    `asyncio.CancelledError`, so that in the request's own task (where the middleware's
    cancellation and the transport's meet, and anyio's cancel scope may absorb the former) the
    middleware absorbs it as the one cancellation it caused: no error, no traceback.
    """


def _token() -> CancelToken | None:
    try:
        return current_token()
    except RuntimeError:
        return None


class CancelTransport(httpx.AsyncBaseTransport):
    """An httpx transport that binds outgoing requests to the current request's token.

    When the token fires, an upstream request still waiting for its response is cancelled
    (an anyio cancel scope around the send), and a response body still streaming is closed:
    the connection to the upstream server is closed, which that server sees as its client
    disconnecting. The caller gets `UpstreamCancelled` (an `httpx.TransportError`), or, in
    the request's own task, the middleware's cancellation. Inside `shield()` the upstream
    call is left to finish, as the app's own cancellation waits.

    Args:
        transport: the transport that sends (default `httpx.AsyncHTTPTransport()`).
        request_id_header: the header that forwards `token.request_id` (None: not sent).
        timeout_header: the header that forwards the remaining deadline, in milliseconds
            (`"1234ms"`), for a next hop with `timeout_header=` (None: not sent).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        request_id_header: str | None = "x-request-id",
        timeout_header: str | None = "x-request-timeout",
    ) -> None:
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.request_id_header = request_id_header
        self.timeout_header = timeout_header

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        token = _token()
        if token is None:
            return await self.transport.handle_async_request(request)
        if token.cancelled:
            raise UpstreamCancelled(f"request cancelled: {token.reason}", request=request)
        self._forward(token, request)
        with anyio.CancelScope() as scope:
            unregister = token.on_cancel(lambda: None if token.shielded else scope.cancel())
            try:
                response = await self.transport.handle_async_request(request)
            finally:
                unregister()
        if scope.cancelled_caught:
            raise UpstreamCancelled(f"request cancelled: {token.reason}", request=request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _BoundStream(response.stream, token, request)
        return response

    def _forward(self, token: CancelToken, request: httpx.Request) -> None:
        headers = request.headers
        if self.request_id_header and token.request_id is not None:
            headers.setdefault(self.request_id_header, token.request_id)
        remaining = token.remaining()
        if self.timeout_header and remaining is not None:
            headers.setdefault(self.timeout_header, f"{int(remaining * 1000)}ms")

    async def aclose(self) -> None:
        await self.transport.aclose()


class _BoundStream(httpx.AsyncByteStream):
    """A response body closed when the token fires: the read in progress is cancelled, or,
    between reads, the stream is closed at once (a task the middleware awaits)."""

    def __init__(
        self, stream: httpx.AsyncByteStream, token: CancelToken, request: httpx.Request
    ) -> None:
        self.stream = stream
        self.token = token
        self.request = request
        self.reading: anyio.CancelScope | None = None
        self.closed = False
        self.unregister = token.on_cancel(self._on_cancel)

    def _on_cancel(self) -> Awaitable[None] | None:
        if self.token.shielded or self.closed:
            return None
        if self.reading is not None:
            self.reading.cancel()
            return None
        return self.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        iterator = self.stream.__aiter__()
        while True:
            if self.token.cancelled and not self.token.shielded:
                await self.aclose()
                raise UpstreamCancelled(
                    f"request cancelled: {self.token.reason}", request=self.request
                )
            with anyio.CancelScope() as scope:
                self.reading = scope
                try:
                    chunk = await iterator.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    self.reading = None
            if scope.cancelled_caught:
                continue  # closed above, with the reason
            yield chunk

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.unregister()
            await self.stream.aclose()
