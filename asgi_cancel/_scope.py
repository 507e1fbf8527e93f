"""`CancelScope`: one request's cancellation, all of it in one object, shaped like trio's.

Whoever stops a request (the client left, a cancel by id, a deadline) calls `cancel()`. The
scope records it, runs the token's callbacks, and decides whether the app task may be
cancelled now (`deliver()`): not inside `shield()`, never once `detach()`ed, once only, and,
through its `Lane`, not while the event loop says the task cannot be interrupted. When the app
task ends by a cancellation, `absorbs()` tells whether it was the scope's own. A scope made
without a lane (`CancelToken()`) only records and calls back.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import Any

from ._backend import Canceller, Timer, library

__all__ = ["CancelScope", "TokenUsage", "detached"]

logger = logging.getLogger("asgi_cancel")


class TokenUsage:
    """What an engine spent on one request, in tokens: `prompt_tokens`, `completion_tokens`
    (every choice, so far), and `completion_tokens_at_cancel` (None unless cancelled), from
    which `after_cancel`: the tokens generated once the request's cancellation had begun."""

    __slots__ = ("completion_tokens", "completion_tokens_at_cancel", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.completion_tokens_at_cancel: int | None = None

    @property
    def after_cancel(self) -> int:
        at_cancel = self.completion_tokens_at_cancel
        return 0 if at_cancel is None else self.completion_tokens - at_cancel

    def __repr__(self) -> str:
        return (
            f"<TokenUsage prompt={self.prompt_tokens} completion={self.completion_tokens} "
            f"after_cancel={self.after_cancel}>"
        )


class CancelScope:
    """The cancellation state of one request, and the rules that move it.

    Made by the middleware for each request that needs one (its token is asked for, it is
    stopped, it has an id or a deadline), or by `CancelToken()` alone. `CancelToken` is its
    read-only face; `shield()` and `detach()` change it through `enter_shield()`,
    `exit_shield()` and `detach()`.
    """

    __slots__ = (
        "_callbacks",
        "_finished",
        "cancel_called",
        "deadline",
        "deferred",
        "detached",
        "held",
        "issued",
        "lane",
        "over",
        "reason",
        "request_id",
        "shield_depth",
        "timer",
        "token",
        "usage",
    )

    def __init__(self, lane: Canceller | None = None) -> None:
        self.lane = lane
        self.cancel_called = False
        self.reason: str | None = None
        self.shield_depth = 0
        self.deferred = False  # a cancellation waits for the outermost shield's end
        self.detached = False
        self.issued = False  # the app task's cancellation is in flight, and it is ours
        self.held = False  # the lane holds the cancellation until the app's current wait ends
        self.over = False  # the app has returned
        self.timer: Timer | None = None  # the grace period of a listening app
        self.request_id: str | None = None
        self.deadline: float | None = None
        self.usage: TokenUsage | None = None
        self.token: Any = None  # its `CancelToken`, made on first use (`_token.token_of`)
        self._callbacks: dict[object, tuple[Callable[[], object], contextvars.Context]] = {}
        self._finished: list[Callable[[], object]] = []

    # -- cancelling ------------------------------------------------------------------------------
    def cancel_app(self, *, listening: bool = False) -> None:
        """Once fired: cancel the app task, once, when it may be (`deliver()`). An app
        `listening` for the disconnect itself is given the grace period first, to stop its
        own work."""
        if listening and self.lane is not None:
            self.timer = self.lane.after_grace(self._grace_over)
        else:
            self.deliver()

    def fire(self, reason: str) -> None:
        """Record the cancellation and call the callbacks, once; the app task is left alone."""
        if self.cancel_called:
            return
        self.cancel_called = True
        self.reason = reason
        if self.usage is not None:
            self.usage.completion_tokens_at_cancel = self.usage.completion_tokens
        callbacks = self._callbacks
        while callbacks:
            # Popped one at a time: a callback may unregister one that has not run yet.
            callback, context = callbacks.pop(next(iter(callbacks)))
            self._run_callback(callback, context)

    def deliver(self) -> None:
        """Cancel the app task if it may be cancelled now: the one answer to "may I?".

        Never for a request that ended or was detached, never twice; inside `shield()` it
        waits for the outermost block's end; the lane may make it wait for the task to be
        interruptible (then it calls this again)."""
        if self.over or self.detached or self.issued or self.lane is None:
            return
        if self.shield_depth:
            self.deferred = True
        elif self.lane.cancel_app():
            self.issued = True
        else:
            self.held = True  # (it calls this again)

    def _grace_over(self) -> None:
        self.timer = None
        if self.over or self.lane is None:
            return
        if self.lane.reacting():
            # The app cancels its own work (Django, Quart, Starlette's stream listener): that
            # cleanup is the app's, however long it takes. No second cancellation.
            logger.debug("the app handles the disconnect itself")
        else:
            self.deliver()  # it listened and ignored the disconnect

    def absorbs(self) -> bool:
        """A cancellation ended the app task: whether it was this scope's own (absorbed by
        the middleware) rather than one from outside (a shutdown, a timeout: re-raised).

        Ours when the scope's cancellation was issued and nobody else's is pending; or when the
        app raised it itself once the scope was cancelled (`raise_if_cancelled()` in a worker
        thread) and nobody else is cancelling the task."""
        lane = self.lane
        if lane is None:
            return False
        if self.issued:
            self.issued = False
            return not lane.withdraw()
        return self.cancel_called and not lane.cancelled_elsewhere()

    # -- shield() and detach() -------------------------------------------------------------------
    def enter_shield(self) -> None:
        self.shield_depth += 1

    def exit_shield(self) -> None:
        self.shield_depth -= 1
        if not self.shield_depth and self.deferred and not self.detached:
            self.deferred = False
            if self.lane is not None:
                self.lane.after_shield(self.deliver)

    def detach(self) -> None:
        self.detached = True

    # -- callbacks -------------------------------------------------------------------------------
    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        if self.cancel_called:
            self._run_callback(callback, None)
            return _noop
        key = object()
        callbacks = self._callbacks
        callbacks[key] = (callback, contextvars.copy_context())

        def unregister() -> None:
            callbacks.pop(key, None)

        return unregister

    def on_finished(self, callback: Callable[[], object]) -> None:
        self._finished.append(callback)

    def _run_callback(
        self, callback: Callable[[], object], context: contextvars.Context | None
    ) -> None:
        try:
            result = callback() if context is None else context.run(callback)
        except (Exception, asyncio.CancelledError):
            # CancelledError too (on_cancel(token.raise_if_cancelled)): it must not stop the
            # other callbacks, nor the app's cancellation that follows.
            logger.exception("on_cancel callback %r raised", callback)
            return
        if inspect.isawaitable(result):
            self._spawn(result)

    def _spawn(self, awaitable: Awaitable[object]) -> None:
        if self.lane is not None and not self.over:
            self.lane.spawn(awaitable)
            return
        found = library()
        if found is None:
            logger.warning("on_cancel returned an awaitable outside an event loop; not run")
            if inspect.iscoroutine(awaitable):
                awaitable.close()
        else:
            found.spawn_detached(awaitable)

    def close(self) -> None:
        """The request is over: no cancellation from now on, callbacks forgotten, the
        `on_finished` callbacks called. Each callback held a copy of the request's context,
        which holds the scope, as do its token and its lane: all dropped, so that a finished
        request is freed by reference counting alone."""
        self.over = True
        lane, self.lane = self.lane, None
        if self.issued and lane is not None:
            # The app did not end by it (it swallowed it, or turned it into an error): taken
            # back, so that the server's task is not left cancelling.
            self.issued = False
            lane.withdraw()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.token = None  # (token <-> scope: freed by reference counting)
        self._callbacks.clear()
        finished, self._finished = self._finished, []
        for callback in finished:
            try:
                callback()
            except Exception:
                logger.exception("on_finished callback %r raised", callback)

    # -- what a binding counts -------------------------------------------------------------------
    def add_usage(self, prompt_tokens: int = 0, completion_tokens: int = 0) -> TokenUsage:
        usage = self.usage
        if usage is None:
            usage = self.usage = TokenUsage()
            if self.cancel_called:
                usage.completion_tokens_at_cancel = 0
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens
        return usage

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - monotonic())


def _noop() -> None:
    pass


def detached(scope: CancelScope | None) -> bool:
    """Whether a request's scope (None: not made yet) was `detach()`ed: a stop by id or by a
    deadline leaves such a request to run to its end, and its client gets its response."""
    return scope is not None and scope.detached
