"""Where an HTTP request is (`State`), what its cycle reads from the middleware (`Options`),
and what the app's sends meet once the request is stopped or over."""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from .types import Message, OnCancelled

if TYPE_CHECKING:
    from ._backend import Lane
    from ._cycle import Cycle

__all__ = [
    "DISCONNECTED_STATUS",
    "FINISHED",
    "READING_BODY",
    "REASON",
    "RESPONSE_COMPLETE",
    "STOPPED",
    "WATCHING",
    "Options",
    "State",
    "dropped",
    "dropped_send",
    "released",
    "stopped_send",
]

REASON = "client disconnected"
# What the log line and the `on_cancelled` hook report for a client that left: nginx's
# "client closed request" (nobody receives it; an outer middleware may).
DISCONNECTED_STATUS = 499


class State(enum.IntEnum):
    """Where a request is; what a disconnect means in each state is in the comments."""

    READING_BODY = 0  # body messages still to come: a disconnect stops the request
    WATCHING = 1  # body complete, response not: a disconnect stops it (or a listener reacts)
    RESPONSE_COMPLETE = 2  # final response message handed to send: a disconnect is the end
    STOPPED = 3  # the client left first, or the request was stopped: sends are dropped
    FINISHED = 4  # the app returned: a late receive() gets a disconnect, a send is dropped


READING_BODY, WATCHING, RESPONSE_COMPLETE, STOPPED, FINISHED = State


class Options(Protocol):
    """What a cycle reads from its middleware (only when it needs it)."""

    read_ahead: int
    grace: float
    on_cancelled: OnCancelled | None


async def dropped_send() -> None:
    pass


def dropped(message: Message) -> Awaitable[None]:
    """A send once the client is gone: dropped. Dropping is what every server does, except
    hypercorn over HTTP/2 after the TCP connection closed, where send() would hang forever."""
    return dropped_send()


def stopped_send(cycle: Cycle[Any], message: Message) -> Awaitable[None]:
    """A stopped request's send (its cycle's, bound with `partial`): dropped. While the lane
    holds the app's cancellation (for its worker thread), a checkpoint too: the cancellation
    lands at the app's first await after the thread, in a loop of thread calls and sends (a
    generation stepped in a thread) this one."""
    scope = cycle.cancel_scope  # (made by the stop)
    if scope.held and not scope.issued:
        lane: Lane = cycle.ensure_lane()
        return lane.checkpoint()
    return dropped_send()


async def _release(*_: object) -> Any:
    raise RuntimeError("asgi_cancel: the server's receive/send was let go: the request is over")


# What a finished cycle holds instead of the server's `receive` and `send` (never called).
released: Any = _release
