"""One request's state machine: owning the server's `receive`, replaying, and deciding to cancel.

The event-loop specific parts (parking, cancelling the app, timers) live in the subclasses in
`_middleware.py` (asyncio) and `_trio.py` (trio).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ._token import CancelToken
from ._types import Message, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")

REASON = "client disconnected"
# Empty `http.request` messages tolerated after the body is complete before the watcher gives
# up on a server's receive (a server that answered every call at once would otherwise spin).
_MAX_EXTRA_REQUESTS = 3

OnCancelled = Callable[..., object]


class Cycle:
    """The middleware's view of one HTTP request/response cycle."""

    __slots__ = (
        "app_waiting",
        "body_complete",
        "buffer",
        "buffered",
        "cancel_issued",
        "disconnect",
        "done",
        "grace",
        "on_cancelled",
        "read_ahead",
        "reading",
        "real_receive",
        "real_send",
        "response_complete",
        "response_started",
        "scope",
        "started_at",
        "token",
        "trailers",
    )

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        read_ahead: int,
        grace: float,
        on_cancelled: OnCancelled | None,
    ) -> None:
        self.scope = scope
        self.real_receive = receive
        self.real_send = send
        self.read_ahead = read_ahead
        self.grace = grace
        self.on_cancelled = on_cancelled
        self.token = token = CancelToken()
        token._canceller = self.cancel_app
        self.started_at = time.monotonic()
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

    # -- event-loop specific ------------------------------------------------------------------
    async def park(self) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError

    def cancel_app(self) -> None:
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

    async def send(self, message: Message) -> None:
        if self.disconnect is not None:
            # The client is gone. Dropping is what every server does, except hypercorn over
            # HTTP/2 after the TCP connection closed, where send() would hang forever.
            return
        message_type = message["type"]
        if message_type == "http.response.body":
            if not message.get("more_body", False) and not self.trailers:
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
        await self.real_send(message)

    # -- the watcher ---------------------------------------------------------------------------
    async def watch(self) -> None:
        """Hold the server's receive until the disconnect, reading the body ahead (bounded)."""
        receive = self.real_receive
        extra = 0
        while self.disconnect is None and not self.done:
            if self.reading or (not self.body_complete and self.buffered >= self.read_ahead):
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
            listening = self.body_complete and self.app_waiting > 0
            self.fire()
            if listening:
                self.schedule_grace()
            else:
                self.token._request_cancel()
        self.wake()

    def fire(self) -> None:
        elapsed = time.monotonic() - self.started_at
        self.token._fire(REASON)
        scope = self.scope
        logger.info(
            "%s %s cancelled: %s after %.3fs (499)",
            scope.get("method", "?"),
            scope.get("path", "?"),
            REASON,
            elapsed,
        )
        if self.on_cancelled is not None:
            try:
                self.on_cancelled(
                    scope,
                    reason=REASON,
                    elapsed=elapsed,
                    response_started=self.response_started,
                )
            except Exception:
                logger.exception("asgi_cancel: on_cancelled hook raised")


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
