"""One websocket connection's ASGI side: the app's `receive` and `send`, the messages read ahead,
and when the session must stop.

The websocket counterpart of `_cycle.Cycle`: from the connection on, its watcher
(`_watcher.watch_session`) is the only caller of the server's `receive()`; it reads the client's
messages ahead of the app, in order, up to `read_ahead` bytes, and hands a `websocket.disconnect`
to `client_left()`. Like the cycle, it parks callers and starts its watcher through its `Lane`,
and stops the session through its `CancelScope`.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any, Generic, TypeVar

from ._backend import Lane, Served
from ._report import report_stopped
from ._responses import WEBSOCKET_CLOSE_CODES
from ._scope import CancelScope, detached
from ._states import DISCONNECTED_STATUS, REASON, Options
from ._token import bind, unbind
from .types import Message, Receive, Scope, Send

__all__ = ["MESSAGE_COST", "Session"]

# What one message read ahead counts against `read_ahead`, besides its payload: a flood of empty
# messages is bounded too.
MESSAGE_COST = 100
# What a close frame's reason may hold, in bytes of UTF-8 (RFC 6455: 125 with the code).
MAX_CLOSE_REASON = 123

# What a server's send raises once the client has gone: an OSError (ASGI 2.4; uvicorn's
# ClientDisconnected), or, on daphne, autobahn's `Disconnected` (a RuntimeError).
_DAPHNE_GONE = ("autobahn.exception", "Disconnected")

logger = logging.getLogger("asgi_cancel")
_MAKING = threading.Lock()
L = TypeVar("L", bound=Lane)


class Phase(enum.IntEnum):
    """Where a session is; what a disconnect means in each phase is in the comments."""

    HANDSHAKE = 0  # not accepted yet: a disconnect stops the session
    OPEN = 1  # accepted: a disconnect stops it (or a listener reacts)
    CLOSED = 2  # the app sent websocket.close: a disconnect is the normal end
    STOPPED = 3  # the client left first, or the session was stopped: sends are dropped
    FINISHED = 4  # the app returned


HANDSHAKE, OPEN, CLOSED, STOPPED, FINISHED = Phase


class Session(Generic[L]):
    """The middleware's view of one websocket connection."""

    __slots__ = (
        "_scope",
        "app",
        "app_task",
        "app_waiting",
        "bound",
        "buffer",
        "buffered",
        "closing",
        "disconnect",
        "lane",
        "make_lane",
        "options",
        "phase",
        "reading",
        "real_receive",
        "real_send",
        "scope",
        "send_failed",
        "started_at",
        "stopped_with",
    )

    app: Any  # what the app's call returned (its coroutine): set before the app runs

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        options: Options,
        make_lane: Callable[[Served], L],
    ) -> None:
        self.scope = scope
        self.real_receive = receive
        self.real_send = send
        self.options = options
        self.make_lane = make_lane
        self.lane: L | None = None
        self._scope: CancelScope | None = None
        self.app_task: Any = None
        self.phase = HANDSHAKE
        self.disconnect: Message | None = None  # the client's, or ours once stopped
        self.stopped_with: int | None = None  # set once the session stopped
        self.closing: Message | None = None  # what `complete()` sends the server, if anything
        self.send_failed = False  # stopped by a failed send: the app is cancelled at the disconnect
        self.buffer: deque[Message] = deque()  # read ahead, not yet taken by the app
        self.buffered = 0  # what `buffer` counts against `read_ahead`
        self.reading = False  # the watcher waits in the server's receive()
        self.app_waiting = 0  # callers in the app's receive()
        self.started_at = monotonic()
        self.bound = bind(self)  # the current request until finished()

    # -- what the request has in common with an HTTP cycle --------------------------------------
    @property
    def cancel_scope(self) -> CancelScope:
        """The session's `CancelScope` (its token is `current_token()` outside a turn)."""
        scope = self._scope
        if scope is None:
            with _MAKING:
                scope = self._scope
                if scope is None:
                    scope = self._scope = CancelScope(self.ensure_lane())
        return scope

    def ensure_lane(self) -> L:
        lane = self.lane
        if lane is None:
            lane = self.lane = self.make_lane(self)
        return lane

    def in_app_task(self) -> bool:
        return self.ensure_lane().in_app_task()

    def new_lane(self, served: Any) -> L:
        """A lane of the request's event loop for `served` (a `turn()` inside it)."""
        return self.make_lane(served)

    def absorbs(self) -> bool:
        """A cancellation ended the app: whether it was the session's own."""
        scope = self._scope
        return scope is not None and scope.absorbs()

    def watchable(self) -> bool:
        return self.disconnect is None and self.phase is not FINISHED

    # -- what the app sees -------------------------------------------------------------------------
    async def receive(self) -> Message:
        self.app_waiting += 1
        try:
            lane = self.ensure_lane()
            while True:
                if self.buffer:
                    message = self.buffer.popleft()
                    self.buffered -= _cost(message)
                    lane.wake()  # a watcher waiting on the read-ahead limit may go on
                    return message
                if self.disconnect is not None:
                    return dict(self.disconnect)  # a fresh one: the app may change it
                if not lane.watch_now():
                    # The watcher gave up (the server's receive() raised): the app reads itself.
                    return await self.real_receive()
                await lane.park()
        finally:
            self.app_waiting -= 1

    async def send(self, message: Message) -> None:
        phase = self.phase
        if phase is STOPPED or phase is FINISHED:
            # The client is gone, or gets our close: dropped, as the HTTP cycle drops sends.
            return
        message_type = message["type"]
        if message_type == "websocket.accept":
            self.phase = OPEN
        elif message_type == "websocket.close" or message_type == "websocket.http.response.start":
            self.phase = CLOSED  # the app ended the session (or refused it)
        try:
            await self.real_send(message)
        except Exception as exc:
            # The server may tell of a client gone by failing a send before its receive()
            # hands the watcher the disconnect: the token fires all the same (an engine it
            # aborts would otherwise generate for nobody); the app gets the error, as it came.
            if self.disconnect is None and self.phase is not CLOSED and _client_gone(exc):
                self.phase = phase  # (an accept that failed accepted nothing)
                self.send_failed = True
                self._stop(REASON, None, cancel=False)
            raise

    # -- what the watcher hands over ---------------------------------------------------------------
    def read_ahead_full(self) -> bool:
        return bool(self.buffer) and self.buffered >= self.options.read_ahead

    def received(self, message: Message) -> None:
        """A message from the client (not the disconnect), for the app's receive()."""
        self.buffer.append(message)
        self.buffered += _cost(message)
        self.ensure_lane().wake()

    def client_left(self, message: Message) -> None:
        """The client left (`websocket.disconnect`, with its code): stop the session unless
        the app had closed it."""
        self.disconnect = message
        if self.phase is HANDSHAKE:
            # Cancelled before it answered the handshake: the server still waits for an answer
            # (uvicorn's `--ws websockets` logs an ERROR without one).
            self.closing = {"type": "websocket.close", "code": 1000, "reason": ""}
        if self.phase is HANDSHAKE or self.phase is OPEN:
            self._stop(REASON, message.get("code"))
        elif self.send_failed:
            # The app was told by the error, and may have gone on (a ticker that skips a failed
            # send): if it still runs `grace` from now, it is cancelled.
            self.send_failed = False
            self.cancel_scope.cancel_app(listening=True)
        self.ensure_lane().wake()

    def stop(self, reason: str, status: int) -> bool:
        """Stop the session for `reason` while its client is still connected (cancelled by
        id, deadline passed): the app is cancelled as for a disconnect, and the client gets a
        close frame once the app has ended, its code the HTTP `status` in the private range
        (`4000 + status`: 4499 cancelled, 4504 deadline exceeded), its reason `reason`.
        False if there was nothing to stop (or the session was `detach()`ed)."""
        if self.disconnect is not None or self.phase not in (HANDSHAKE, OPEN):
            return False
        if detached(self._scope):  # it runs to its end
            return False
        code = WEBSOCKET_CLOSE_CODES + status
        said = _close_reason(reason)
        self.disconnect = {"type": "websocket.disconnect", "code": code, "reason": said}
        self.closing = {"type": "websocket.close", "code": code, "reason": said}
        self._stop(reason, code, stopped=True)
        self.ensure_lane().wake()
        return True

    def _stop(
        self, reason: str, code: int | None, *, stopped: bool = False, cancel: bool = True
    ) -> None:
        # The app is listening itself when it waits in receive() with nothing read ahead:
        # it gets the disconnect first, and `grace` to end by itself.
        listening = self.app_waiting > len(self.buffer)
        accepted = self.phase is OPEN
        self.phase = STOPPED
        self.stopped_with = code if code is not None else DISCONNECTED_STATUS
        scope = self.cancel_scope
        scope.fire(reason)
        report_stopped(self, scope, reason, accepted, None if stopped else code, close_code=code)
        if cancel:
            scope.cancel_app(listening=listening)

    def finished(self) -> None:
        """The app returned (or raised): the session's one end."""
        if self.disconnect is None:
            self.disconnect = {"type": "websocket.disconnect", "code": 1000, "reason": ""}
        self.phase = FINISHED
        self.lane = None  # (session <-> lane: freed by reference counting)
        unbind(self.bound)
        scope = self._scope
        if scope is not None:
            scope.close()

    async def complete(self, send: Send) -> None:
        """The app of a stopped session has ended: a client still connected gets the close
        frame (code: the stop's status); a handshake the app did not answer gets the close that
        refuses it (the server's 403, or nothing once the client has gone). A server may refuse
        a send to a closed connection: logged at DEBUG, never raised."""
        if self.closing is not None:
            try:
                await send(self.closing)
            except Exception:
                logger.debug("closing a cancelled websocket session failed", exc_info=True)


def _cost(message: Message) -> int:
    """What a message counts against `read_ahead`: its payload's bytes (a text's UTF-8)."""
    data = message.get("bytes")
    if data:
        return MESSAGE_COST + len(data)
    text = message.get("text") or ""
    return MESSAGE_COST + (len(text) if text.isascii() else len(text.encode("utf-8", "replace")))


def _close_reason(reason: str) -> str:
    """`reason` as a close frame can carry it: at most 123 bytes of UTF-8 (RFC 6455), cut at a
    character's boundary."""
    encoded = reason.encode("utf-8", "replace")
    if len(encoded) <= MAX_CLOSE_REASON:
        return reason
    return encoded[:MAX_CLOSE_REASON].decode("utf-8", "ignore")


def _client_gone(exc: Exception) -> bool:
    """Whether a server's send raised `exc` because the client has gone."""
    if isinstance(exc, OSError):
        return True
    module, name = _DAPHNE_GONE
    return type(exc).__module__ == module and type(exc).__name__ == name
