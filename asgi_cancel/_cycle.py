"""One request's ASGI side: the app's `receive` and `send`, the body read ahead, what each
message from the server means, and when the request must stop.

No event-loop code here: the cycle parks callers and starts its watcher through its `Lane`,
and stops the request through its `CancelScope`, both made by its backend on first need.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from time import monotonic
from typing import Any, Generic, TypeVar

from ._backend import Lane, Served
from ._messages import DISCONNECT, announces_body, response_complete
from ._report import report_stopped
from ._scope import CancelScope, detached
from ._servers import in_send
from ._states import (
    DISCONNECTED_STATUS,
    FINISHED,
    READING_BODY,
    REASON,
    RESPONSE_COMPLETE,
    STOPPED,
    WATCHING,
    Options,
    dropped,
    released,
    stopped_send,
)
from ._token import bind, unbind
from .types import Message, Receive, Scope, Send

logger = logging.getLogger("asgi_cancel")
_MAKING = threading.Lock()

L = TypeVar("L", bound=Lane)


class Cycle(Generic[L]):
    """The middleware's view of one HTTP request/response cycle.

    Slim on purpose: a request that never waits touches only what `__init__` sets, and
    `send()` parses nothing (the last message sent is read only when a disconnect needs to
    know whether the response was complete).
    """

    __slots__ = (
        "_scope",
        "app",
        "app_task",
        "app_waiting",
        "body_complete",
        "body_started",
        "bound",
        "buffer",
        "buffered",
        "delivered",
        "disconnect",
        "first_sent",
        "holding",
        "lane",
        "last_sent",
        "make_lane",
        "options",
        "reading",
        "real_receive",
        "real_send",
        "scope",
        "server_send",
        "started_at",
        "state",
        "stopped",
        "stopped_with",
        "target",
    )

    # Set where they are first needed, not here (a request that never waits pays for what
    # `__init__` sets, nothing more): `started_at` once the app first waited or its lane was
    # made, `last_sent` by `send()`, the watcher's by `watch()`, `stopped` and `delivered` by
    # `_stop()`. tests/test_cycle.py checks each is set before it is read.
    app: Any  # what the app's call returned (its coroutine): set before the app runs
    started_at: float
    last_sent: Message
    delivered: Message | None
    holding: bool
    buffered: int
    stopped: bool

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
        # The response start goes through `real_send` (`_tracking` may wrap it), the rest
        # straight to the server's.
        self.real_send = self.server_send = send
        self.target: Callable[[Message], Awaitable[None]] = self.send_start
        self.options = options
        self.make_lane = make_lane  # the backend's lane: a request that never needs one has none
        self.state = READING_BODY
        self.lane: L | None = None
        self._scope: CancelScope | None = None
        self.app_task: Any = None  # the backend's hold on the app task, once it first waited
        self.disconnect: Message | None = None  # what the app's receive() gets from now on
        self.stopped_with: int | None = None  # the status a stopped request is answered
        self.first_sent: Message | None = None
        self.buffer: deque[Message] | None = None  # read ahead, not yet taken by the app
        self.body_started = self.body_complete = False  # http.request messages came
        self.reading = False  # someone waits in the server's receive()
        self.app_waiting = 0  # callers in the app's receive()
        self.bound = bind(self)  # the current request until finished()

    @property
    def cancel_scope(self) -> CancelScope:
        """The request's `CancelScope`, made on first need (by the app's `current_token()`,
        possibly in a worker thread, or when the request must stop)."""
        scope = self._scope
        if scope is None:
            with _MAKING:
                scope = self._scope
                if scope is None:
                    scope = self._scope = CancelScope(self.ensure_lane())
        return scope

    def absorbs(self) -> bool:
        """A cancellation ended the app: whether it was the request's own."""
        scope = self._scope
        return scope is not None and scope.absorbs()

    def __await__(self) -> Generator[Any, None, Any]:
        """The rest of the app, once its first step was taken by hand: its coroutine's own
        iterator, so that no frame of ours runs when the task resumes the app."""
        steps: Generator[Any, None, Any] = self.app.__await__()
        return steps

    def in_app_task(self) -> bool:
        return self.ensure_lane().in_app_task()

    def new_lane(self, served: Any) -> L:
        """A lane of the request's event loop for `served` (a `turn()` inside it)."""
        return self.make_lane(served)

    def ensure_lane(self) -> L:
        """The request's `Lane`, made on first need (its watcher starts, it must stop, a
        second caller waits in `receive()`, its scope is made)."""
        lane = self.lane
        if lane is None:
            lane = self.lane = self.make_lane(self)
            if self.app_task is None:  # before the app first waited: it waits from now on
                self.started_at = monotonic()
        return lane

    # -- what the app sees -----------------------------------------------------------------------
    async def receive(self) -> Message:
        self.app_waiting += 1
        try:
            while True:
                if self.buffer:
                    message = self.buffer.popleft()
                    if self.buffered:
                        self.buffered -= len(message.get("body", b""))
                        self.wake()  # a watcher waiting on the read-ahead limit may go on
                    return message
                if self.disconnect is not None:
                    if not self.body_complete and self.stopped_with is not None:
                        # Mid-body, after a cancellation that had to wait (the app was in a
                        # worker thread): it lands here rather than as http.disconnect, which
                        # a framework would turn into an error (Starlette's ClientDisconnect).
                        await self._cancel_body_reader()
                    return dict(self.disconnect)  # a fresh one: the app may change it
                if not self.reading:
                    if (
                        not self.body_complete
                        or self.response_complete()  # (what it reads cancels nothing now)
                        or not self.ensure_lane().watch_now()
                    ):
                        # Nobody holds the server's receive: read it ourselves, no task needed.
                        return await self._read_for_app()
                    # After the body the app listens (vLLM's `with_cancellation`, Starlette's
                    # stream below spec 2.4): it waits behind the watcher, where a stop (by
                    # id, a deadline) reaches it as well as a disconnect does. Unless the
                    # watcher has ended (uvicorn paused reading): then the app reads itself.
                await self.ensure_lane().park()
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
                self.body_completed()
        elif message_type == "http.disconnect":
            self.client_left(message)
            if self.stopped_with is not None:
                await self.ensure_lane().checkpoint()  # its cancellation lands here
        return message

    async def _cancel_body_reader(self) -> None:
        # The app task reads its body after the client left: its cancellation lands here,
        # unless it must wait (a shield): then it meets http.disconnect, as ASGI says.
        lane = self.ensure_lane()
        if lane.in_app_task():
            scope = self.cancel_scope
            scope.deliver()
            if scope.issued:
                await lane.checkpoint()

    def send(self, message: Message) -> Awaitable[None]:
        # A plain function handing back the server's own awaitable: no coroutine frame, no
        # parsing. The message is recorded BEFORE the server's send is awaited: hypercorn-trio
        # delivers the disconnect before that send returns, and must find the response complete.
        self.last_sent = message
        return self.target(message)

    def send_start(self, message: Message) -> Awaitable[None]:
        # The first message (the response start), which may carry the request's id.
        self.first_sent = message
        self.target = self.server_send
        return self.real_send(message)

    def wake(self) -> None:
        if self.lane is not None:
            self.lane.wake()

    # -- the watcher's (`_watcher.watch`) --------------------------------------------------------
    def watchable(self) -> bool:
        """Whether there is anything left to watch for (the watcher starts only if so)."""
        return self.disconnect is None and self.state is not FINISHED

    # -- stopping --------------------------------------------------------------------------------
    def body_completed(self) -> None:
        self.body_complete = True
        if self.state is READING_BODY:
            self.state = WATCHING

    def client_left(self, message: Message) -> None:
        """The client left: cache the message; stop the request if its response is not
        complete."""
        self.disconnect = message
        if self.state is READING_BODY and not self.body_started and not announces_body(self.scope):
            # The server said the client left before it gave the (empty) body: for a request
            # that has none, the app's receive() is a listener's, as after the body (uvicorn
            # answers a first receive() so when the client left before it).
            self.body_completed()
        if self.state is READING_BODY or self.state is WATCHING:
            if not self.response_complete():
                self._stop(REASON, DISCONNECTED_STATUS)
            else:
                self.state = RESPONSE_COMPLETE
                if in_send(self.app, self.server_send):
                    # Then, `grace` later, `final_send_hung()`.
                    self.ensure_lane().after_grace(self.final_send_hung)
        self.wake()

    def final_send_hung(self) -> None:
        """`grace` after a disconnect that found the response complete: if the server's send of
        the final message has still not returned, it never will (hypercorn over HTTP/2 once the
        connection closed: the stream's buffer is never drained), and the app task would wait
        in it forever. The response did not reach the client: the request is stopped."""
        if self.state is RESPONSE_COMPLETE and in_send(self.app, self.server_send):
            self._stop(REASON, DISCONNECTED_STATUS)

    def stop(self, reason: str, status: int) -> bool:
        """Stop the request for `reason` while its client is still connected (cancelled by
        id, deadline passed): the same token, callbacks and single cancellation of the app as
        a disconnect; once the app has ended, the backend completes the response (`status`
        if none started). Returns False if there was nothing to stop: the response was
        complete, the request was already stopped or over, or it was `detach()`ed (it runs
        to its end, and the client gets its response)."""
        if self.disconnect is not None or self.response_complete() or detached(self._scope):
            return False
        if self.state is not READING_BODY and self.state is not WATCHING:
            return False  # pragma: no cover - a disconnect is cached in every other state
        # To the app the request is over, as after a disconnect: its receive() gets
        # http.disconnect (so an app that listens reacts itself) and its sends are dropped; the
        # middleware completes the response once the app has ended.
        self.disconnect = DISCONNECT
        self._stop(reason, status, stopped=True)
        self.wake()
        return True

    def _stop(self, reason: str, status: int, *, stopped: bool = False) -> None:
        # The app is listening itself when it waits in receive() after the whole body
        # (Starlette's StreamingResponse below spec 2.4, vLLM's with_cancellation): give it
        # the message first, and cancel only what still runs after the grace period. Callers
        # already handed a buffered message (woken, not yet resumed) are not listening: they
        # are still reading the body.
        listening = self.state is WATCHING and self.app_waiting > len(self.buffer or ())
        self.state = STOPPED
        self.stopped = stopped  # by `stop()`: the client may be there still
        self.stopped_with = status
        # The client is gone (or gets our answer): sends are dropped.
        self.target = partial(stopped_send, self)
        started = self.first_sent is not None
        # What the server got last: `send()` records the app's dropped messages too.
        self.delivered = self.last_sent if started else None
        scope = self.cancel_scope
        scope.fire(reason)
        # What the client gets: a stopped stream is cut; otherwise the status.
        report_stopped(self, scope, reason, started, None if stopped and started else status)
        scope.cancel_app(listening=listening)

    # -- the end -------------------------------------------------------------------------------
    def response_complete(self) -> bool:
        """Whether the last message sent ended the response (parsed only when needed)."""
        start = self.first_sent
        return start is not None and response_complete(start, self.last_sent)

    def finished(self) -> None:
        """The app returned (or raised): the request's one end.

        What a late `receive()` or `send()` meets from now on is set, the scope is closed, the
        cycle stops being the current request. The server's `receive` and `send` are let go: a
        finished cycle can outlive its request in a context that copied the request's
        (uvicorn's keep-alive timer is armed inside the final `send`), and through them it held
        the server's per-request objects in a reference cycle, to be found by the garbage
        collector. The backend keeps them for completing a stopped response.
        """
        self.state = FINISHED
        if self.disconnect is None:
            self.disconnect = DISCONNECT  # what a late receive() gets (a copy of)
        self.target = dropped
        self.real_receive = self.real_send = self.server_send = released
        self.lane = None  # (cycle <-> lane: freed by reference counting)
        unbind(self.bound)
        scope = self._scope
        if scope is not None:
            scope.close()
