"""Carry a request's cancellation to the next hop: an httpx transport bound to its token.

```python
import httpx
from asgi_cancel.httpx import CancelTransport

client = httpx.AsyncClient(transport=CancelTransport(forward_to=["backend.internal"]))
```

Inside a request handled by `CancelOnDisconnectMiddleware`, every request this client sends
is bound to that request's token: when it should stop (`token.should_stop`: client gone,
cancelled by id, deadline passed; never inside `shield()` or a detached request), the upstream
request is closed at once, streaming or not, so the next hop's own asgi-cancel sees its client
(us) disconnect and stops its work. The request id and the remaining deadline are forwarded as
headers to the hosts in `forward_to` only, on every hop: a redirect to another host does not
carry them. Outside a request the transport is a plain pass-through. Needs the `httpx` extra
(`pip install 'asgi-cancel[httpx]'`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from ._extras import missing_extra

try:
    import anyio
    import httpx
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("httpx", exc) from exc

from ._forwarding import Forwarding, ForwardTo
from ._token import CancelToken, find_token

__all__ = ["CancelTransport", "UpstreamCancelled"]

_FORWARDED = "asgi_cancel.forwarded"  # a request extension: the headers this hop was given


class UpstreamCancelled(httpx.TransportError, asyncio.CancelledError):
    """The upstream request was closed because the request it serves was cancelled.

    An `httpx.TransportError` for code that handles upstream failures, and an
    `asyncio.CancelledError`, so that in the request's own task (where the middleware's
    cancellation and the transport's meet, and anyio's cancel scope may absorb the former) the
    middleware absorbs it as the one cancellation it caused: no error, no traceback.
    """


class CancelTransport(httpx.AsyncBaseTransport):
    """An httpx transport that binds outgoing requests to the current request's token.

    When the request should stop (`token.should_stop`), an upstream request still waiting for
    its response is cancelled (an anyio cancel scope around the send), and a response body
    still streaming is closed: the connection to the upstream server is closed, which that
    server sees as its client disconnecting. The caller gets `UpstreamCancelled` (an
    `httpx.TransportError`), or, in the request's own task, the middleware's cancellation.
    Inside `shield()` and in a detached request the upstream call is left to finish.

    Args:
        transport: the transport that sends (default `httpx.AsyncHTTPTransport()`).
        forward_to: where the request id and the remaining deadline are sent: host names
            (`["backend", "10.0.0.5:8000"]`; a host without a port matches any port), or a
            predicate `forward_to(scheme, host, port) -> bool`. Default: nowhere (an upstream
            that is not yours, a third-party API, learns nothing; the cancellation itself,
            closing the connection, reaches every upstream).
        request_id_header: the header that carries `token.request_id` (None: not sent).
        timeout_header: the header that carries the remaining deadline, in milliseconds
            (`"1234ms"`), for a next hop with `timeout_header=` (None: not sent). Both are set,
            replacing what the app may have copied from its own client.

    Raises:
        ValueError: `forward_to` holds something other than hosts, or a header option is not
            a header name.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        forward_to: ForwardTo = (),
        request_id_header: str | None = "x-request-id",
        timeout_header: str | None = "x-request-timeout",
    ) -> None:
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.forwarding = Forwarding(forward_to, request_id_header, timeout_header)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        token = find_token()
        if token is None:
            return await self.transport.handle_async_request(request)
        if token.should_stop:
            raise UpstreamCancelled(f"request cancelled: {token.reason}", request=request)
        # httpx copies a request's headers and extensions onto the request that follows its
        # redirect: what this hop was given is noted in the extensions, to be taken back
        # from the next hop if it goes to another host.
        url = request.url
        request.extensions[_FORWARDED] = self.forwarding.apply(
            request.headers,
            request.extensions.get(_FORWARDED, ()),
            token,
            url.scheme,
            url.host,
            url.port,
        )
        with anyio.CancelScope() as scope:
            unregister = token.on_cancel(lambda: scope.cancel() if token.should_stop else None)
            try:
                response = await self.transport.handle_async_request(request)
            finally:
                unregister()
        if scope.cancelled_caught:
            raise UpstreamCancelled(f"request cancelled: {token.reason}", request=request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _BoundStream(response.stream, token, request)
        return response

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
        if not self.token.should_stop or self.closed:
            return None
        if self.reading is not None:
            self.reading.cancel()
            return None
        return self.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        iterator = self.stream.__aiter__()
        while True:
            if self.token.should_stop:
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
