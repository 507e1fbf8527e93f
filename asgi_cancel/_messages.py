"""What an ASGI message or scope says, read only when a decision needs it: whether a response
is complete, whether a request announces a body or expects `100 Continue`, whether a response
is an event stream. Pure functions, no state."""

from __future__ import annotations

from .types import Message, Scope

__all__ = [
    "BODYLESS_METHODS",
    "DISCONNECT",
    "announces_body",
    "body_complete",
    "expects_continue",
    "is_event_stream",
    "response_complete",
]

BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS", "DELETE", "TRACE")
# What the app's receive() gets a copy of once the request is over for it.
DISCONNECT: Message = {"type": "http.disconnect"}
# Body messages: the response's own, and the zero-copy extension's (a file's bytes).
_BODIES = ("http.response.body", "http.response.zerocopysend")


def response_complete(start: Message, last: Message) -> bool:
    """Whether `last`, the last message sent after the response `start`, ended the response."""
    message_type = last["type"]
    if message_type in _BODIES:
        return not start.get("trailers", False) and not last.get("more_body", False)
    if message_type == "http.response.trailers":
        return not last.get("more_trailers", False)
    return bool(message_type == "http.response.pathsend")


def body_complete(last: Message) -> bool:
    """Whether the response body is complete once `last` was sent (its trailers may not be)."""
    if last["type"] in _BODIES:
        return not last.get("more_body", False)
    return bool(last["type"] == "http.response.trailers")


def announces_body(scope: Scope) -> bool:
    """Whether the request has a body, as its headers (or, without them, its method) say. A POST
    without a Content-Length may carry one (HTTP/2)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return scope.get("method") not in BODYLESS_METHODS


def expects_continue(scope: Scope) -> bool:
    """Whether the client waits for `100 Continue` before it sends its body."""
    if scope.get("method") in BODYLESS_METHODS:
        return False
    for name, value in scope.get("headers", ()):
        if name == b"expect":
            return bytes(value).strip().lower() == b"100-continue"
    return False


def is_event_stream(start: Message) -> bool:
    """Whether the response `start` announces an event stream (SSE)."""
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return bytes(value).lower().startswith(b"text/event-stream")
    return False
