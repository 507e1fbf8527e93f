"""What a cancellation reports: the route template, the phase, the log line and the hook.

Run once per cancelled request, at the disconnect, by the cycle; nothing here runs for a
request that is not cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ._token import CancelToken
from .types import OnCancelled, Scope

logger = logging.getLogger("asgi_cancel")

UNMATCHED = "unmatched"
BEFORE_RESPONSE = "before_response"
MID_STREAM = "mid_stream"


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


def phase(response_started: bool) -> str:
    """`"mid_stream"` once the response has started, `"before_response"` otherwise."""
    return MID_STREAM if response_started else BEFORE_RESPONSE


def report_cancelled(
    scope: Scope,
    token: CancelToken,
    reason: str,
    elapsed: float,
    response_started: bool,
    on_cancelled: OnCancelled | None,
) -> None:
    """Log the cancel line (with its `extra`) and call the `on_cancelled` hook.

    A hook that returns a callable has it called once the request is over (the app returned
    after its cleanup): how `asgi_cancel.prometheus` times the cleanup.
    """
    if logger.isEnabledFor(logging.INFO):
        method = scope.get("method", "?")
        path = scope.get("path", "?")
        route = route_template(scope)
        fields: dict[str, Any] = {
            "method": method,
            "path": path,
            "route": route,
            "reason": reason,
            "elapsed": round(elapsed, 6),
            "response_started": response_started,
            "phase": phase(response_started),
            # The request id of a cancellation by id (issue 10) goes here when there is one.
            "request_id": None,
        }
        logger.info(
            "%s %s%s cancelled: %s after %.3fs, %s (499)",
            method,
            path,
            "" if route == UNMATCHED or route == path else f" [{route}]",
            reason,
            elapsed,
            "mid-stream" if response_started else "before the response",
            extra={"asgi_cancel": fields},
        )
    if on_cancelled is None:
        return
    try:
        done = on_cancelled(
            scope, reason=reason, elapsed=elapsed, response_started=response_started
        )
    except (Exception, asyncio.CancelledError):
        logger.exception("asgi_cancel: on_cancelled hook raised")
        return
    if callable(done):
        token.on_finished(done)
