"""What the middleware knows of particular servers, beyond ASGI: one small adapter per need.

ASGI gives no way to ask "has the server paused reading?" or to say "abort this connection",
nor says what a server's `receive()` awaits. Three behaviours need them (docs/servers.md has the
measurements):

- `paused_reading(receive)`: uvicorn pauses reading while a pipelined request waits behind the
  running one, and its `receive()` resumes reading unconditionally; a watcher calling it would
  undo the pause (uvicorn then marks the wrong request disconnected and logs a traceback).
- `steppable(receive)`: the servers whose `receive()` awaits nothing but futures of the running
  loop (no `asyncio.current_task()`, no timeout), so that the watcher can step it by hand
  without a task of its own (`_asyncio.HandStepped`): uvicorn (an `asyncio.Event`), hypercorn
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

__all__ = ["abort", "paused_reading", "steppable"]


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
    kind = type(receive), type(getattr(receive, "__self__", None))
    known = _steppable.get(kind)
    if known is None:
        known = _steppable[kind] = _steppable_kind(receive)
    if known and kind[1] is asyncio.Queue:  # its get(), nothing else of it
        return getattr(receive, "__func__", None) is asyncio.Queue.get
    return known


def _steppable_kind(receive: Receive) -> bool:
    owner = _owner(receive)
    if type(owner) is asyncio.Queue:  # hypercorn (asyncio), daphne: the queue's own get
        return True
    module = _module(owner)
    return module.startswith("uvicorn.protocols.http.") or module == "granian._granian"


_steppable: dict[tuple[type, type], bool] = {}  # by the types of receive and of its owner


def paused_reading(receive: Receive) -> bool:
    """Whether the server paused reading with this request's body complete: uvicorn (httptools
    and h11) does so while a pipelined request waits, and its `receive()` would resume it."""
    cycle = _owner(receive)
    if not _module(cycle).startswith("uvicorn."):
        return False
    flow = getattr(cycle, "flow", None)
    return (
        getattr(flow, "read_paused", False) is True and getattr(cycle, "more_body", True) is False
    )


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
