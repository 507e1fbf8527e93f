"""The watchers: the one caller of the server's `receive()`, reading ahead of the app (bounded)
until the disconnect, which they hand to their request (`client_left`). `watch` serves an HTTP
request from the end of its body on (or at once, for one that has none), after `hold()`ing
for the app's first move when the client expects `100 Continue`; `watch_session` a websocket
connection, from its start.

Loop-agnostic: run in a task of its own (trio; asyncio behind a server it does not know) or
stepped by hand (`_stepped.HandStepped`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Coroutine
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from ._cycle import Cycle
from ._messages import expects_continue
from ._servers import paused_reading, reading_of
from ._session import FINISHED as SESSION_FINISHED
from ._session import Session
from ._states import FINISHED
from .types import Message

logger = logging.getLogger("asgi_cancel")

# Empty `http.request` messages tolerated after the body is complete before the watcher gives
# up on a server's receive (a server that answered every call at once would otherwise spin).
_MAX_EXTRA_REQUESTS = 3


def watcher(request: Any) -> Coroutine[Any, Any, None]:
    """The watcher for `request`: an HTTP cycle's, or a websocket session's."""
    if isinstance(request, Session):
        return watch_session(request)
    return watch(request)


async def watch_within(
    scope: AbstractContextManager[object], request: Cycle[Any] | Session[Any]
) -> None:
    """The request's watcher inside `scope` (trio's cancel scope, which ends it with the
    request)."""
    with scope:
        if request.watchable():
            await watcher(request)
            return
    request.ensure_lane().watch_ended()


async def watch(cycle: Cycle[Any]) -> None:
    """Hold the server's `receive()` for the request, once `cycle.watchable()`: read the body
    ahead of the app (at least one message, at most `read_ahead` bytes), then wait for the
    disconnect."""
    receive = cycle.real_receive
    lane = cycle.ensure_lane()
    read_ahead = cycle.options.read_ahead
    reading = reading_of(receive)  # uvicorn's request cycle: it may pause reading
    cycle.buffered = extra = 0
    try:
        if cycle.first_sent is None and not cycle.body_started and expects_continue(cycle.scope):
            # The server's receive() answers `Expect: 100-continue` (uvicorn, granian,
            # gunicorn): a call of ours would make the client upload a body the app may
            # refuse. Wait for the app to ask for it, or for its response to start (the
            # server then sends none).
            hold(cycle)
            while cycle.holding and not (cycle.body_started or cycle.reading):
                if not cycle.watchable():
                    return
                await lane.park()
            cycle.holding = False
        while cycle.disconnect is None and cycle.state is not FINISHED:
            if cycle.reading or (
                not cycle.body_complete and cycle.buffered and cycle.buffered >= read_ahead
            ):
                await lane.park()  # the app reads itself, or has enough to read
                continue
            if reading is not None and paused_reading(reading):
                # uvicorn paused reading for a pipelined request: a receive() would resume
                # it. Its own calls are the app's, as without the middleware.
                logger.debug("the server paused reading; not watching")
                return
            cycle.reading = True
            try:
                message = await receive()
            except Exception:
                # The app will meet the same error on its own receive; watching is over.
                logger.debug("server receive() raised; not watching", exc_info=True)
                return
            finally:
                cycle.reading = False
            if cycle.state is FINISHED or cycle.disconnect is not None:
                # (uvicorn answers it once the response is complete.) Or the request was
                # stopped meanwhile (by id, its deadline): the app has its disconnect, and
                # nothing the client sent after it.
                return
            message_type = message["type"]
            if message_type == "http.disconnect":
                cycle.client_left(message)
                return
            if message_type == "http.request":
                cycle.body_started = True
                if cycle.body_complete:
                    if not message.get("body"):
                        # Some servers send an empty extra http.request after the body.
                        extra += 1
                        if extra > _MAX_EXTRA_REQUESTS:
                            logger.debug("server keeps sending http.request")
                            return
                        continue
                elif not message.get("more_body", False):
                    cycle.body_completed()
                cycle.buffered += len(message.get("body", b""))
            if cycle.buffer is None:
                cycle.buffer = deque()
            cycle.buffer.append(message)
            lane.wake()  # an app caller parked behind the watcher takes it
    finally:
        # Whatever ended the watch, callers parked behind it must look again: they may now
        # have to read the server's receive themselves.
        lane.watch_ended()


def hold(cycle: Cycle[Any]) -> None:
    """The watcher waits for the app's first move (`Expect: 100-continue`): the app asks for
    its body, or its response starts, once the server took the start."""
    cycle.holding = True
    cycle.target = partial(_send_start_held, cycle)


def _send_start_held(cycle: Cycle[Any], message: Message) -> Awaitable[None]:
    # The watcher waits for the server to have taken the response start before it reads
    # (`Expect: 100-continue`: the server then sends no 100).
    return _wake_after(cycle, cycle.send_start(message))


async def _wake_after(cycle: Cycle[Any], sending: Awaitable[None]) -> None:
    try:
        await sending
    finally:
        cycle.holding = False
        cycle.wake()


async def watch_session(session: Session[Any]) -> None:
    """Hold the server's `receive()` for a websocket connection, from its start: every message
    the client sends, read ahead of the app (at least one, at most `read_ahead`; then the
    server's own backpressure applies), until the disconnect."""
    receive = session.real_receive
    lane = session.ensure_lane()
    try:
        while session.disconnect is None and session.phase is not SESSION_FINISHED:
            if session.read_ahead_full():
                await lane.park()  # until the app has taken some
                continue
            session.reading = True
            try:
                message = await receive()
            except Exception:
                # The app will meet the same error on its own receive; watching is over.
                logger.debug("server receive() raised; not watching", exc_info=True)
                return
            finally:
                session.reading = False
            if session.phase is SESSION_FINISHED or session.disconnect is not None:
                return  # over, or stopped meanwhile: nothing after the app's disconnect
            if message["type"] == "websocket.disconnect":
                session.client_left(message)
                return
            session.received(message)
    finally:
        lane.watch_ended()
