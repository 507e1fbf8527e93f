"""What a cancellation reports: the route template, the phase, the log line and the hook.

Run once per cancelled request, at the disconnect, by the cycle; nothing here runs for a
request that is not cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic
from typing import Any, Protocol

from ._scope import CancelScope
from ._states import Options
from .types import CancelledRequest, OnCancelled, Scope

logger = logging.getLogger("asgi_cancel")

UNMATCHED = "unmatched"
BEFORE_RESPONSE = "before_response"
MID_STREAM = "mid_stream"
HANDSHAKE = "handshake"
SESSION = "session"
# Characters of one logged field at most: a path can be as long as the server's header limit.
MAX_LOGGED = 300


def route_template(scope: Scope) -> str:
    """The route template the router matched (`/items/{item_id}`), never the raw path.

    Starlette and FastAPI store the matched route in `scope["route"]`; its `path_format` (or
    `path`) is the template. A request no router matched, or an app without such a router,
    gets `"unmatched"`: a label value from a bounded set whatever paths clients send.
    """
    route = scope.get("route")
    if route is None:
        return UNMATCHED
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    return template if isinstance(template, str) and template else UNMATCHED


def phase(response_started: bool, scope_type: str = "http") -> str:
    """`"mid_stream"` once the response has started, `"before_response"` otherwise; for a
    websocket session, `"session"` once it was accepted, `"handshake"` otherwise."""
    if scope_type == "websocket":
        return SESSION if response_started else HANDSHAKE
    return MID_STREAM if response_started else BEFORE_RESPONSE


def method_of(scope: Scope) -> str:
    """The request's method; `"WEBSOCKET"` for a websocket session (whose scope has none)."""
    method: str = scope.get("method") or ("WEBSOCKET" if scope["type"] == "websocket" else "?")
    return method


def escaped(value: object) -> str:
    """`value` safe to write into a log line: control and non-ASCII characters escaped
    (`\\r`, `\\n`, `\\x1b`, `\\u2028`), at most `MAX_LOGGED` characters.

    A client chooses the path, the method and its own request id: written as is, a path with
    `%0D%0A` would forge a whole log line.
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_LOGGED:
        text = text[:MAX_LOGGED] + "..."
    if text.isascii() and text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def report_cancelled(
    request: CancelledRequest,
    cancel_scope: CancelScope,
    status: int | None,
    on_cancelled: OnCancelled | None,
) -> None:
    """Log the cancel line (with its `extra`) and call the `on_cancelled` hook with `request`.

    `status` is what the request's client gets: 499 after a disconnect (as nginx logs it), the
    status of a stopped request, or None for a stopped request whose response had started
    (its stream is cut). Tokens an engine spends on the request from now on are counted in
    `request.usage`, and logged once the request is over.
    """
    scope = request.scope
    cancel_scope.on_finished(lambda: _log_usage(request, cancel_scope.request_id))
    if logger.isEnabledFor(logging.INFO):
        method = escaped(method_of(scope))
        path = escaped(scope.get("path", "?"))
        route = route_template(scope)
        request_id = cancel_scope.request_id
        fields: dict[str, Any] = {
            "method": method,
            "path": path,
            "route": escaped(route),
            "reason": escaped(request.reason),
            "elapsed": round(request.elapsed, 6),
            "response_started": request.response_started,
            "phase": phase(request.response_started, scope["type"]),
            "status": status,
            "request_id": None if request_id is None else escaped(request_id),
        }
        if request.close_code is not None:  # a websocket session's
            fields["close_code"] = request.close_code
        logger.info(
            "%s %s%s cancelled after %.3fs %s: %s (%s)",
            method,
            path,
            "" if route == UNMATCHED or route == path else f" [{fields['route']}]",
            request.elapsed,
            _WHEN[fields["phase"]],
            fields["reason"],
            _outcome(request, status),
            extra={"asgi_cancel": fields},
        )
    if on_cancelled is None:
        return
    try:
        when_over = on_cancelled(request)
    except (Exception, asyncio.CancelledError):
        logger.exception("on_cancelled hook raised")
        return
    if callable(when_over):
        cancel_scope.on_finished(when_over)
    elif when_over is not None:
        logger.error(
            "on_cancelled returned %r: return None, or a callable to call when the request is over",
            when_over,
        )


class Stopped(Protocol):
    """What `report_stopped` reads of a request its middleware stopped: an HTTP cycle, a
    websocket session."""

    scope: Scope
    started_at: float
    options: Options


def report_stopped(
    request: Stopped,
    cancel_scope: CancelScope,
    reason: str,
    started: bool,
    status: int | None,
    close_code: int | None = None,
) -> None:
    """`report_cancelled` for a request the middleware stopped: its `CancelledRequest`, timed
    from the request's start, with what an engine spent on it so far (`started`: its response,
    or a session's handshake, had begun)."""
    cancelled = CancelledRequest(
        request.scope,
        reason,
        monotonic() - request.started_at,
        started,
        cancel_scope.add_usage(),
        close_code=close_code,
    )
    report_cancelled(cancelled, cancel_scope, status, request.options.on_cancelled)


_WHEN = {
    BEFORE_RESPONSE: "before the response",
    MID_STREAM: "mid-stream",
    HANDSHAKE: "during the handshake",
    SESSION: "in the session",
}


def _outcome(request: CancelledRequest, status: int | None) -> str:
    if request.close_code is not None:
        return f"close {request.close_code}"
    return "stream cut" if status is None else str(status)


def _log_usage(request: CancelledRequest, request_id: str | None) -> None:
    """Once a cancelled request is over: what the engine spent on it, if a binding counted."""
    usage = request.usage
    if not (usage.prompt_tokens or usage.completion_tokens):
        return
    if not logger.isEnabledFor(logging.INFO):
        return
    scope = request.scope
    fields = {
        "method": escaped(method_of(scope)),
        "path": escaped(scope.get("path", "?")),
        "reason": escaped(request.reason),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "completion_tokens_after_cancel": usage.after_cancel,
        "request_id": None if request_id is None else escaped(request_id),
    }
    logger.info(
        "%s %s cancelled (%s) after %d prompt and %d completion tokens, %d of them after the "
        "cancellation",
        fields["method"],
        fields["path"],
        fields["reason"],
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.after_cancel,
        extra={"asgi_cancel": fields},
    )
