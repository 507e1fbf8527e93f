"""`CancelToken`, the read-only face of a request's `CancelScope`; `current_token()`, which
finds it from anywhere in the request; `shield()` and `detach()`, which change the scope."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import ContextDecorator, contextmanager
from typing import Any, Protocol, TypeVar, cast

from ._backend import Lane, library
from ._scope import CancelScope, TokenUsage

__all__ = ["CancelToken", "Request", "TokenUsage", "current_token", "detach", "shield"]


class Request(Protocol):
    """What the context variable holds for a request: the middleware's per-request cycle,
    which makes the request's scope on first need (most requests never need one)."""

    @property
    def cancel_scope(self) -> CancelScope:
        """The request's scope, the same one every time."""

    @property
    def options(self) -> Any:
        """The middleware's options."""

    def in_app_task(self) -> bool:
        """Whether the caller runs in the request's own task (the one its cancellation
        reaches), not in one the app started."""

    def new_lane(self, served: Any) -> Lane:
        """A lane of the request's event loop for `served` (a `turn()` inside it)."""


_current: contextvars.ContextVar[Request] = contextvars.ContextVar("asgi_cancel_request")
_MAKING = threading.Lock()


class CancelToken:
    """The cancellation state of one HTTP request, read-only.

    `CancelOnDisconnectMiddleware` cancels a request the moment its client disconnects (or
    it is cancelled by id, or its deadline passes); code anywhere in the request, including
    sync code in worker threads that copied the context, finds its token with
    `current_token()` and can look (`cancelled`, `reason`), wait (`await wait()`), be called
    back (`on_cancel()`) or stop (`raise_if_cancelled()`).

    `CancelToken()` makes a token no request owns, for code that drives a binding without the
    middleware (a test, a batch job): `fire()` cancels it.
    """

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope = CancelScope()

    def __repr__(self) -> str:
        scope = self._scope
        state = f"cancelled, reason={scope.reason!r}" if scope.cancel_called else "active"
        return f"<CancelToken {state}>"

    @property
    def cancelled(self) -> bool:
        """Whether the request was cancelled. A plain attribute read: safe from any thread."""
        return self._scope.cancel_called

    @property
    def reason(self) -> str | None:
        """Why the request was cancelled (e.g. `"client disconnected"`), or None until then."""
        return self._scope.reason

    @property
    def request_id(self) -> str | None:
        """The request's id (from its `X-Request-Id` header or generated), when the middleware
        was given a `CancelRegistry`; else None. Forwarded to the next hop by
        `asgi_cancel.httpx`."""
        return self._scope.request_id

    @property
    def deadline(self) -> float | None:
        """When the request's deadline passes, in `time.monotonic()` seconds, or None."""
        return self._scope.deadline

    @property
    def usage(self) -> TokenUsage | None:
        """The tokens an engine spent on the request, as a binding counted them
        (`asgi_cancel.vllm.generate`, `count_output`); None until one counts."""
        return self._scope.usage

    @property
    def shielded(self) -> bool:
        """Whether the request is inside a `shield()` block (its cancellation would wait)."""
        return self._scope.shield_depth > 0

    @property
    def detached(self) -> bool:
        """Whether the request was detached from its client (`detach()`): never cancelled."""
        return self._scope.detached

    @property
    def should_stop(self) -> bool:
        """Whether work done for the request should stop now: the token fired, and the
        request is neither inside `shield()` nor detached (`detach()`).

        The one rule every binding follows (`asgi_cancel.httpx`, `asgi_cancel.vllm`): an
        upstream call or an engine request is interrupted exactly when the app task's own
        cancellation would be. Inside `shield()` it is left to finish, as the app's
        cancellation waits for the block's end; in a detached request it runs to the end.
        """
        scope = self._scope
        return scope.cancel_called and not scope.shield_depth and not scope.detached

    async def wait(self) -> None:
        """Return once the token is cancelled (at once if it already is)."""
        scope = self._scope
        if scope.cancel_called:
            return
        found = library()
        if found is None:
            raise RuntimeError("CancelToken.wait() needs a running asyncio or trio event loop")
        event = found.event()
        unregister = scope.on_cancel(event.set)
        try:
            await event.wait()
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
        return self._scope.on_cancel(callback)

    def on_finished(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once, in the event loop, when the request is over (its app
        returned, after its own cleanup). Exceptions it raises are logged."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._scope.on_finished(callback)

    def add_usage(self, *, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count tokens an engine spent on the request (a binding calls it as outputs come):
        what a cancelled request cost, and how much of it after its cancellation began."""
        self._scope.add_usage(prompt_tokens, completion_tokens)

    def remaining(self) -> float | None:
        """Seconds left before the request's deadline (0 once it passed), or None without one."""
        return self._scope.remaining()

    def raise_if_cancelled(self) -> None:
        """Raise `asyncio.CancelledError` if the request was cancelled.

        Meant for sync code in worker threads (a FastAPI `def` endpoint, a CPU-bound loop)
        that the event loop cannot interrupt: call it between units of work.

        Raises:
            asyncio.CancelledError: the token is cancelled; its message is the reason.
        """
        scope = self._scope
        if scope.cancel_called:
            raise asyncio.CancelledError(scope.reason)

    def fire(self, reason: str) -> None:
        """Cancel the token: report `reason` and run the `on_cancel` callbacks, once.

        For a token no request owns (`CancelToken()`). On a request's token it does the same
        and leaves the app task alone: the middleware cancels requests.
        """
        self._scope.fire(reason)


def token_of(scope: CancelScope) -> CancelToken:
    """The scope's token (made on first use: most requests never ask for it)."""
    token: CancelToken | None = scope.token
    if token is None:
        with _MAKING:  # first asked for in a worker thread and the loop at once: one token
            token = scope.token
            if token is None:
                token = object.__new__(CancelToken)
                token._scope = scope
                scope.token = token
    return token


# Make a request the current one for its task; `unbind(reset)` undoes it. The context
# variable's own methods: no Python frame on the per-request path.
bind: Callable[[Request], contextvars.Token[Request]] = _current.set
unbind: Callable[[contextvars.Token[Request]], None] = _current.reset


def request_in(context: contextvars.Context) -> Request | None:
    """The request current in `context` (a task's), if any."""
    return context.get(_current)


def current_request() -> Request | None:
    """The request being handled (its scope not made by asking), or None outside one."""
    return _current.get(None)


def in_request_task() -> bool:
    """Whether the caller runs in the current request's own task, the one the middleware
    cancels (False outside a request, and in tasks the app started)."""
    request = _current.get(None)
    return request is not None and request.in_app_task()


def find_token() -> CancelToken | None:
    """The token of the request being handled, or None outside a request."""
    request = _current.get(None)
    return None if request is None else token_of(request.cancel_scope)


def current_token() -> CancelToken:
    """Return the `CancelToken` of the request being handled.

    Works in the app task, in tasks it spawns, and in worker threads that copied the context
    (Starlette's `run_in_threadpool`, FastAPI `def` endpoints, `asyncio.to_thread`).

    Raises:
        RuntimeError: called outside a request handled by `CancelOnDisconnectMiddleware`.
    """
    try:
        request = _current.get()
    except LookupError:
        raise RuntimeError(
            "current_token() was called outside a request handled by "
            "CancelOnDisconnectMiddleware (is the middleware installed, and is this code "
            "running in the request's context?)"
        ) from None
    return token_of(request.cancel_scope)


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
    request = _current.get(None)
    if request is None:
        yield None
        return
    scope = request.cancel_scope
    scope.enter_shield()
    try:
        found = library()  # None in a worker thread: nothing of the loop's to shield
        if found is None:
            yield token_of(scope)
        else:
            with found.shielded():
                yield token_of(scope)
    finally:
        scope.exit_shield()


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
        request = _current.get(None)
        if request is None:
            return None
        scope = request.cancel_scope
        scope.detach()
        return token_of(scope)

    def __exit__(self, *exc_info: object) -> None:
        return None

    def __call__(self, func: _F) -> _F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def detached(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await func(*args, **kwargs)

            return cast(_F, detached)
        return super().__call__(func)


_F = TypeVar("_F", bound=Callable[..., Any])
