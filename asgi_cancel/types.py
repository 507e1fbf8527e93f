"""Public ASGI type aliases and the callback types of asgi-cancel's options.

Kept free of any framework import (asgiref.typing is the reference). Tests, benchmarks and
users import these: `from asgi_cancel.types import ASGIApp, OnCancelled`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._scope import TokenUsage

__all__ = [
    "ASGIApp",
    "AnyASGIApp",
    "CancelledRequest",
    "Message",
    "OnCancelled",
    "Receive",
    "Scope",
    "Send",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# What the middleware accepts as the app it wraps: loose on purpose, so apps typed with their
# own scope TypedDicts (Quart, hypercorn's types, asgiref.typing) type-check when wrapped.
AnyASGIApp = Callable[[Any, Any, Any], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class CancelledRequest:
    """What the `on_cancelled` hook is given, once per cancelled request, at the cancellation.

    The hook is called in the event loop, as `on_cancelled(request)`. If it returns a callable,
    that callable is called with no arguments once the request is over (the app returned, its
    cleanup done): how `asgi_cancel.prometheus.CancelMetrics` times the cleanup and reads the
    final token counts. Any other return value but None is logged as an error.

    Attributes:
        scope: the request's ASGI scope (`scope["route"]` is the matched route, if any).
        reason: why it was cancelled: `"client disconnected"`, `"cancelled by id"` (or the
            reason given to `CancelRegistry.cancel`), `"deadline exceeded"`.
        elapsed: seconds from the request's first wait to the cancellation.
        response_started: whether the response had started (then the stream is cut).
        usage: what an engine spent on the request, in tokens (zeros where no binding counts);
            live: a binding that counts an engine's outputs (`asgi_cancel.vllm`) keeps filling
            it in until the request is over, so read it in the callable the hook returns.
        close_code: for a websocket session, the close code (the client's, or the one the
            middleware closes a stopped session with); None for an HTTP request.

    For a websocket session, `response_started` says whether the app had accepted it.
    """

    scope: Scope
    reason: str
    elapsed: float
    response_started: bool
    usage: TokenUsage
    close_code: int | None = None


# `on_cancelled(request)`, called once per cancelled request; what it returns, if not None, is
# called once the request is over.
OnCancelled = Callable[[CancelledRequest], Callable[[], object] | None]
