"""The side channel between the apps running inside a server process and the tests.

The apps append one JSON line per event to the file named by `$ASGI_CANCEL_EVENTS`, stamped
with `time.monotonic()`. On Linux that clock is shared by every process, so a client's close
and an app's `CancelledError` are on one time line. The tests poll the file (`EventLog`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from asgi_cancel import current_token
from asgi_cancel._token import current_request
from asgi_cancel.types import CancelledRequest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Event = dict[str, Any]

EVENTS_ENV = "ASGI_CANCEL_EVENTS"
NO_ID = "-"
# What the apps (tests/servers/apps.py) and the tests that check them both need to know.
BIG_READ_AHEAD = 1024 * 1024  # `big_app`'s read_ahead
WS_READ_AHEAD = 32 * 1024  # the websocket apps' (tests/servers/ws_apps.py) read_ahead
CLEANUP = 0.2  # seconds of cleanup in the metrics app's cancelled endpoints


def chunk(index: int) -> bytes:
    """The `index`-th chunk of the apps' `/stream`: each ends in `client.CHUNK_MARKER`."""
    return b"%05d chunk\n" % index


_fd: int | None = None


# -- the app side (inside the server process) ---------------------------------------------------
def record(request_id: str, event: str, /, **fields: Any) -> None:
    """Append one event; a single `write` on an O_APPEND file, so threads cannot interleave.
    Requests without an `id` (readiness probes, the soak's thousands) record nothing."""
    global _fd
    if request_id == NO_ID:
        return
    now = time.monotonic()
    if _fd is None:
        _fd = os.open(os.environ[EVENTS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    line = json.dumps({"id": request_id, "event": event, "t": now, **fields})
    os.write(_fd, line.encode() + b"\n")


def query_param(scope: Scope, name: str, default: str = "") -> str:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name)
    return values[0] if values else default


def request_id(scope: Scope) -> str:
    return query_param(scope, "id", NO_ID)


def token_state() -> dict[str, Any]:
    """The request's token as event fields (all None without the middleware: no token)."""
    try:
        token = current_token()
    except RuntimeError:
        return {"token_cancelled": None, "reason": None, "request_id": None}
    return {
        "token_cancelled": token.cancelled,
        "reason": token.reason,
        "request_id": token.request_id,
    }


def watcher_kind() -> str | None:
    """How the middleware watches the current request: `HandStepped` (its watcher stepped by
    hand, no task: asyncio servers whose receive() it knows), `Task`, or `trio`; None outside
    a watched request."""
    request = current_request()
    lane = getattr(request, "lane", None)
    if lane is None:
        return None
    watcher = getattr(lane, "watcher", "trio")
    return watcher if isinstance(watcher, str) else type(watcher).__name__


def record_hook(request: CancelledRequest) -> None:
    """The middleware's `on_cancelled` hook."""
    record(
        request_id(request.scope), "hook", reason=request.reason, elapsed=request.elapsed,
        response_started=request.response_started, close_code=request.close_code,
    )  # fmt: skip


def recording_exit(app: ASGIApp) -> ASGIApp:
    """Record how the whole app (middleware included) ended: the server sees exactly this."""

    async def app_with_exit_record(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        rid = request_id(scope)
        try:
            await app(scope, receive, send)
        except BaseException as exc:
            record(rid, "exit", outcome=type(exc).__name__)
            raise
        record(rid, "exit", outcome="returned")

    return app_with_exit_record


async def respond(send: Send, body: bytes, *, status: int = 200) -> None:
    """A whole text/plain response with a Content-Length."""
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve_lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def log_cancellations_to_stderr() -> None:
    """Show the middleware's one INFO line per cancelled request in the server's output."""
    logger = logging.getLogger("asgi_cancel")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("asgi_cancel %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


# -- the test side --------------------------------------------------------------------------------
class EventLog:
    """Read the events the apps recorded; every wait has a deadline."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def all(self) -> list[Event]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        # A line is complete only once its newline is written.
        return [json.loads(line) for line in data.split(b"\n")[:-1]]

    def of(self, request_id: str, event: str | None = None) -> list[Event]:
        events = [item for item in self.all() if item["id"] == request_id]
        return [item for item in events if event is None or item["event"] == event]

    def wait_for(
        self,
        request_id: str,
        event: str,
        *,
        timeout: float,
        where: Callable[[Event], bool] | None = None,
    ) -> Event:
        deadline = time.monotonic() + timeout
        while True:
            for item in self.of(request_id, event):
                if where is None or where(item):
                    return item
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {event!r} event for request {request_id} within {timeout} s; "
                    f"its events: {self.of(request_id)}"
                )
            time.sleep(0.005)
