"""One request's state machine: owning the server's `receive`, replaying, deciding to cancel.

No event-loop code here: parking, cancelling the app and timers are the `Runner` a driver
(`_asyncio.py`, `_trio.py`) gives the cycle, only once the request needs one.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import Any, Protocol

from ._report import report_cancelled
from ._servers import paused_reading
from ._token import Canceller, CancelToken, TokenSource, bind, unbind
from .types import Message, OnCancelled, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")

REASON = "client disconnected"
# What the log line and the `on_cancelled` hook report for a client that left: nginx's
# "client closed request" (nobody receives it; an outer middleware may).
DISCONNECTED_STATUS = 499
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


class Runner(Canceller, Protocol):
    """What one request needs from its event loop: a driver gives the cycle one on first need."""

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

    def watch_now(self) -> bool:
        """Start the watcher if it has not started yet. Returns whether it is still watching."""

    def close(self) -> bool:
        """The app has returned: stop timers and scopes, leave the registry. Returns whether
        tasks are left to wait for."""


class Cycle:
    """The middleware's view of one HTTP request/response cycle.

    Made by `new_cycle()`. Slim on purpose: a request that never waits touches only what
    that sets. `send()` parses nothing; the last message sent is read only when a disconnect
    needs to know whether the response was complete.
    """

    __slots__ = (
        "_token",
        "app_awaitable",
        "app_task",
        "app_waiting",
        "body_complete",
        "body_started",
        "bound",
        "buffer",
        "buffered",
        "cancelled",
        "disconnect",
        "first_sent",
        "holding",
        "last_sent",
        "make_runner",
        "options",
        "reading",
        "real_receive",
        "real_send",
        "runner",
        "scope",
        "sending",
        "started_at",
        "state",
        "status",
    )

    scope: Scope
    bound: contextvars.Token[TokenSource]  # the cycle is the current request until finished()
    real_receive: Receive
    real_send: Send
    options: Options
    make_runner: Callable[[Cycle], Runner]
    runner: Runner | None  # made on first need: a request that never needs one has none
    # The driver's hold on the running app, once its first step yielded (asyncio: the task
    # and the app's coroutine), for the runner it makes later.
    app_task: Any
    app_awaitable: Any
    _token: CancelToken | None  # made on first use: most requests never ask for it
    cancelled: bool  # the token fired (set with it; read without making a token)
    state: State
    disconnect: Message | None
    first_sent: Message | None
    last_sent: Message | None
    body_started: bool  # an http.request message came from the server
    body_complete: bool
    reading: bool  # someone waits in the server's receive()
    holding: bool  # the watcher waits before its first receive() (`Expect: 100-continue`)
    app_waiting: int  # callers in the app's receive()
    buffer: deque[Message] | None  # read ahead by the watcher, not yet taken by the app
    buffered: int  # body bytes in `buffer`
    # Not set by new_cycle(): what the server's send() returned for the last message (set with
    # `last_sent`, read only once that says the response is complete), when the request first
    # waited (or got its runner before that), and the status stop() answers with.
    sending: Awaitable[None]
    started_at: float
    status: int

    @property
    def token(self) -> CancelToken:
        """The request's token, made on first use (by the app's `current_token()`, possibly
        in a worker thread, or by a cancellation)."""
        token = self._token
        if token is None:
            with _MAKING_TOKEN:
                token = self._token
                if token is None:
                    token = self._token = CancelToken()
        return token

    def ensure_runner(self) -> Runner:
        """The request's `Runner`, made on first need (its watcher starts, a disconnect, an
        id, a second caller of `receive()`)."""
        runner = self.runner
        if runner is None:
            runner = self.runner = self.make_runner(self)
            if self.app_task is None:  # before the app first waited: it waits from now on
                self.started_at = monotonic()
        return runner

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
                        await self.ensure_runner().cancel_body_reader()
                    return self.disconnect
                if not self.reading:
                    if not self.body_complete or not self.ensure_runner().watch_now():
                        # Nobody holds the server's receive: read it ourselves, no task needed.
                        return await self._read_for_app()
                    # After the body the app listens (vLLM's `with_cancellation`, Starlette's
                    # stream below spec 2.4): it waits behind the watcher, where a stop (by
                    # id, a deadline) reaches it as well as a disconnect does. Unless the
                    # watcher has ended (uvicorn paused reading): then the app reads itself.
                await self.ensure_runner().park()
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
            self.body_started = True
            if not message.get("more_body", False):
                self._body_completed()
        elif message_type == "http.disconnect":
            if self.on_disconnect(message):
                await self.ensure_runner().checkpoint()  # the cancellation lands here
        return message

    def send(self, message: Message) -> Awaitable[None]:
        # A plain function handing back the server's own awaitable: no coroutine frame, no
        # parsing. The message is recorded BEFORE the server's send is awaited: hypercorn-trio
        # delivers the disconnect before that send returns, and must find the response complete.
        if self.disconnect is not None:
            # The client is gone. Dropping is what every server does, except hypercorn over
            # HTTP/2 after the TCP connection closed, where send() would hang forever.
            return _dropped()
        self.last_sent = message
        if self.first_sent is None:
            self.first_sent = message
            sending = self.sending = self.real_send(message)
            if self.holding:  # the watcher waits for the server to have taken the response start
                return self._wake_after(sending)
            return sending
        sending = self.sending = self.real_send(message)
        return sending

    async def _wake_after(self, sending: Awaitable[None]) -> None:
        try:
            await sending
        finally:
            self.holding = False
            self.wake()

    def wake(self) -> None:
        if self.runner is not None:
            self.runner.wake()

    # -- state ---------------------------------------------------------------------------------
    @property
    def response_started(self) -> bool:
        return self.first_sent is not None

    def _body_completed(self) -> None:
        self.body_complete = True
        if self.state is _READING_BODY:
            self.state = _WATCHING

    def response_complete(self) -> bool:
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

    def finished(self) -> Runner | None:
        """The app returned (or raised): the request's one end. Returns its runner if tasks
        are left that the driver must wait for (the watcher, `on_cancel` callbacks' tasks).

        What a late `receive()` or `send()` meets from now on is set, the token is released,
        the cycle stops being the current request, and the runner's timers are cancelled. The
        server's `receive` and `send` are let go: a finished cycle can outlive its request in a
        context that copied the request's (uvicorn's keep-alive timer is armed inside the final
        `send`), and through them it held the server's per-request objects in a reference
        cycle, to be found by the garbage collector. A late call never reaches them (the
        disconnect is set); the driver keeps them for completing a cancelled response.
        """
        self.state = _FINISHED
        token = self._token
        if token is not None:
            token.release()
        if self.disconnect is None:
            self.disconnect = REQUEST_OVER  # a late receive() gets it, a send drops
        self.real_receive = self.real_send = RELEASED
        unbind(self.bound)
        runner = self.runner
        if runner is None:
            return None
        self.runner = None  # (cycle <-> runner: freed by reference counting)
        return runner if runner.close() else None

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
        runner = self.ensure_runner()
        extra = 0
        if self.first_sent is None and not self.body_started and _expects_continue(self.scope):
            # The server's receive() answers `Expect: 100-continue` (uvicorn, granian, gunicorn):
            # a call of ours would make the client upload a body the app may refuse. Wait for
            # the app to ask for it, or for its response to start (the server then sends none).
            self.holding = True
            while (
                self.holding
                and not (self.body_started or self.reading)
                and self.disconnect is None
                and self.state is not _FINISHED
            ):
                await runner.park()
            self.holding = False
        while self.disconnect is None and self.state is not _FINISHED:
            # At least one message is read ahead whatever `read_ahead` says: a request with no
            # body is watched from the start.
            if self.reading or (
                not self.body_complete and self.buffered and self.buffered >= read_ahead
            ):
                await runner.park()
                continue
            if paused_reading(receive):
                # uvicorn paused reading for a pipelined request: a receive() would resume it.
                # Its own calls are the app's, as without the middleware.
                logger.debug("the server paused reading; not watching")
                return
            self.reading = True
            try:
                message = await receive()
            except Exception:
                # The app will meet the same error on its own receive; watching is over.
                logger.debug("server receive() raised; not watching", exc_info=True)
                return
            finally:
                self.reading = False
            message_type = message["type"]
            if message_type == "http.disconnect":
                self.on_disconnect(message)
                return
            if message_type == "http.request":
                self.body_started = True
                if self.body_complete:
                    if not message.get("body"):
                        # Some servers send an empty extra http.request after the body.
                        extra += 1
                        if extra > _MAX_EXTRA_REQUESTS:
                            logger.debug("server keeps sending http.request")
                            return
                        continue
                elif not message.get("more_body", False):
                    self._body_completed()
                self.buffered += len(message.get("body", b""))
            if self.buffer is None:
                self.buffer = deque()
            self.buffer.append(message)
            runner.wake()

    def on_disconnect(self, message: Message) -> bool:
        """Cache the disconnect; cancel if the response is not complete. Returns whether the
        app's cancellation was requested at once."""
        self.disconnect = message
        requested = False
        if (
            self.state is _READING_BODY
            and not self.body_started
            and not _announces_body(self.scope)
        ):
            # The server said the client left before it gave the (empty) body: for a request
            # that has none, the app's receive() is a listener's, as after the body (uvicorn
            # answers a first receive() so when the client left before it).
            self._body_completed()
        if self.state is _READING_BODY or self.state is _WATCHING:
            if self.response_complete():
                self.state = _RESPONSE_COMPLETE
                if _in_flight(self.sending):
                    self.ensure_runner().start_grace()  # then `final_send_hung()`
            else:
                requested = self._cancel(REASON, DISCONNECTED_STATUS)
        self.wake()
        return requested

    def final_send_hung(self) -> None:
        """`grace` after a disconnect that found the response complete: if the server's send of
        the final message has still not returned, it never will (hypercorn over HTTP/2 once the
        connection closed: the stream's buffer is never drained), and the app task would wait
        in it forever. The response did not reach the client: the request is cancelled."""
        if self.state is _RESPONSE_COMPLETE and _in_flight(self.sending):
            self.state = _CANCELLED
            self._fire(self.ensure_runner(), REASON, DISCONNECTED_STATUS)
            self.token.cancel_app()

    def stop(self, reason: str, status: int) -> bool:
        """Cancel the request for `reason` while its client is still connected (cancelled by
        id, deadline passed): the same token, callbacks and single cancellation of the app as
        a disconnect; once the app has ended, the driver completes the response (`status` if
        none started). Returns False if there was nothing to stop: the response was complete,
        or the request was already cancelled or over."""
        if self.disconnect is not None or self.response_complete():
            return False
        if self.state is not _READING_BODY and self.state is not _WATCHING:
            return False  # pragma: no cover - a disconnect is cached in every other state
        # To the app the request is over, as after a disconnect: its receive() gets
        # http.disconnect (so an app that listens reacts itself) and its sends are dropped; the
        # middleware completes the response once the app has ended.
        self.disconnect = STOPPED
        self.status = status
        self._cancel(reason, status)
        self.wake()
        return True

    def _cancel(self, reason: str, status: int) -> bool:
        # The app is listening itself when it waits in receive() after the whole body
        # (Starlette's StreamingResponse below spec 2.4, vLLM's with_cancellation): give it
        # the message first, and cancel only what still runs after the grace period. Callers
        # already handed a buffered message (woken, not yet resumed) are not listening: they
        # are still reading the body.
        listening = self.state is _WATCHING and self.app_waiting > len(self.buffer or ())
        self.state = _CANCELLED
        runner = self.ensure_runner()
        try:
            self._fire(runner, reason, status)
        finally:
            if listening:
                runner.start_grace()
            else:
                self.token.cancel_app()
        return not listening

    def _fire(self, runner: Runner, reason: str, status: int | None) -> None:
        elapsed = monotonic() - self.started_at
        self.cancelled = True
        if self.disconnect is STOPPED and self.first_sent is not None:
            status = None  # stopped mid-stream: the client gets a cut stream, not a status
        token = self.token
        token.fire(reason, runner)
        report_cancelled(
            self.scope,
            token,
            reason=reason,
            elapsed=elapsed,
            response_started=self.response_started,
            status=status,
            on_cancelled=self.options.on_cancelled,
        )


def _in_flight(sending: object) -> bool:
    """Whether a coroutine the server's send() returned is suspended in an await (started, not
    done). Other awaitables cannot be told: False."""
    return getattr(sending, "cr_await", None) is not None


def new_cycle(
    scope: Scope,
    receive: Receive,
    send: Send,
    options: Options,
    make_runner: Callable[[Cycle], Runner],
) -> Cycle:
    """A new `Cycle`, made the current request (`current_token()` finds it) in the caller's
    context, the request's: its constructor, as a plain function (no `__init__`: a Python
    `__init__` called by the type is a noticeable share of what a request that never waits
    costs; `benchmarks.instructions` measures it). `started_at` is set when the request first
    waits (by the driver, or `ensure_runner()`), `status` by `stop()`."""
    cycle = Cycle()
    cycle.scope = scope
    cycle.real_receive = receive
    cycle.real_send = send
    cycle.options = options
    cycle.make_runner = make_runner
    cycle.runner = None
    cycle.app_task = None
    cycle.app_awaitable = None
    cycle._token = None
    cycle.cancelled = False
    cycle.state = _READING_BODY
    cycle.disconnect = None
    cycle.first_sent = None
    cycle.last_sent = None
    cycle.body_started = False
    cycle.body_complete = False
    cycle.reading = False
    cycle.holding = False
    cycle.app_waiting = 0
    cycle.buffer = None
    cycle.buffered = 0
    cycle.bound = bind(cycle)
    return cycle


def _expects_continue(scope: Scope) -> bool:
    """Whether the client waits for `100 Continue` before it sends its body (read only when a
    watcher starts)."""
    for name, value in scope.get("headers", ()):
        if name == b"expect":
            return bytes(value).strip().lower() == b"100-continue"
    return False


def _announces_body(scope: Scope) -> bool:
    """Whether the request has a body, as its headers (or, without them, its method) say; read
    only after a disconnect. A POST without a Content-Length may carry one (HTTP/2)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return scope.get("method") not in _BODYLESS_METHODS


_BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS", "DELETE", "TRACE")
REQUEST_OVER: Message = {"type": "http.disconnect"}
# What the app's receive() gets after `stop()`: the request is over for it (its client may be
# still there, and gets the middleware's response).
STOPPED: Message = {"type": "http.disconnect"}
_MAKING_TOKEN = threading.Lock()


async def _dropped() -> None:
    pass


async def _released(*_: object) -> Message:
    raise RuntimeError("asgi_cancel: the server's receive/send was let go: the request is over")


# What a finished cycle holds instead of the server's `receive` and `send` (never called).
RELEASED: Any = _released
