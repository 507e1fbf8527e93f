"""One request's state machine: owning the server's `receive`, replaying, and deciding to cancel.

The event-loop specific parts (parking, cancelling the app, timers) live in the subclasses in
`_middleware.py` (asyncio) and `_trio.py` (trio).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from time import monotonic as _monotonic
from typing import Any, Protocol

from ._token import CancelToken
from ._types import Message, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")

REASON = "client disconnected"
# Empty `http.request` messages tolerated after the body is complete before the watcher gives
# up on a server's receive (a server that answered every call at once would otherwise spin).
_MAX_EXTRA_REQUESTS = 3

OnCancelled = Callable[..., object]


class Cycle(CancelToken):
    """The middleware's view of one HTTP request/response cycle, and its `CancelToken`.

    One object per request: the token the app sees is the cycle itself, so a request that
    never waits costs a single allocation and no reference cycle.
    """

    __slots__ = (
        "app_waiting",
        "body_complete",
        "buffer",
        "buffered",
        "cancel_issued",
        "config",
        "disconnect",
        "done",
        "grace_timer",
        "lot",
        "reading",
        "real_receive",
        "real_send",
        "response_complete",
        "response_started",
        "scope",
        "spawned",
        "started_at",
        "task",
        "trailers",
        "watcher",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send, config: Config) -> None:
        self.scope = scope
        self.real_receive = receive
        self.real_send = send
        self.config = config
        self.started_at = _monotonic()
        # CancelToken's fields, set here rather than through super().__init__() (hot path).
        self._cancelled = False
        self._reason: str | None = None
        self._callbacks: dict[object, Any] | None = None
        self._shield_depth = 0
        self._deferred = False
        self.buffer: deque[Message] | None = None
        self.buffered = 0
        self.body_complete = False
        self.disconnect: Message | None = None
        self.reading = False
        self.app_waiting = 0
        self.response_started = False
        self.response_complete = False
        self.trailers = False
        self.done = False
        self.cancel_issued = False
        # Filled by the event-loop specific subclass, when needed.
        self.task: Any = None
        self.lot: Any = None
        self.watcher: Any = None
        self.grace_timer: Any = None
        self.spawned: Any = None

    # -- event-loop specific ------------------------------------------------------------------
    async def park(self) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError

    def schedule_grace(self) -> None:
        raise NotImplementedError

    async def checkpoint(self) -> None:
        raise NotImplementedError

    # -- what the app sees --------------------------------------------------------------------
    async def receive(self) -> Message:
        self.app_waiting += 1
        try:
            while True:
                if self.buffer:
                    message = self.buffer.popleft()
                    if self.buffered:
                        self.buffered -= len(message.get("body", b""))
                        self.wake()  # a watcher parked on the read-ahead limit may go on
                    return message
                if self.disconnect is not None:
                    return self.disconnect
                if not self.reading:
                    # Nobody holds the server's receive: read it ourselves, no task needed.
                    return await self._read_for_app()
                await self.park()
        finally:
            self.app_waiting -= 1

    async def _read_for_app(self) -> Message:
        self.reading = True
        try:
            message = await self.real_receive()
        finally:
            self.reading = False
            self.wake()
        message_type = message["type"]
        if message_type == "http.request":
            if not message.get("more_body", False):
                self.body_complete = True
        elif message_type == "http.disconnect":
            self.on_disconnect(message)
            if self.cancel_issued:
                await self.checkpoint()  # the cancellation lands here, not in the app's handler
        return message

    def send(self, message: Message) -> Awaitable[None]:
        # A plain function handing back the server's own awaitable: no coroutine frame of our
        # own on the per-token path, only these flag checks.
        if self.disconnect is not None:
            # The client is gone. Dropping is what every server does, except hypercorn over
            # HTTP/2 after the TCP connection closed, where send() would hang forever.
            return _dropped()
        message_type = message["type"]
        if message_type == "http.response.body":
            if not self.trailers and not message.get("more_body", False):
                # Set BEFORE awaiting: hypercorn-trio delivers the disconnect before it returns.
                self.response_complete = True
        elif message_type == "http.response.start":
            self.response_started = True
            self.trailers = bool(message.get("trailers", False))
        elif message_type == "http.response.trailers":
            if not message.get("more_trailers", False):
                self.response_complete = True
        elif message_type in ("http.response.pathsend", "http.response.zerocopy"):
            self.response_complete = True
        return self.real_send(message)

    # -- the watcher ---------------------------------------------------------------------------
    async def watch(self) -> None:
        """Hold the server's receive until the disconnect, reading the body ahead (bounded)."""
        try:
            await self._watch()
        finally:
            # Whatever ended the watch, app callers parked behind it must re-check: they may
            # now have to read the server's receive themselves.
            self.wake()

    async def _watch(self) -> None:
        receive = self.real_receive
        read_ahead = self.config.read_ahead
        extra = 0
        while self.disconnect is None and not self.done:
            # At least one message is read ahead whatever `read_ahead` says: a request with no
            # body is watched from the start.
            if self.reading or (
                not self.body_complete and self.buffered and self.buffered >= read_ahead
            ):
                await self.park()
                continue
            self.reading = True
            try:
                message = await receive()
            except Exception:
                # The app will meet the same error on its own receive; watching is over.
                logger.debug("asgi_cancel: server receive() raised; not watching", exc_info=True)
                return
            finally:
                self.reading = False
            message_type = message["type"]
            if message_type == "http.disconnect":
                self.on_disconnect(message)
                return
            if message_type == "http.request":
                if self.body_complete:
                    if not message.get("body"):
                        # Some servers send an empty extra http.request after the body.
                        extra += 1
                        if extra > _MAX_EXTRA_REQUESTS:
                            logger.debug("asgi_cancel: server keeps sending http.request")
                            return
                        continue
                elif not message.get("more_body", False):
                    self.body_complete = True
                self.buffered += len(message.get("body", b""))
            if self.buffer is None:
                self.buffer = deque()
            self.buffer.append(message)
            self.wake()

    def on_disconnect(self, message: Message) -> None:
        self.disconnect = message
        if not self.response_complete and not self.done:
            # The app is listening itself when it waits in receive() after the whole body
            # (Starlette's StreamingResponse below spec 2.4, vLLM's with_cancellation): give it
            # the message first, and cancel only what still runs after the grace period.
            # Callers already handed a buffered message (woken, not yet resumed) are not
            # listening: they are still reading the body.
            listening = self.body_complete and self.app_waiting > len(self.buffer or ())
            try:
                self.fire()
            finally:
                if listening:
                    self.schedule_grace()
                else:
                    self._request_cancel()
        self.wake()

    def fire(self) -> None:
        elapsed = _monotonic() - self.started_at
        self._fire(REASON)
        scope = self.scope
        logger.info(
            "%s %s cancelled: %s after %.3fs (499)",
            scope.get("method", "?"),
            scope.get("path", "?"),
            REASON,
            elapsed,
        )
        on_cancelled = self.config.on_cancelled
        if on_cancelled is not None:
            try:
                on_cancelled(
                    scope,
                    reason=REASON,
                    elapsed=elapsed,
                    response_started=self.response_started,
                )
            except (Exception, asyncio.CancelledError):
                logger.exception("asgi_cancel: on_cancelled hook raised")


async def _dropped() -> None:
    pass


async def send_cancelled_response(scope: Scope, send: Send) -> None:
    """Complete a request the client left, that the app ended without a response: 499.

    The server drops it (the client is gone), but a middleware outside this one that waits
    for a response gets one instead of raising: Starlette's `BaseHTTPMiddleware` would log
    "RuntimeError: No response returned." for every cancelled request.
    """
    try:
        await send({"type": "http.response.start", "status": 499, "headers": []})
        if scope.get("http_version", "1.1") in ("1.0", "1.1"):
            # Not over HTTP/2: there hypercorn hangs on a body sent after the connection
            # closed (the start alone returns), and a response start is all an outer
            # middleware waits for.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:  # ASGI lets a server raise OSError for a send to a closed connection
        logger.debug("asgi_cancel: the 499 for a cancelled request was refused", exc_info=True)


class Config(Protocol):
    """What a cycle reads from its middleware (only when it needs it)."""

    read_ahead: int
    grace: float
    on_cancelled: OnCancelled | None
