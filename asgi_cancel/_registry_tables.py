"""The registry's tables: one thread's running requests by id, changed by that thread's event
loop only, read from any thread; a stop found there runs on the request's own loop (handed to
it from another thread)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Protocol

from ._token import current_request

__all__ = ["Stoppable", "Table", "forget", "hand_over", "stop_in"]


class Stoppable(Protocol):
    """A running request as the registry sees it (the middleware's cycle)."""

    def stop(self, reason: str, status: int) -> bool:
        """Fire the token, cancel the app, complete the response; False if there was nothing
        to stop (the response was complete, or the request already cancelled)."""


# One thread's running requests: id -> {request: its loop's call_soon_threadsafe}. Only that
# thread's event loop changes it, so registering needs no lock; other threads copy it (one
# C-level copy, atomic under the GIL) to look a request up.
Table = dict[str, dict["Stoppable", Callable[[Callable[[], object]], object]]]


def stop_in(
    tables: dict[int, Table], request_id: str, reason: str, status: int
) -> tuple[bool, list[concurrent.futures.Future[bool]]]:
    """Stop this thread's requests with the id; hand the others' stops to their loops.
    Never the caller's own request (a cancel sent with the id it cancels)."""
    here = threading.get_ident()
    caller: object = current_request()
    stopped = False
    handed: list[concurrent.futures.Future[bool]] = []
    for thread, table in list(tables.items()):
        for cycle, call_soon_threadsafe in list(table.get(request_id, {}).items()):
            if cycle is caller:
                continue
            if thread == here:
                stopped = cycle.stop(reason, status) or stopped
            else:
                future = hand_over(cycle, call_soon_threadsafe, reason, status)
                if future is not None:
                    handed.append(future)
    return stopped, handed


def hand_over(
    cycle: Stoppable,
    call_soon_threadsafe: Callable[[Callable[[], object]], object],
    reason: str,
    status: int,
) -> concurrent.futures.Future[bool] | None:
    """Have the request's own loop stop it; the future of its answer (None: loop gone)."""
    future: concurrent.futures.Future[bool] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(cycle.stop(reason, status))
        except BaseException as exc:  # pragma: no cover - stop() logs and absorbs
            future.set_exception(exc)

    try:
        call_soon_threadsafe(run)
    except RuntimeError:  # the loop is closed: the request is over
        return None
    return future


def forget(table: Table, request_id: str, cycle: Stoppable) -> None:
    """Take the request off the id (and the id off the table once nobody runs under it)."""
    entries = table.get(request_id)
    if entries is not None:
        entries.pop(cycle, None)
        if not entries:
            del table[request_id]
