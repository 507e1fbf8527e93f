"""`CancelRegistry`: find a running request by its id and cancel it, from any thread."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["CANCELLED", "CANCELLED_STATUS", "CancelRegistry", "Stoppable"]

CANCELLED = "cancelled"
# gRPC's CANCELLED maps to 499 in Google's HTTP mapping (google.rpc.Code), nginx logs 499 for a
# client that closed: the one status that means "the caller no longer wants this".
CANCELLED_STATUS = 499
# How long `cancel()` from another thread waits for the request's event loop to act.
THREAD_TIMEOUT = 10.0


class Stoppable(Protocol):
    """A running request as the registry sees it (the middleware's cycle)."""

    def stop(self, reason: str, status: int) -> bool:
        """Fire the token, cancel the app, complete the response; False if there was nothing
        to stop (the response was complete, or the request already cancelled)."""


_Entry = tuple[Stoppable, Callable[[Callable[[], object]], object], int]


class CancelRegistry:
    """The running requests of one process, by id, for cancelling one that is no longer wanted.

    Pass one to `CancelOnDisconnectMiddleware(app, registry=registry)`: every request then has
    an id (`current_token().request_id`), taken from the `header` request header when the
    client (or a gateway) sent one, else generated, and is findable here while its app runs.
    `cancel()` stops it exactly as a disconnect would (same token, same callbacks, one
    cancellation of the app under the same rules), and the client, still connected, gets a
    499 response (or the end of a stream it has started).

    Two requests that arrive with the same id are both registered: an id names what the
    caller wants stopped, and a gateway that retried keeps one id for both attempts.

    Args:
        header: the request header that carries a caller's id (lowercase).

    Raises:
        ValueError: `header` is not a non-empty string.
    """

    def __init__(self, *, header: str = "x-request-id") -> None:
        if not isinstance(header, str) or not header:
            raise ValueError(f"header must be a non-empty header name, got {header!r}")
        self.header = header.lower()
        self._requests: dict[str, list[_Entry]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def cancel(self, request_id: str, reason: str = CANCELLED) -> bool:
        """Cancel the running request(s) with this id.

        Safe from any thread: from another thread than the request's event loop, the stop is
        handed to that loop (`call_soon_threadsafe`) and this call waits for it.

        Args:
            request_id: the id, as `current_token().request_id` reports it.
            reason: what the token's `reason` reports.

        Returns:
            True if a request was cancelled now; False for an unknown id, a request that has
            finished or completed its response, or one that was cancelled already.

        Raises:
            TimeoutError: called from another thread, the request's event loop did not run
                the stop within 10 seconds (a blocked loop).
        """
        entries = list(self._requests.get(request_id, ()))  # a copy: other threads mutate it
        stopped = False
        for cycle, call_soon_threadsafe, thread in entries:
            if thread == threading.get_ident():
                stopped = cycle.stop(reason, CANCELLED_STATUS) or stopped
                continue
            future: concurrent.futures.Future[bool] = concurrent.futures.Future()

            def run(
                cycle: Stoppable = cycle, future: concurrent.futures.Future[bool] = future
            ) -> None:
                try:
                    future.set_result(cycle.stop(reason, CANCELLED_STATUS))
                except BaseException as exc:  # pragma: no cover - stop() logs and absorbs
                    future.set_exception(exc)

            try:
                call_soon_threadsafe(run)
            except RuntimeError:  # the loop is closed: the request is over
                continue
            stopped = future.result(THREAD_TIMEOUT) or stopped
        return stopped

    # -- for the middleware ------------------------------------------------------------------
    def register(
        self,
        request_id: str,
        cycle: Stoppable,
        call_soon_threadsafe: Callable[[Callable[[], object]], object],
    ) -> None:
        """Make a running request findable (called in its event loop)."""
        entry = (cycle, call_soon_threadsafe, threading.get_ident())
        entries = self._requests.get(request_id)
        if entries is None:
            self._requests[request_id] = [entry]
        else:
            entries.append(entry)

    def unregister(self, request_id: str, cycle: Stoppable) -> None:
        """The request is over: forget it."""
        entries = self._requests.get(request_id)
        if entries is None:
            return
        if len(entries) == 1 and entries[0][0] is cycle:  # the usual case: one request per id
            del self._requests[request_id]
            return
        remaining = [entry for entry in entries if entry[0] is not cycle]
        if remaining:
            self._requests[request_id] = remaining
        else:
            del self._requests[request_id]
