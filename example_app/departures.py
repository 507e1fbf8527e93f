"""Knowing when a request's client left, with or without `CancelOnDisconnectMiddleware`.

The engine counts the tokens it generates after a request's client has gone ("wasted"). With
the middleware, the request's `CancelToken` says when the client left. Without it (`serve
--no-middleware`, the demo's baseline), `DepartureRecorder` watches the connection and only
records: it never cancels anything, so the app behaves as it would with no wrapper at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_cancel import current_token
from asgi_cancel.vllm import abort_on_cancel

from .engine import Engine

logger = logging.getLogger("example_app")

_departure: ContextVar[_Departure] = ContextVar("example_app_departure")
# Empty `http.request` messages tolerated after the body before the reader gives up.
_MAX_EXTRA_REQUESTS = 3


@asynccontextmanager
async def engine_request(engine: Engine, request_id: str) -> AsyncIterator[None]:
    """Scope one engine request: abort it when the middleware cancels, count its waste.

    `abort_on_cancel` aborts the request the moment the client disconnects (a no-op without
    the middleware); `engine.client_gone` lets the engine count what it generates after that.
    """
    unregister = when_client_leaves(lambda: engine.client_gone(request_id))
    try:
        async with abort_on_cancel(engine, request_id):
            yield
    finally:
        unregister()


def when_client_leaves(callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback()` once if this request's client leaves before its response is complete.

    Returns:
        A function that unregisters the callback.
    """
    try:
        token = current_token()
    except RuntimeError:  # no middleware
        departure = _departure.get(None)
        return _noop if departure is None else departure.on_gone(callback)
    return token.on_cancel(callback)


def _noop() -> None:
    pass


class DepartureRecorder:
    """Record that a client left, for the engine's accounting, and change nothing else.

    Once the app has read the request body and registered a callback, one task holds the
    server's `receive()` and waits for `http.disconnect`; the app's own later `receive()` calls
    get that same message (hypercorn hands a disconnect to one caller only). That is all: no
    cancellation, so without `CancelOnDisconnectMiddleware` the app runs exactly as unwrapped.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        departure = _Departure(receive)
        reset = _departure.set(departure)

        async def send_recorded(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                departure.response_complete = True
            await send(message)

        try:
            await self.app(scope, departure.receive, send_recorded)
        finally:
            _departure.reset(reset)
            await departure.close()


class _Departure:
    def __init__(self, receive: Receive) -> None:
        self.real_receive = receive
        self.callbacks: dict[object, Callable[[], None]] = {}
        self.body_complete = False
        self.response_complete = False
        self.gone = False
        self.disconnect: Message | None = None
        self.reader: asyncio.Task[None] | None = None
        self.app_reading = False

    def on_gone(self, callback: Callable[[], None]) -> Callable[[], None]:
        if self.gone:
            callback()
            return _noop
        key = object()
        self.callbacks[key] = callback
        self._start_reading()

        def unregister() -> None:
            self.callbacks.pop(key, None)

        return unregister

    def _start_reading(self) -> None:
        if self.body_complete and self.reader is None and self.disconnect is None:
            if not self.app_reading:  # else the app is listening itself and will tell us
                self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        for _ in range(_MAX_EXTRA_REQUESTS + 1):
            message = await self.real_receive()
            if message["type"] == "http.disconnect":
                self._on_disconnect(message)
                return
        logger.debug("server keeps sending http.request after the body; not watching")

    def _on_disconnect(self, message: Message) -> None:
        self.disconnect = message
        if self.response_complete or self.gone:
            return  # h1 servers report the connection closing after a full response too
        self.gone = True
        callbacks, self.callbacks = list(self.callbacks.values()), {}
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("client-gone callback %r raised", callback)

    async def receive(self) -> Message:
        if self.disconnect is not None:
            return self.disconnect
        if self.reader is not None:
            # Waiting on the task, not awaiting it: a cancelled caller must not cancel it.
            await asyncio.wait((self.reader,))
            if self.disconnect is not None:
                return self.disconnect
        self.app_reading = True
        try:
            message = await self.real_receive()
        finally:
            self.app_reading = False
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_complete = True
            if self.callbacks:
                self._start_reading()
        elif message["type"] == "http.disconnect":
            self._on_disconnect(message)
        return message

    async def close(self) -> None:
        reader = self.reader
        if reader is not None and not reader.done():
            reader.cancel()
            await asyncio.wait((reader,))
