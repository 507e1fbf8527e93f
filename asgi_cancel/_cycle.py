"""One request's state machine: owning the server's `receive`, replaying, deciding to cancel.

No event-loop code here: parking, cancelling the app and timers are the `Loop` a driver
(`_asyncio.py`, `_trio.py`) attaches to the cycle, only once the request needs one.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import Any, Protocol

from ._report import report_cancelled
from ._token import Canceller, CancelToken
from .types import Message, OnCancelled, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")

REASON = "client disconnected"
# Empty `http.request` messages tolerated after the body is complete before the watcher gives
# up on a server's receive (a server that answered every call at once would otherwise spin).
_MAX_EXTRA_REQUESTS = 3
_COMPLETING = ("http.response.pathsend", "http.response.zerocopy")


class State(enum.IntEnum):
    """Where a request is; what a disconnect means in each state is in the comments."""

    READING_BODY = 0  # body messages still to come: a disconnect cancels
    WATCHING = 1  # body complete, response not: a disconnect cancels (or lets a listener react)
    RESPONSE_COMPLETE = 2  # final response message handed to send: a disconnect is the normal end
    CANCELLED = 3  # the client left first: token fired, app cancelled, sends dropped
    FINISHED = 4  # the app returned: a late receive() gets a disconnect, a send is dropped


_READING_BODY = State.READING_BODY
_WATCHING = State.WATCHING
_RESPONSE_COMPLETE = State.RESPONSE_COMPLETE
_CANCELLED = State.CANCELLED
_FINISHED = State.FINISHED


class Options(Protocol):
    """What a cycle reads from its middleware (only when it needs it)."""

    read_ahead: int
    grace: float
    on_cancelled: OnCancelled | None
    watch_delay: float


class Loop(Canceller, Protocol):
    """What one request needs from its event loop; a driver attaches one to the cycle."""

    async def park(self) -> None:
        """Wait until `wake()`."""

    def wake(self) -> None:
        """Wake every parked caller."""

    async def checkpoint(self) -> None:
        """Let a pending cancellation of the app task land."""

    def start_grace(self) -> None:
        """Give an app that listens for the disconnect itself `grace` seconds, then decide."""

    async def cancel_body_reader(self) -> None:
        """The app task reads its body after the client left: let its cancellation land."""


class Cycle:
    """The middleware's view of one HTTP request/response cycle.

    Slim on purpose: a request that never waits touches only the first group of fields.
    `send()` parses nothing; the last message sent is read only when a disconnect needs to
    know whether the response was complete.
    """

    __slots__ = (
        "app_waiting",
        "attach",
        "body_complete",
        "buffer",
        "buffered",
        "disconnect",
        "first_sent",
        "last_sent",
        "loop",
        "options",
        "reading",
        "real_receive",
        "real_send",
        "scope",
        "sending",
        "started_at",
        "state",
        "status",
        "token_if_made",
    )

    scope: Scope
    real_receive: Receive
    real_send: Send
    options: Options
    attach: Callable[[Cycle], Loop]
    token_if_made: CancelToken | None  # made on first use (`token`): most requests never need one
    state: State
    disconnect: Message | None
    first_sent: Message | None
    last_sent: Message | None
    # What the server's send() returned for the last message: set with `last_sent` (read only
    # once that says the response is complete).
    sending: Awaitable[None]
    loop: Loop | None
    body_complete: bool
    reading: bool
    app_waiting: int
    buffer: deque[Message] | None
    buffered: int
    started_at: float
    status: int  # set by stop() only, read only after it

    @property
    def token(self) -> CancelToken:
        """The request's token, made on first use (by the app's `current_token()`, possibly
        in a worker thread, or by a cancellation)."""
        token = self.token_if_made
        if token is None:
            with _MAKING_TOKEN:
                token = self.token_if_made
                if token is None:
                    token = self.token_if_made = CancelToken()
        return token

    @property
    def cancelled(self) -> bool:
        """Whether the request's token fired (without making one)."""
        token = self.token_if_made
        return token is not None and token.cancelled

    def attached(self) -> Loop:
        """The request's `Loop`, attached on first need (a yield, a disconnect)."""
        loop = self.loop
        if loop is None:
            loop = self.loop = self.attach(self)
            self.started_at = monotonic()
        return loop

    # -- what the app sees ---------------------------------------------------------------------
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
                    if self.state is _CANCELLED and not self.body_complete:
                        # Mid-body, after a cancellation that had to wait (the app was in a
                        # worker thread): it lands here rather than as http.disconnect, which
                        # a framework would turn into an error (Starlette's ClientDisconnect).
                        await self.attached().cancel_body_reader()
                    return self.disconnect
                if not self.reading:
                    # Nobody holds the server's receive: read it ourselves, no task needed.
                    return await self._read_for_app()
                await self.attached().park()
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
                self._body_completed()
        elif message_type == "http.disconnect":
            if self.on_disconnect(message):
                await self.attached().checkpoint()  # the cancellation lands here, not in the app
        return message

    def send(self, message: Message) -> Awaitable[None]:
        # A plain function handing back the server's own awaitable: no coroutine frame, no
        # parsing. The message is recorded BEFORE the server's send is awaited: hypercorn-trio
        # delivers the disconnect before that send returns, and must find the response complete.
        if self.disconnect is not None:
            # The client is gone. Dropping is what every server does, except hypercorn over
            # HTTP/2 after the TCP connection closed, where send() would hang forever.
            return _dropped()
        if self.first_sent is None:
            self.first_sent = message
        self.last_sent = message
        real_send = self.real_send  # (a slot read: `self.real_send(...)` is not specialised)
        sending = self.sending = real_send(message)
        return sending

    def wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    # -- state ---------------------------------------------------------------------------------
    @property
    def response_started(self) -> bool:
        return self.first_sent is not None

    def _body_completed(self) -> None:
        self.body_complete = True
        if self.state is _READING_BODY:
            self.state = _WATCHING

    def _response_complete(self) -> bool:
        """Whether the last message sent ended the response (parsed only when needed)."""
        last = self.last_sent
        if last is None:
            return False
        message_type = last["type"]
        if message_type == "http.response.body":
            start = self.first_sent
            trailers = start is not None and start.get("trailers", False)
            return not trailers and not last.get("more_body", False)
        if message_type == "http.response.trailers":
            return not last.get("more_trailers", False)
        return message_type in _COMPLETING

    def finished(self) -> None:
        """The app returned: what a late `receive()` or `send()` meets from now on.

        The server's `receive` and `send` are let go: a finished cycle can outlive its request
        in a context that copied the request's (uvicorn's keep-alive timer is armed inside the
        final `send`), and through them it held the server's per-request objects in a
        reference cycle: 10x the generation-0 collections under keep-alive load. A late call
        never reaches them (the disconnect is set); `complete_cancelled()` is handed `send`."""
        self.state = _FINISHED
        token = self.token_if_made
        if token is not None:
            token.release()
        if self.disconnect is None:
            self.disconnect = REQUEST_OVER  # a late receive() gets it, a send drops
        self.real_receive = self.real_send = RELEASED

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
        read_ahead = self.options.read_ahead
        loop = self.attached()
        extra = 0
        while self.disconnect is None and self.state is not _FINISHED:
            # At least one message is read ahead whatever `read_ahead` says: a request with no
            # body is watched from the start.
            if self.reading or (
                not self.body_complete and self.buffered and self.buffered >= read_ahead
            ):
                await loop.park()
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
                    self._body_completed()
                self.buffered += len(message.get("body", b""))
            if self.buffer is None:
                self.buffer = deque()
            self.buffer.append(message)
            loop.wake()

    def on_disconnect(self, message: Message) -> bool:
        """Cache the disconnect; cancel if the response is not complete. Returns whether the
        app's cancellation was requested at once."""
        self.disconnect = message
        requested = False
        if self.state is _READING_BODY or self.state is _WATCHING:
            if self._response_complete():
                self.state = _RESPONSE_COMPLETE
                if _in_flight(self.sending):
                    self.attached().start_grace()  # then `final_send_hung()`
            else:
                requested = self._cancel(REASON)
        self.wake()
        return requested

    def final_send_hung(self) -> None:
        """`grace` after a disconnect that found the response complete: if the server's send of
        the final message has still not returned, it never will (hypercorn over HTTP/2 once the
        connection closed: the stream's buffer is never drained), and the app task would wait
        in it forever. The response did not reach the client: the request is cancelled."""
        if self.state is _RESPONSE_COMPLETE and _in_flight(self.sending):
            self.state = _CANCELLED
            self._fire(self.attached(), REASON)
            self.token.cancel_app()

    def stop(self, reason: str, status: int) -> bool:
        """Cancel the request for `reason` while its client is still connected (cancelled by
        id, deadline passed): the same token, callbacks and single cancellation of the app as
        a disconnect; once the app has ended, `complete_cancelled()` answers `status` (or ends
        a started stream). Returns False if there was nothing to stop: the response was
        complete, or the request was already cancelled or over."""
        if self.disconnect is not None or self._response_complete():
            return False
        if self.state is not _READING_BODY and self.state is not _WATCHING:
            return False  # pragma: no cover - a disconnect is cached in every other state
        # To the app the request is over, as after a disconnect: its receive() gets
        # http.disconnect (so an app that listens reacts itself) and its sends are dropped; the
        # middleware completes the response once the app has ended.
        self.disconnect = STOPPED
        self.status = status
        self._cancel(reason)
        self.wake()
        return True

    def _cancel(self, reason: str) -> bool:
        # The app is listening itself when it waits in receive() after the whole body
        # (Starlette's StreamingResponse below spec 2.4, vLLM's with_cancellation): give it
        # the message first, and cancel only what still runs after the grace period. Callers
        # already handed a buffered message (woken, not yet resumed) are not listening: they
        # are still reading the body.
        listening = self.state is _WATCHING and self.app_waiting > len(self.buffer or ())
        self.state = _CANCELLED
        loop = self.attached()
        try:
            self._fire(loop, reason)
        finally:
            if listening:
                loop.start_grace()
            else:
                self.token.cancel_app()
        return not listening

    def _fire(self, loop: Loop, reason: str) -> None:
        elapsed = monotonic() - self.started_at
        self.token.fire(reason, loop)
        report_cancelled(
            self.scope,
            self.token,
            reason,
            elapsed,
            self.response_started,
            self.options.on_cancelled,
        )


def _in_flight(sending: object) -> bool:
    """Whether a coroutine the server's send() returned is suspended in an await (started, not
    done). Other awaitables cannot be told: False."""
    return getattr(sending, "cr_await", None) is not None


REQUEST_OVER: Message = {"type": "http.disconnect"}
# What the app's receive() gets after `stop()`: the request is over for it (its client may be
# still there, and gets the middleware's response).
STOPPED: Message = {"type": "http.disconnect"}
_LAST_TRAILERS: Message = {"type": "http.response.trailers", "headers": [], "more_trailers": False}
_MAKING_TOKEN = threading.Lock()


def new_cycle(
    scope: Scope, receive: Receive, send: Send, options: Options, attach: Callable[[Cycle], Loop]
) -> Cycle:
    """A new `Cycle`: its constructor, as a function because a Python `__init__` called from C
    costs ~1k instructions per request, a tenth of the whole budget. (`started_at` is set by
    `attached()`, `status` by `stop()`: only what reads them follows those.)"""
    cycle: Cycle = Cycle()
    cycle.scope = scope
    cycle.real_receive = receive
    cycle.real_send = send
    cycle.options = options
    cycle.attach = attach
    cycle.token_if_made = None
    cycle.state = _READING_BODY
    cycle.disconnect = None
    cycle.first_sent = None
    cycle.last_sent = None
    cycle.loop = None
    cycle.body_complete = False
    cycle.reading = False
    cycle.app_waiting = 0
    cycle.buffer = None
    cycle.buffered = 0
    return cycle


async def _dropped() -> None:
    pass


async def _released(*_: object) -> Message:
    raise RuntimeError("asgi_cancel: the server's receive/send was let go: the request is over")


# What a finished cycle holds instead of the server's `receive` and `send` (never called).
RELEASED: Any = _released


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


def error_response(status: int, message: str) -> tuple[Message, Message]:
    """The two ASGI messages of a small JSON error response: `{"error": message}`."""
    body = json.dumps({"error": message}).encode()
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, {"type": "http.response.body", "body": body}


async def complete_cancelled(cycle: Cycle, send: Send) -> None:
    """The app of a cancelled request has ended: complete what the server still waits for.

    After a disconnect, a 499 if no response started (`send_cancelled_response`). After
    `stop()` with the client still connected: `cycle.status` with a JSON body if no response
    started, else the end of the started response (a final empty body; trailers if announced),
    so that the client sees a clean end rather than a connection reset.
    """
    scope = cycle.scope
    if cycle.disconnect is not STOPPED:  # the client left (possibly after a stop)
        if cycle.first_sent is None:
            await send_cancelled_response(scope, send)
        return
    try:
        if cycle.first_sent is None:
            start, body = error_response(cycle.status, cycle.token.reason or "cancelled")
            await send(start)
            await send(body)
            return
        last = cycle.last_sent
        if not (last is not None and last["type"] == "http.response.trailers"):
            if not (
                last is not None
                and last["type"] == "http.response.body"
                and not last.get("more_body", False)
            ):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            if cycle.first_sent.get("trailers", False):
                await send(dict(_LAST_TRAILERS))
        elif last.get("more_trailers", False):
            await send(dict(_LAST_TRAILERS))
    except Exception:  # ASGI lets a server raise OSError for a send to a closed connection
        logger.debug("asgi_cancel: completing a stopped request failed", exc_info=True)
