"""What the middleware knows of particular servers, beyond ASGI: one small adapter per need.

ASGI gives no way to ask "has the server paused reading?", "is the app stuck in your send?" or
"what does your receive() await?", nor to say "abort this connection". Four behaviours need
them (docs/servers.md has the measurements):

- `paused_reading(reading_of(receive))`: uvicorn pauses reading while a pipelined request
  waits behind the running one, and its `receive()` resumes reading unconditionally; a watcher
  calling it would undo the pause (uvicorn then marks the wrong request disconnected and logs a
  traceback).
- `in_send(app, send)`: whether the app waits in the server's `send`, read from the app's await
  chain after a disconnect that found the response complete: hypercorn over HTTP/2 never
  returns from the final send once the connection closed.
- `steppable(receive)`: the servers whose `receive()` awaits nothing but futures of the running
  loop (no `asyncio.current_task()`, no timeout), so that the watcher can step it by hand
  without a task of its own (`_stepped.HandStepped`): uvicorn (an `asyncio.Event`), hypercorn
  and daphne (an `asyncio.Queue`'s `get`), granian (a future of its own).
- `abort(scope, receive, send)`: a started response the middleware has to cut (its deadline
  passed) must look cut to the client, which a final empty body hides, with nothing in the
  server's log, which returning early does not give on uvicorn and gunicorn (ERROR lines) and
  never ends on daphne (the connection stays open).

Each reads a server's own objects, found through the `receive` and `send` it passed (seen
through the middleware's own wrapper of `send`, which adds the request id); behind another
middleware that wraps them, nothing is recognised and the caller does the plain ASGI thing.
tests/servers/test_wire.py checks every adapter against the real server.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .types import Receive, Scope, Send

__all__ = ["abort", "in_send", "paused_reading", "reading_of", "steppable"]


def _owner(function: object) -> Any:
    return getattr(function, "__self__", None)


def _server_send(send: Send) -> Send:
    """The server's `send` behind the middleware's own wrapper (`_tracking`'s, which adds the
    request id to the response start and hands every other message on unchanged)."""
    if type(send).__module__ == "asgi_cancel._tracking":
        wrapped: Send = getattr(send, "__wrapped__", send)
        return wrapped
    return send


def _module(obj: object) -> str:
    return type(obj).__module__ or ""


def steppable(receive: Receive) -> bool:
    """Whether this server's `receive()` can be stepped by hand outside a task (see above)."""
    kind = _kind(receive)
    if kind == "queue":  # hypercorn (asyncio), daphne: the queue's own get, nothing else of it
        return getattr(receive, "__func__", None) is asyncio.Queue.get
    return kind == "uvicorn" or kind == "granian"


def in_send(app: object, send: Send) -> bool:
    """Whether the app's coroutine `app` waits in the server's `send`, somewhere down its await
    chain (read only after a disconnect that found the response complete). A send that is not
    Python code cannot be told: False."""
    function = getattr(send, "__func__", send)  # a bound method's function
    code = getattr(getattr(function, "func", function), "__code__", None)  # or a partial's
    awaitable = app
    for _ in range(_MAX_DEPTH):
        if awaitable is None or code is None:
            return False
        if getattr(awaitable, "cr_code", None) is code:
            return True
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return False


_MAX_DEPTH = 64


def reading_of(receive: Receive) -> Any:
    """What `paused_reading()` asks about this request: uvicorn's request cycle (uvicorn pauses
    reading while a pipelined request waits); None for a server that does not pause."""
    return _owner(receive) if _kind(receive) == "uvicorn" else None


def paused_reading(reading: Any) -> bool:
    """Whether uvicorn (httptools and h11) paused reading with this request's body complete
    (`reading_of()`): its `receive()` would then resume it."""
    flow = getattr(reading, "flow", None)
    return (
        getattr(flow, "read_paused", False) is True and getattr(reading, "more_body", True) is False
    )


def _kind(receive: Receive) -> str:
    """The server behind `receive` ("uvicorn", "queue", "granian", or "" for any other),
    known by the type of what it is a method of (cached)."""
    owner_type = type(getattr(receive, "__self__", None))
    kind = _kinds.get(owner_type)
    if kind is None:
        module = owner_type.__module__ or ""
        if owner_type is asyncio.Queue:
            kind = "queue"
        elif module.startswith("uvicorn.protocols.http."):
            kind = "uvicorn"
        elif module == "granian._granian":
            kind = "granian"
        else:
            kind = ""
        _kinds[owner_type] = kind
    return kind


_kinds: dict[type, str] = {}


async def abort(scope: Scope, receive: Receive, send: Send) -> bool:
    """Close the connection under a started HTTP/1 response so that the client sees it cut (no
    final chunk, or short of its Content-Length) and the server logs nothing. Returns False if
    the server was not recognised, or the response is HTTP/2 (hypercorn offers no way to reset
    a stream, and leaves one the app abandons open forever): then end it cleanly instead.

    Per server: uvicorn, close its transport and wait for its `connection_lost` (after which it
    logs nothing for an incomplete response); gunicorn's ASGI worker, a `CancelledError` (its
    "client disconnected" path, logged at DEBUG); daphne, lose the connection; hypercorn (h1)
    and granian, return without the final message.
    """
    if scope.get("http_version", "1.1") not in ("1.0", "1.1"):
        return False
    receiver = _owner(receive)
    module = _module(receiver)
    if module.startswith("uvicorn.") and hasattr(receiver, "transport"):
        receiver.transport.close()
        while not getattr(receiver, "disconnected", True):
            await receive()  # returns once uvicorn's connection_lost ran
        return True
    if module == "gunicorn.asgi.protocol":
        raise asyncio.CancelledError  # gunicorn: "request cancelled (client disconnected)"
    if module.startswith("granian"):
        return True
    send = _server_send(send)
    sender = _owner(send)
    if _module(sender).startswith("hypercorn."):
        return True
    request: Any = (getattr(send, "args", None) or (None,))[0]
    if _module(request) == "daphne.http_protocol":
        request.transport.loseConnection()
        return True
    return False
