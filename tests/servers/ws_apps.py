"""The websocket routes of the real-server tests, served bare and wrapped by one process:
`tests.servers.ws_apps:sockets`.

`/bare/<route>` is the route alone (the control), `/wrapped/<route>` the same under the
middleware (`on_cancelled=events.record_hook`, `read_ahead=WS_READ_AHEAD`); whatever is not a
websocket goes to the HTTP table of apps.py (`/hello`, the runner's readiness probe), except
`/sessions`: how many websocket sessions are running. Every route runs on asyncio and trio
servers alike and records (`events.record`, keyed by `?id=`) `start` with the token's state,
then `cancelled` (the exception's name, the token's state) or `done`, and `exit` (how the
whole app, middleware included, ended). The routes:

- `/busy?t=1.5&every=0.01`: accepts, then sends `tick <i>` every `every` seconds for `t`
  seconds without calling receive() (an LLM streaming tokens), then closes; `sent` records
  how many it sent, and `send_failed` a send that raised (what the server told it) or hung
  for SEND_TIMEOUT.
- `/chat`: accepts, then echoes each text message (a binary one is answered with its length)
  until the disconnect: `disconnect_message` with its code (a listener).
- `/handshake?wait=0.5`: reads `websocket.connect`, waits `wait` seconds before accepting (an
  auth check), then listens as `/chat`.
- `/late?n=100&hold=0.3`: accepts, then holds `hold` seconds without receive() while the client
  sends `n` messages numbered `<i> ...` (recording in `held` the most the middleware read
  ahead meanwhile, in messages and in the bytes it counts, and the process's RSS before and
  after), then reads them: `received` (how many, lost, duplicated, out of order); then answers
  `received <n>` and listens as `/chat`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import anyio

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel._token import current_request

from . import apps
from .events import (
    WS_READ_AHEAD,
    Message,
    Receive,
    Scope,
    Send,
    query_param,
    record,
    record_hook,
    recording_exit,
    request_id,
    respond,
    token_state,
)

ACCEPT: Message = {"type": "websocket.accept"}
SAMPLE_EVERY = 0.005
# hypercorn's send can hang for good once its client reset a connection whose unread messages
# filled its queue (the disconnect it then puts on that queue waits for a receive() that the
# app, stuck in send(), never makes): /busy records that as `send_failed` "hung".
SEND_TIMEOUT = 2.0
sessions = 0


async def accept(receive: Receive, send: Send, rid: str) -> None:
    message = await receive()
    assert message["type"] == "websocket.connect", message
    await send(ACCEPT)
    record(rid, "start", **token_state())


async def listen(receive: Receive, send: Send, rid: str) -> None:
    """Echo until the disconnect, then return: an app that notices the client leave itself."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            code, reason = message.get("code"), message.get("reason")
            record(rid, "disconnect_message", code=code, close_reason=reason, **token_state())
            return
        data = message.get("bytes")
        reply = f"{len(data)} bytes" if data is not None else message["text"]
        try:
            await send({"type": "websocket.send", "text": reply})
        except OSError as exc:  # uvicorn's ClientDisconnected, spec 2.4
            record(rid, "send_failed", exc=type(exc).__name__)
            return


# -- the routes -----------------------------------------------------------------------------------
async def busy(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await accept(receive, send, rid)
    every = float(query_param(scope, "every", "0.01"))
    deadline = time.monotonic() + float(query_param(scope, "t", "1.5"))
    sent = 0
    while time.monotonic() < deadline:
        try:
            with anyio.fail_after(SEND_TIMEOUT):
                await send({"type": "websocket.send", "text": f"tick {sent}"})
        except Exception as exc:  # what a server tells an app that only sends
            failure = "hung" if isinstance(exc, TimeoutError) else type(exc).__name__
            record(rid, "send_failed", exc=failure, sent=sent, **token_state())
            return
        sent += 1
        await apps.sleep(every)
    record(rid, "sent", sent=sent)
    # uvicorn's `--ws websockets` waits 10 s for the client's answer to this close, which sits
    # unread behind the messages this app never read; other servers fail it if the client left.
    with anyio.move_on_after(SEND_TIMEOUT), contextlib.suppress(Exception):
        await send({"type": "websocket.close", "code": 1000})


async def chat(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await accept(receive, send, rid)
    await listen(receive, send, rid)


async def handshake(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    message = await receive()
    assert message["type"] == "websocket.connect", message
    record(rid, "start", **token_state())
    await apps.sleep(float(query_param(scope, "wait", "0.5")))
    try:
        await send(ACCEPT)
    except OSError as exc:
        # uvicorn (sansio, wsproto) refuses a handshake its client left: the app learns it
        # here. Raised on: uvicorn ends a websocket app's ClientDisconnected quietly, and logs
        # an ERROR for an app that returns without completing the handshake.
        record(rid, "send_failed", exc=type(exc).__name__)
        raise
    record(rid, "accepted", **token_state())
    await listen(receive, send, rid)


async def late(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await accept(receive, send, rid)
    expected = int(query_param(scope, "n", "100"))
    rss_before = apps.rss_kib()
    most_messages = most_bytes = 0
    deadline = time.monotonic() + float(query_param(scope, "hold", "0.3"))
    while time.monotonic() < deadline:
        messages, counted = read_ahead_now()
        most_messages, most_bytes = max(most_messages, messages), max(most_bytes, counted)
        await apps.sleep(SAMPLE_EVERY)
    rss = {"rss_before_kib": rss_before, "rss_after_kib": apps.rss_kib()}
    record(rid, "held", messages=most_messages, bytes=most_bytes, **rss)
    numbers: list[int] = []
    while len(numbers) < expected:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            break
        numbers.append(int(message["text"].split(" ", 1)[0]))
    record(rid, "received", **tally(numbers, expected))
    await send({"type": "websocket.send", "text": f"received {len(numbers)}"})
    await listen(receive, send, rid)


def tally(numbers: list[int], expected: int) -> dict[str, Any]:
    """What became of messages `0 .. expected - 1` the client sent in order."""
    distinct = set(numbers)
    return {
        "count": len(numbers),
        "lost": len(set(range(expected)) - distinct),
        "duplicated": len(numbers) - len(distinct),
        "reordered": sum(1 for a, b in itertools.pairwise(numbers) if b < a),
    }


def read_ahead_now() -> tuple[int, int]:
    """The messages the middleware holds read ahead of this session's app, and the bytes they
    count against `read_ahead` (its `Session.buffer` and `.buffered`); (0, 0) bare."""
    session = current_request()
    buffer = getattr(session, "buffer", None)
    if buffer is None:
        return 0, 0
    return len(buffer), getattr(session, "buffered", 0)


ROUTES = {"/busy": busy, "/chat": chat, "/handshake": handshake, "/late": late}


async def table(scope: Scope, receive: Receive, send: Send) -> None:
    """The websocket routes as one raw ASGI app."""
    global sessions
    rid = request_id(scope)
    endpoint = ROUTES["/" + scope["path"].rsplit("/", 1)[-1]]
    sessions += 1
    try:
        await endpoint(scope, receive, send, rid)
    except apps.CANCELLED as exc:
        record(rid, "cancelled", exc=type(exc).__name__, **token_state())
        raise
    finally:
        sessions -= 1
    record(rid, "done")


wrapped = recording_exit(
    CancelOnDisconnectMiddleware(table, on_cancelled=record_hook, read_ahead=WS_READ_AHEAD)
)
bare = recording_exit(table)


async def sockets(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":
        await (wrapped if scope["path"].startswith("/wrapped/") else bare)(scope, receive, send)
    elif scope["type"] == "http" and scope["path"] == "/sessions":
        await respond(send, str(sessions).encode())
    else:
        await apps.table(scope, receive, send)
