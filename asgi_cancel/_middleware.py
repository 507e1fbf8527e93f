"""`CancelOnDisconnectMiddleware`: validate the options, pass non-HTTP scopes, pick a backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ._asyncio import (
    DONE,
    completed,
    end_tasks,
    propagating,
    relayed,
    run_session,
    watch_after,
)
from ._asyncio import LIBRARY as asyncio_library
from ._asyncio_lane import AsyncioLane
from ._backend import Backend, Library, register
from ._cycle import Cycle
from ._registry import CancelRegistry
from ._tracking import Timeouts, Tracking, route_path
from ._validate import describe as _describe
from ._validate import seconds
from .types import AnyASGIApp, OnCancelled, Receive, Scope, Send

_get_running_loop = asyncio.events._get_running_loop
DEFAULT_READ_AHEAD = 64 * 1024
DEFAULT_GRACE = 0.1
DEFAULT_WATCH_DELAY = 0.005


def _excluder(
    exclude: Sequence[str] | Callable[[Scope], bool] | None,
) -> Callable[[Scope], bool] | None:
    if exclude is None or callable(exclude):
        return exclude
    if isinstance(exclude, str):
        exclude = (exclude,)
    prefixes = tuple(exclude) if isinstance(exclude, Sequence) else ()
    if not prefixes or not all(isinstance(p, str) and p.startswith("/") for p in prefixes):
        raise ValueError(
            "exclude must be path prefixes starting with '/', a predicate on the scope or "
            f"None, got {_describe(exclude)}"
        )

    def excluded(scope: Scope) -> bool:
        return route_path(scope).startswith(prefixes)

    return excluded


class CancelOnDisconnectMiddleware:
    """Cancel an ASGI app's work for a request the moment its HTTP client disconnects.

    After the request body is read (bounded read-ahead), the middleware becomes the only caller
    of the server's `receive`. When `http.disconnect` arrives before the response is complete,
    it fires the request's `CancelToken` and cancels the app task once (`Task.cancel()` on
    asyncio, a cancel scope on trio), waits for the app to finish its cleanup, and returns
    normally. Disconnects are cached and replayed to every `receive()` caller in the app.

    `websocket` scopes are handled too (unless `websockets=False`): from the connection on,
    the middleware is the only caller of the server's `receive`, reads the client's messages
    ahead of the app (bounded by `read_ahead`), replays them in order, and on
    `websocket.disconnect` fires the session's token and cancels the app once, with the same
    rules. `lifespan` scopes pass straight through.

    Args:
        app: the ASGI application to wrap.
        read_ahead: how many request-body bytes the middleware may read ahead of the app, so
            that a body the app has not read yet does not hide a disconnect. Past it, the
            server's own backpressure applies as without the middleware. Default 64 KiB.
        grace: seconds to let an app that is itself listening for `http.disconnect` (a pending
            `receive()` after the body) react before the middleware cancels what still runs.
            Default 0.1.
        on_cancelled: called once per cancelled request, in the event loop, as
            `on_cancelled(request)` with an `asgi_cancel.types.CancelledRequest` (scope, reason,
            elapsed, response_started, usage). For metrics exporters
            (`asgi_cancel.prometheus.CancelMetrics` is one). If it returns a callable, that is
            called with no arguments once the request is over (its app returned, cleanup
            done): how the time from the disconnect to the end of the cleanup is measured.
        watch_delay: on asyncio, seconds a request must have run (after its first wait) before
            the middleware starts watching its connection. A request that ends sooner costs no
            watcher task at all; a disconnect within that time is acted on when it ends.
            0 watches from the first wait. Default 0.005. Trio watches every request at once.
        exclude: requests never to cancel, passed to the app untouched (one check per
            request): path prefixes (`("/payments", "/admin/")`, matched against the path the
            app routes on: `scope["path"]` without `scope["root_path"]`, what Starlette's
            router sees) or a predicate `exclude(scope) -> bool`. For one endpoint that
            must run to the end, `asgi_cancel.detach()` is the alternative. Default None.
        registry: a `CancelRegistry`: every request gets an id (its `X-Request-Id` header,
            the registry's `header`, when present, else generated), reported by
            `current_token().request_id` and `request.state.request_id` on Starlette, and
            can be cancelled by id (`registry.cancel(request_id)`): its client, still
            connected, gets a 499 (a started stream is ended cleanly). Default None: no ids,
            and requests pay nothing for them.
        timeout: a deadline in seconds for every request (None: none). When it passes, the
            token fires with reason `"deadline exceeded"`, the app is cancelled as for a
            disconnect, and the client gets a 504 (a started stream is ended cleanly). One
            timer per request that has a deadline; none for the others.
        timeouts: per-route deadlines overriding `timeout`: a mapping of path prefixes
            (starting with `/`, matched as for `exclude`) to seconds or None (the longest
            matching prefix wins), or a callable `timeouts(scope) -> seconds | None`.
        websockets: handle `websocket` scopes (see above); False passes them through untouched.
            Default True.
        session_timeout: a deadline in seconds for every websocket session (None: none): the
            app is cancelled as for a disconnect and the client gets a close frame with code
            4504 ("deadline exceeded"). `timeout` and `timeouts` apply to HTTP requests only;
            `timeout_header` to both.
        timeout_header: a request header carrying the caller's remaining budget
            (`"x-request-timeout"`: `30`, `1.5`, `30s`, `500ms`, `2m`, at most 32
            characters; larger budgets count as a day); the deadline is the smaller of it and
            the configured one. A malformed value is answered 400 and the app is not called;
            a budget of 0 is answered 504. Default None: not read.

    Raises:
        TypeError: `app` is not callable.
        ValueError: an option is invalid; the message names it.
    """

    def __init__(
        self,
        app: AnyASGIApp,
        *,
        read_ahead: int = DEFAULT_READ_AHEAD,
        grace: float = DEFAULT_GRACE,
        on_cancelled: OnCancelled | None = None,
        watch_delay: float = DEFAULT_WATCH_DELAY,
        exclude: Sequence[str] | Callable[[Scope], bool] | None = None,
        registry: CancelRegistry | None = None,
        timeout: float | None = None,
        timeouts: Timeouts | None = None,
        timeout_header: str | None = None,
        websockets: bool = True,
        session_timeout: float | None = None,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI callable, got {_describe(app)}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(
                f"read_ahead must be an int of bytes >= 0, got {_describe(read_ahead)}"
            )
        if on_cancelled is not None and not callable(on_cancelled):
            raise ValueError(
                f"on_cancelled must be callable or None, got {_describe(on_cancelled)}"
            )
        self.app = app
        self.read_ahead = read_ahead
        self.grace = seconds("grace", grace)
        self.on_cancelled = on_cancelled
        self.watch_delay = seconds("watch_delay", watch_delay)
        self.exclude = _excluder(exclude)
        if not isinstance(websockets, bool):
            raise ValueError(f"websockets must be True or False, got {_describe(websockets)}")
        self.websockets = websockets
        self.registry = registry
        tracking = None
        options = (registry, timeout, timeouts, timeout_header, session_timeout)
        if any(option is not None for option in options):
            tracking = Tracking(registry, timeout, timeouts, timeout_header, session_timeout)
        self._tracking = tracking
        self._trio: Backend | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        # What the app returned is returned: servers report an ASGI app that returns a value.
        if scope["type"] != "http" or (self.exclude is not None and self.exclude(scope)):
            if scope["type"] == "websocket" and self.websockets and not self._excluded(scope):
                return await self._session(scope, receive, send)
            return await self.app(scope, receive, send)
        if _get_running_loop() is None:  # not asyncio: `running_library()` tells which
            return await self._trio_backend().run(scope, receive, send)
        # On asyncio the request runs in this frame, the only frame of the middleware's between
        # the server's task and the app: each one there costs every suspension of the app (each
        # streamed token) and every request (`python -m benchmarks.instructions`).
        cycle: Cycle[AsyncioLane] = Cycle(scope, receive, send, self, AsyncioLane)
        tracking = self._tracking
        if tracking is not None:  # ids or deadlines: only when the options ask for them
            refused = tracking.begin(cycle)
            if refused is not None:
                cycle.finished()
                return await refused
            cycle.ensure_lane().track(tracking)
            send = cycle.real_send  # the middleware's own answers carry the id too
        app = cycle.app = self.app(scope, cycle.receive, cycle.send)
        steps = app.__await__()
        timer = result = None
        try:
            # The app's first step, taken by hand: most requests end in it, and need nothing
            # more. A `for` loop ends without a `StopIteration` reaching Python when the app
            # returns; the price: what an app returns without ever awaiting is not seen.
            for step in steps:  # noqa: B007 (the step is what the loop leaves)
                break
            else:
                step = DONE
            if step is not DONE:
                timer = watch_after(cycle, self.watch_delay)
                while True:
                    # The app's first wait is handed to the task as the app would hand it; a
                    # cancellation the task throws in goes to the app, which may wait again.
                    try:
                        await relayed(step)
                    except GeneratorExit:
                        steps.close()
                        raise
                    except BaseException as exc:
                        try:
                            step = steps.throw(exc)
                        except StopIteration as returned:
                            result = returned.value
                            break
                        continue
                    result = await cycle  # the rest of the app, from where it waits
                    break
        except asyncio.CancelledError:
            if not cycle.absorbs():
                raise  # from outside (server shutdown, an outer timeout): it goes on
        finally:
            if timer is not None:
                timer.cancel()
            lane = cycle.lane
            cycle.finished()
            if lane is not None and lane.close():  # tasks the request started are left
                await end_tasks(lane, propagating())
        if cycle.stopped_with is not None:
            await completed(cycle, receive, send)
        return result

    def _excluded(self, scope: Scope) -> bool:
        return self.exclude is not None and self.exclude(scope)

    async def _session(self, scope: Scope, receive: Receive, send: Send) -> Any:
        if _get_running_loop() is None:
            return await self._trio_backend().run(scope, receive, send)
        return await run_session(self, self._tracking, scope, receive, send)

    def _trio_backend(self) -> Backend:
        if self._trio is None:
            from ._trio import TrioBackend  # trio is imported only where it runs

            self._trio = TrioBackend(self, self._tracking)
        return self._trio


def _trio_library() -> Library:
    from ._trio import LIBRARY  # trio is imported only where it runs

    return LIBRARY


register("asyncio", lambda: asyncio_library)
register("trio", _trio_library)
