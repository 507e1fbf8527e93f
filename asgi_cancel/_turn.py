"""`turn()`: a unit of work inside a long request (a response inside a websocket session), with
a token of its own that can be cancelled alone, and that the request's cancellation fires too."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from ._backend import Canceller, Lane, Timer, running_library
from ._scope import CancelScope
from ._token import CancelToken, Request, bind, current_request, token_of, unbind

__all__ = ["TURN_CANCELLED", "turn"]

TURN_CANCELLED = "turn cancelled"


class turn:  # lower case: used like shield() and detach()
    """A unit of work inside the current request, with a cancellation of its own.

    A websocket session (a chat, the OpenAI Realtime protocol) serves many responses on one
    connection; a client may stop one of them (Realtime's `response.cancel`) and keep the
    socket. Inside `with turn():`, `current_token()` is the turn's token, which every binding
    follows (`asgi_cancel.vllm.abort_on_cancel` aborts the engine request of the turn, not
    the session's). `cancel()` fires it and cancels the task that entered the turn, once, with
    the rules of a request's cancellation (`shield()`, worker threads); the block's end
    absorbs that cancellation, so the code after it runs (to tell the client, say).

    When the request is cancelled (the client left, a cancel by id, its deadline), the tokens
    of its running turns fire too; a turn running in a task of its own has that task
    cancelled as by `cancel()`, one in the request's own task meets the request's cancellation.

    `shield()` and `detach()` inside a turn hold off the request's cancellation too (it would
    otherwise cut the block, in the same task): until the block's end for `shield()`, until
    the turn's end for `detach()`.

    Enter it in the request's event loop (the request's task, or a task it started), and hand
    its token to a worker thread: a thread has no task to cancel.

    Args:
        reason: what the token's `reason` says after a `cancel()` that gives none.

    Raises:
        RuntimeError: entered outside a request handled by `CancelOnDisconnectMiddleware`, in a
            worker thread, or twice.
    """

    def __init__(self, reason: str = TURN_CANCELLED) -> None:
        self.reason = reason
        self._running: _Turn | None = None

    def __enter__(self) -> CancelToken:
        if self._running is not None:
            raise RuntimeError("a turn() is entered once")
        parent = current_request()
        if parent is None:
            raise RuntimeError(
                "turn() was entered outside a request handled by CancelOnDisconnectMiddleware"
            )
        if running_library() is None:
            raise RuntimeError(
                "turn() was entered in a worker thread: enter it in the event loop and hand "
                "its token to the thread (`with turn() as token: await to_thread(work, token)`)"
            )
        running = self._running = _Turn(parent)
        return token_of(running.cancel_scope)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        running = self._running
        assert running is not None, "a turn() is left after it was entered"
        return running.leave(exc_type, exc, traceback)

    @property
    def cancelled(self) -> bool:
        """Whether the turn's token fired (by `cancel()`, or by its request's cancellation)."""
        return self._running is not None and self._running.cancel_scope.cancel_called

    def cancel(self, reason: str | None = None) -> bool:
        """Fire the turn's token and cancel its task once; call it from the request's event
        loop (the task that reads the client's `response.cancel`). False if the turn is not
        running."""
        running = self._running
        if running is None or running.cancel_scope.over:
            return False
        running.cancel(reason or self.reason)
        return True


class _Turn:
    """A running turn: its scope, its own lane, and what it is to its request (`Served` to
    the lane, `Request` to the context variable)."""

    def __init__(self, parent: Request) -> None:
        self.parent = parent
        self.app_task: Any = None  # (its lane takes the task entering the turn)
        self.app: Any = None
        self.own = parent.new_lane(self)
        around = parent.cancel_scope
        self.cancel_scope = _TurnScope(_TurnLane(self.own, around.lane), around)
        self.apart = not parent.in_app_task()  # in a task of its own
        self.entered = self.own.enter()
        self.bound = bind(self)
        self.unregister = parent.cancel_scope.on_cancel(self.request_cancelled)

    @property
    def options(self) -> Any:
        return self.parent.options

    @property
    def real_receive(self) -> Any:  # pragma: no cover - a turn has no watcher
        raise NotImplementedError

    def in_app_task(self) -> bool:
        return self.own.in_app_task()

    def new_lane(self, served: Any) -> Lane:
        return self.parent.new_lane(served)

    def cancel(self, reason: str) -> None:
        scope = self.cancel_scope
        if not scope.cancel_called:
            scope.fire(reason)
            if self.own.in_app_task():
                # From the turn's own code: it lands at the turn's next await, or nowhere if the
                # turn is left first (asyncio could not take it back before Python 3.13).
                self.own.after_shield(scope.deliver)
            else:
                scope.cancel_app()

    def request_cancelled(self) -> None:
        # The request's token fired: the turn's does too. Its task is cancelled here only if
        # it is not the request's own, which the request's cancellation reaches.
        reason = self.parent.cancel_scope.reason or TURN_CANCELLED
        if self.apart:
            self.cancel(reason)
        else:
            self.cancel_scope.fire(reason)

    def leave(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        self.unregister()
        unbind(self.bound)
        scope = self.cancel_scope
        absorbed = self.own.leave(self.entered, exc_type, exc, traceback)
        if isinstance(exc, asyncio.CancelledError) and scope.cancel_called:
            # Its own cancellation (issued, or raised by `raise_if_cancelled()` in a worker
            # thread), and nobody else's pending: not the request's, issued to the same task
            # (which Python 3.10 cannot tell from the turn's by the task alone).
            absorbed = scope.absorbs() and not self.parent.cancel_scope.issued
        scope.close()
        return absorbed

    # -- the rest of what a lane reads of the request it serves (`Served`) -----------------------
    def stop(self, reason: str, status: int) -> bool:
        self.cancel(reason)
        return True

    def watchable(self) -> bool:
        return False


class _TurnScope(CancelScope):
    """A turn's scope. `shield()` and `detach()` inside the turn hold off the cancellation of
    the request around it too (a session's cancels the same task, a turn's task's parent):
    `shield()` for the block, `detach()` for the rest of the turn."""

    __slots__ = ("around", "holding")

    def __init__(self, lane: Canceller, around: CancelScope) -> None:
        super().__init__(lane)
        self.around = around
        self.holding = False  # detached: `around` shielded until the turn ends

    def enter_shield(self) -> None:
        super().enter_shield()
        self.around.enter_shield()

    def exit_shield(self) -> None:
        self.around.exit_shield()
        super().exit_shield()

    def detach(self) -> None:
        super().detach()
        if not self.holding:
            self.holding = True
            self.around.enter_shield()

    def close(self) -> None:
        super().close()
        if self.holding:
            self.holding = False
            self.around.exit_shield()  # a cancellation it deferred lands after the turn


class _TurnLane:
    """A turn's `Canceller`: what it cancels is its own (the task that entered it, or trio's
    cancel scope around it); the tasks its `on_cancel` callbacks start are the request's,
    which waits for them before it ends."""

    __slots__ = ("own", "request")

    def __init__(self, own: Lane, request: Canceller | None) -> None:
        self.own = own
        self.request = request if request is not None else own

    def cancel_app(self) -> bool:
        return self.own.cancel_app()

    def withdraw(self) -> int:
        return self.own.withdraw()

    def cancelled_elsewhere(self) -> bool:
        return self.own.cancelled_elsewhere()

    def reacting(self) -> bool:
        return False

    def after_shield(self, callback: Callable[[], object]) -> None:
        self.own.after_shield(callback)

    def after_grace(self, callback: Callable[[], object]) -> Timer:
        return self.own.after_grace(callback)

    def spawn(self, awaitable: Awaitable[object]) -> None:
        self.request.spawn(awaitable)
