"""OpenTelemetry: mark the request's span when the request is cancelled.

Needs the `otel` extra (`pip install 'asgi-cancel[otel]'`, i.e. `opentelemetry-api`). Put
`TraceCancellations` inside `CancelOnDisconnectMiddleware`, which sits inside the tracing
middleware (OpenTelemetry's `OpenTelemetryMiddleware`, or a framework's instrumentation):

```python
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

app = OpenTelemetryMiddleware(CancelOnDisconnectMiddleware(TraceCancellations(app)))
```
"""

from __future__ import annotations

from time import monotonic

from ._extras import missing_extra

try:
    from opentelemetry import trace
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("otel", exc) from exc

from ._report import phase
from ._token import current_token
from .types import AnyASGIApp, Message, Receive, Scope, Send

__all__ = ["EVENT", "TraceCancellations"]

EVENT = "asgi_cancel.cancelled"
"""The name of the span event `TraceCancellations` adds to a cancelled request's span."""


class TraceCancellations:
    """Add an event and attributes to the request's span when the request is cancelled.

    At the cancellation (the client's disconnect), the span that was current when the request
    reached this middleware gets an `asgi_cancel.cancelled` event and the attributes
    `asgi_cancel.reason`, `asgi_cancel.phase` (`"before_response"` or `"mid_stream"`; a
    websocket session's: `"handshake"` or `"session"`) and
    `asgi_cancel.elapsed` (seconds since the request reached this middleware). Nothing is
    done when no span is recording, for requests that are not cancelled, or outside
    `CancelOnDisconnectMiddleware`; a request with a recording span costs one wrapped `send`.

    Args:
        app: the ASGI application to wrap.
    """

    def __init__(self, app: AnyASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        span = trace.get_current_span()
        if not span.is_recording():
            await self.app(scope, receive, send)
            return
        try:
            token = current_token()
        except RuntimeError:  # not inside CancelOnDisconnectMiddleware
            await self.app(scope, receive, send)
            return
        started_at = monotonic()
        response_started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        def mark_span() -> None:
            attributes: dict[str, str | float] = {
                "asgi_cancel.reason": token.reason or "",
                "asgi_cancel.phase": phase(response_started, scope["type"]),
                "asgi_cancel.elapsed": monotonic() - started_at,
            }
            span.add_event(EVENT, attributes)
            span.set_attributes(attributes)

        unregister = token.on_cancel(mark_span)
        try:
            await self.app(scope, receive, send_noting_start)
        finally:
            unregister()
