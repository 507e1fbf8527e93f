"""The per-request cancellation token, the contextvar that finds it, and `shield()`.

The token stands alone: it knows nothing of ASGI or of event loops beyond `wait()`. Whoever
cancels a request (the middleware's asyncio and trio drivers) holds it and uses the
`fire()` / `cancel_app()` / `release()` part of its interface, passing a `Canceller`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ContextDecorator, contextmanager
from time import monotonic
from typing import Any, Protocol, TypeVar

__all__ = ["CancelToken", "Canceller", "TokenUsage", "current_token", "detach", "shield"]

logger = logging.getLogger("asgi_cancel")


class TokenSource(Protocol):
    """What the context variable holds for a request: whatever makes its token on first use
    (the middleware's per-request cycle; most requests never ask for their token)."""

    @property
    def token(self) -> CancelToken:
        """The request's token, the same one every time."""


_current: contextvars.ContextVar[TokenSource] = contextvars.ContextVar("asgi_cancel_token")


class Canceller(Protocol):
    """What a token needs from whoever cancels its request (the middleware's drivers)."""

    def cancel_app(self) -> None:
        """Cancel the request's app task now."""

    def cancel_app_soon(self) -> None:
        """Cancel it from inside the app (a `shield()` block's exit, possibly in a worker
        thread), without racing its end."""

    def spawn(self, awaitable: Awaitable[object], /) -> None:
        """Run an awaitable returned by an `on_cancel` callback, before the request ends."""


class CancelToken:
    """The cancellation state of one HTTP request.

    `CancelOnDisconnectMiddleware` makes one per request and fires it the moment the client
    disconnects before the response is complete. Code anywhere in the request, including sync
    code in worker threads that copied the context, finds it with `current_token()`.

    A token only reports and notifies. Whoever cancels the request calls `fire()` (mark it,
    run the callbacks), then `cancel_app()` (which honours `shield()`), and `release()` once the
    request is over; the `Canceller` it passes to `fire()` does the actual cancelling.
    """

    # Class-level defaults and no __init__: a token is made only when a request asks for it
    # or is cancelled, and each field is stored only when it changes.
    _cancelled: bool = False
    _reason: str | None = None
    _callbacks: dict[object, _Registered] | None = None
    _canceller: Canceller | None = None
    _shield_depth: int = 0
    _deferred: bool = False
    #: The request's id (from its `X-Request-Id` header or generated), when the middleware was
    #: given a `CancelRegistry`; else None. Forwarded to the next hop by `asgi_cancel.httpx`.
    request_id: str | None = None
    #: When the request's deadline passes, in `time.monotonic()` seconds, or None without one.
    deadline: float | None = None
    _detached: bool = False
    _finished: list[Callable[[], object]] | None = None
    #: The tokens an engine spent on the request, as a binding counted them
    #: (`asgi_cancel.vllm.generate`, `count_output`); None until one counts.
    usage: TokenUsage | None = None

    def __repr__(self) -> str:
        state = f"cancelled, reason={self._reason!r}" if self._cancelled else "active"
        return f"<CancelToken {state}>"

    @property
    def cancelled(self) -> bool:
        """Whether the request was cancelled. A plain attribute read: safe from any thread."""
        return self._cancelled

    @property
    def reason(self) -> str | None:
        """Why the request was cancelled (e.g. `"client disconnected"`), or None until then."""
        return self._reason

    async def wait(self) -> None:
        """Return once the token is cancelled (at once if it already is)."""
        if self._cancelled:
            return
        loop = asyncio.events._get_running_loop()
        if loop is None:  # trio
            import trio

            event = trio.Event()
            unregister = self.on_cancel(event.set)
            try:
                await event.wait()
            finally:
                unregister()
            return
        future: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        unregister = self.on_cancel(wake)
        try:
            await future
        finally:
            unregister()

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call `callback()` once, in the event loop, the moment the token is cancelled.

        Callbacks run at the disconnect itself, before the app task sees its cancellation, so
        they can stop work that the app task does not own (an engine request, a queued job).
        If the callback returns an awaitable, it is run as a task that the middleware awaits
        before the request ends, so it completes even while the app is being cancelled.
        The callback runs in a copy of the context it was registered in (request ids and other
        context variables are those of its own request). On a token that is already
        cancelled, the callback runs at once.

        Args:
            callback: a function taking no arguments.

        Returns:
            A function that unregisters the callback; calling it after the callback ran, or
            twice, does nothing.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        if self._cancelled:
            self._run_callback(callback, None)
            return _noop
        if self._callbacks is None:
            self._callbacks = {}
        key = object()
        self._callbacks[key] = (callback, contextvars.copy_context())
        callbacks = self._callbacks

        def unregister() -> None:
            callbacks.pop(key, None)

        return unregister

    def add_usage(self, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count tokens an engine spent on the request (a binding calls it as outputs come):
        what a cancelled request cost, and how much of it after its cancellation began."""
        usage = self.usage
        if usage is None:
            usage = self.usage = TokenUsage()
            if self._cancelled:
                usage.completion_tokens_at_cancel = 0
        usage.prompt_tokens += prompt_tokens
        usage.completion_tokens += completion_tokens

    def remaining(self) -> float | None:
        """Seconds left before the request's deadline (0 once it passed), or None without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - monotonic())

    def raise_if_cancelled(self) -> None:
        """Raise `asyncio.CancelledError` if the request was cancelled.

        Meant for sync code in worker threads (a FastAPI `def` endpoint, a CPU-bound loop)
        that the event loop cannot interrupt: call it between units of work.

        Raises:
            asyncio.CancelledError: the token is cancelled; its message is the reason.
        """
        if self._cancelled:
            raise asyncio.CancelledError(self._reason)

    # -- for whoever cancels the request ---------------------------------------------------------
    def fire(self, reason: str, canceller: Canceller | None = None) -> None:
        """Cancel the token: report `reason` and run the `on_cancel` callbacks, once.

        Called by the middleware at the disconnect. It does not cancel the app task: that is
        `cancel_app()`, which the middleware calls at once or after its grace period.

        Args:
            reason: what `reason` reports from now on.
            canceller: what cancels the app and runs the callbacks' awaitables; without
                one, awaitables run detached and `cancel_app()` does nothing.
        """
        if self._cancelled:
            return
        self._cancelled = True
        self._reason = reason
        if self.usage is not None:
            self.usage.completion_tokens_at_cancel = self.usage.completion_tokens
        self._canceller = canceller
        callbacks = self._callbacks
        while callbacks:
            # Popped one at a time: a callback may unregister one that has not run yet.
            callback, context = callbacks.pop(next(iter(callbacks)))
            self._run_callback(callback, context)
        self._callbacks = None

    @property
    def shielded(self) -> bool:
        """Whether the request is inside a `shield()` block (its cancellation would wait)."""
        return self._shield_depth > 0

    @property
    def detached(self) -> bool:
        """Whether the request was detached from its client (`detach()`): never cancelled."""
        return self._detached

    @property
    def should_stop(self) -> bool:
        """Whether work done for the request should stop now: the token fired, and the
        request is neither inside `shield()` nor detached (`detach()`).

        The one rule every binding follows (`asgi_cancel.httpx`, `asgi_cancel.vllm`): an
        upstream call or an engine request is interrupted exactly when the app task's own
        cancellation would be. Inside `shield()` it is left to finish, as the app's
        cancellation waits for the block's end; in a detached request it runs to the end.
        """
        return self._cancelled and not self._shield_depth and not self._detached

    def on_finished(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once, in the event loop, when the request is over (its app
        returned, after its own cleanup). Exceptions it raises are logged."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        if self._finished is None:
            self._finished = []
        self._finished.append(callback)

    def cancel_app(self) -> None:
        """Have the canceller cancel the app now, or when the outermost `shield()` exits;
        never for a request that was detached (`detach()`)."""
        if self._detached:
            return
        if self._shield_depth:
            self._deferred = True
        elif self._canceller is not None:
            self._canceller.cancel_app()

    def release(self) -> None:
        """The request is over: forget the callbacks and the canceller.

        Each callback holds a copy of the request's context, which holds the token: dropped
        so that a finished request is freed by reference counting alone.
        """
        self._callbacks = None
        self._canceller = None
        finished = self._finished
        if finished is not None:  # only requests with an on_finished() (cancelled ones)
            self._finished = None
            for callback in finished:
                try:
                    callback()
                except Exception:
                    logger.exception("on_finished callback %r raised", callback)

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
            if self._canceller is not None:
                self._canceller.spawn(result)
            else:
                run_detached(result)


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


def _noop() -> None:
    pass


_Registered = tuple[Callable[[], object], contextvars.Context]


_detached: set[asyncio.Task[object]] = set()


def run_detached(awaitable: Awaitable[object]) -> None:
    """Run an awaitable in its own asyncio task, kept alive until it ends (best effort)."""

    async def run() -> object:
        return await awaitable

    task = asyncio.get_running_loop().create_task(run())
    _detached.add(task)
    task.add_done_callback(_detached.discard)


# Make a request's token source the current one for its task; `unbind(reset)` undoes it.
# The contextvar's own methods: no Python frame on the per-request path.
bind: Callable[[TokenSource], contextvars.Token[TokenSource]] = _current.set
unbind: Callable[[contextvars.Token[TokenSource]], None] = _current.reset


def source_in(context: contextvars.Context) -> TokenSource | None:
    """The request whose token is current in `context` (a task's), if any (its token is not
    made by asking)."""
    return context.get(_current)


def current_source() -> TokenSource | None:
    """The request being handled (its token not made by asking), or None outside one."""
    return _current.get(None)


def find_token() -> CancelToken | None:
    """The token of the request being handled, or None outside a request."""
    source = _current.get(None)
    return None if source is None else source.token


def current_token() -> CancelToken:
    """Return the `CancelToken` of the request being handled.

    Works in the app task, in tasks it spawns, and in worker threads that copied the context
    (Starlette's `run_in_threadpool`, FastAPI `def` endpoints, `asyncio.to_thread`).

    Raises:
        RuntimeError: called outside a request handled by `CancelOnDisconnectMiddleware`.
    """
    try:
        source = _current.get()
    except LookupError:
        raise RuntimeError(
            "current_token() was called outside a request handled by "
            "CancelOnDisconnectMiddleware (is the middleware installed, and is this code "
            "running in the request's context?)"
        ) from None
    return source.token


@contextmanager
def shield() -> Iterator[CancelToken | None]:
    """Defer the request's cancellation until the block exits.

    Use it around a critical section that must not be interrupted half-way (a database
    commit, a billing record). The token still reports the disconnect at once (`cancelled`
    becomes True and callbacks run); only the app task's cancellation waits, and is delivered
    when the outermost `shield()` block exits. Outside a request it does nothing. On trio the
    block is also a shielded cancel scope, so it defers every cancellation, as trio's own
    shields do; on asyncio an outside cancellation (server shutdown) still goes through.

    Yields:
        The request's token, or None outside a request.
    """
    token = find_token()
    if token is None:
        yield None
        return
    token._shield_depth += 1
    try:
        if _in_trio_task():
            # Trio: a cancel scope, once cancelled, cancels every later checkpoint in it (a
            # cancellation issued while the app waited for a worker thread would land inside
            # this block): a shielded scope defers it to the block's end, trio's own way.
            import trio

            with trio.CancelScope(shield=True):
                yield token
        else:  # an asyncio task, or sync code in a worker thread
            yield token
    finally:
        token._shield_depth -= 1
        if not token._shield_depth and token._deferred:
            token._deferred = False
            if token._canceller is not None and not token._detached:
                token._canceller.cancel_app_soon()


def _in_trio_task() -> bool:
    if asyncio.events._get_running_loop() is not None:
        return False
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:  # a worker thread
        return False
    return True


class detach(ContextDecorator):  # lower case: used like shield(), a function-like helper
    """Detach the request from its client: if the client leaves, nothing is cancelled.

    For endpoints that must run to the end whatever the client does (a payment, a write that
    is not idempotent). The token still reports the disconnect (`cancelled` becomes True,
    `on_cancel` callbacks run, `reason` is set); only the app task's cancellation never comes,
    for the rest of the request, the block's exit included. Use it as a context manager, or
    as a decorator on an endpoint (sync or `async def`). Outside a request it does nothing.

    The whole request (or everything but a few routes) can be excluded at the front door
    instead, with the middleware's `exclude` option.
    """

    def __enter__(self) -> CancelToken | None:
        token = find_token()
        if token is not None:
            token._detached = True
        return token

    def __exit__(self, *exc_info: object) -> None:
        return None

    def __call__(self, func: _F) -> _F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def detached(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await func(*args, **kwargs)

            return detached  # type: ignore[return-value]
        return super().__call__(func)


_F = TypeVar("_F", bound=Callable[..., Any])
