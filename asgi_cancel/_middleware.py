"""`CancelOnDisconnectMiddleware`: validate the options, pass non-HTTP scopes, pick a driver."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from ._asyncio import AsyncioDriver
from .types import AnyASGIApp, OnCancelled, Receive, Scope, Send

if TYPE_CHECKING:
    from ._trio import TrioDriver

_get_running_loop = asyncio.events._get_running_loop

DEFAULT_READ_AHEAD = 64 * 1024
DEFAULT_GRACE = 0.1
DEFAULT_WATCH_DELAY = 0.005


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {_describe(value)}")
    return float(value)


class CancelOnDisconnectMiddleware:
    """Cancel an ASGI app's work for a request the moment its HTTP client disconnects.

    After the request body is read (bounded read-ahead), the middleware becomes the only caller
    of the server's `receive`. When `http.disconnect` arrives before the response is complete,
    it fires the request's `CancelToken` and cancels the app task once (`Task.cancel()` on
    asyncio, a cancel scope on trio), waits for the app to finish its cleanup, and returns
    normally. Disconnects are cached and replayed to every `receive()` caller in the app.

    Only `http` scopes are handled; `websocket` and `lifespan` pass straight through.

    Args:
        app: the ASGI application to wrap.
        read_ahead: how many request-body bytes the middleware may read ahead of the app, so
            that a body the app has not read yet does not hide a disconnect. Past it, the
            server's own backpressure applies as without the middleware. Default 64 KiB.
        grace: seconds to let an app that is itself listening for `http.disconnect` (a pending
            `receive()` after the body) react before the middleware cancels what still runs.
            Default 0.1.
        on_cancelled: called once per cancelled request, in the event loop, as
            `on_cancelled(scope, reason=..., elapsed=..., response_started=...)`; `elapsed` is
            seconds from the request's first wait to the disconnect. For metrics exporters.
        watch_delay: on asyncio, seconds a request must have run (after its first wait) before
            the middleware starts watching its connection. A request that ends sooner costs no
            watcher task at all; a disconnect within that time is acted on when it ends.
            0 watches from the first wait. Default 0.005. Trio watches every request at once.

    Raises:
        TypeError: `app` is not callable.
        ValueError: an option is invalid; the message names it.
    """

    def __init__(
        self,
        app: AnyASGIApp,
        *,
        read_ahead: int = DEFAULT_READ_AHEAD,
        grace: float = DEFAULT_GRACE,
        on_cancelled: OnCancelled | None = None,
        watch_delay: float = DEFAULT_WATCH_DELAY,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI callable, got {_describe(app)}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(
                f"read_ahead must be an int of bytes >= 0, got {_describe(read_ahead)}"
            )
        if on_cancelled is not None and not callable(on_cancelled):
            raise ValueError(
                f"on_cancelled must be callable or None, got {_describe(on_cancelled)}"
            )
        self.app = app
        self.read_ahead = read_ahead
        self.grace = _seconds("grace", grace)
        self.on_cancelled = on_cancelled
        self.watch_delay = _seconds("watch_delay", watch_delay)
        self._asyncio = AsyncioDriver(app, self)
        self._trio: TrioDriver | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif _get_running_loop() is not None:
            rest = self._asyncio.start(scope, receive, send)
            if rest is not None:  # the app yielded: it is watched, and the rest awaited here
                await rest
        else:
            if self._trio is None:
                from ._trio import TrioDriver  # trio is imported only when it runs

                self._trio = TrioDriver(self.app, self)
            await self._trio.run(scope, receive, send)
