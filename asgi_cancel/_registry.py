"""`CancelRegistry`: find a running request by its id and cancel it, from any thread, and
(with a `Broker`) from any process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from time import monotonic
from typing import Protocol, cast

from ._backend import library, running_library
from ._registry_tables import Stoppable as Stoppable
from ._registry_tables import Table, forget, stop_in
from ._token import current_request
from ._validate import header_name, seconds, valid_request_id

__all__ = [
    "CANCELLED",
    "CANCELLED_STATUS",
    "Broker",
    "CancelRegistry",
    "Stoppable",
]

CANCELLED = "cancelled by id"
# gRPC's CANCELLED maps to 499 in Google's HTTP mapping (google.rpc.Code), nginx logs 499 for a
# client that closed: the one status that means "the caller no longer wants this".
CANCELLED_STATUS = 499
# How long a cancel waits for another thread's event loop to run the stop.
THREAD_TIMEOUT = 10.0
# Cancels of ids that no request held, remembered at most (the oldest are forgotten first).
MAX_REMEMBERED = 10_000


class Broker(Protocol):
    """What carries cancels by id between the processes of a deployment (`RedisBroker`)."""

    connected: bool
    """Whether cancels reach the other processes now (False while their broker is away)."""

    def bind(self, registry: CancelRegistry) -> None:
        """Serve `registry`: deliver the cancels other processes send to it
        (`registry.stop_here()`), from the first use in an event loop on."""

    def start_soon(self) -> None:
        """Called on the registry's first use in an event loop: start listening there."""

    async def cancel_elsewhere(self, request_id: str, reason: str) -> bool:
        """Ask every other process to cancel `request_id`; whether one held it. Bounded."""

    def cancel_elsewhere_soon(self, request_id: str, reason: str) -> None:
        """The same, without waiting for the answers (from sync code)."""


class CancelRegistry:
    """The running requests of one process, by id, for cancelling one that is no longer wanted.

    Pass one to `CancelOnDisconnectMiddleware(app, registry=registry)`: every request then has
    an id (`current_token().request_id`), taken from the `header` request header when the
    client (or a gateway) sent one, else generated, and is findable here while its app runs.
    `cancel()` stops it exactly as a disconnect would (same token, same callbacks, one
    cancellation of the app under the same rules), and the client, still connected, gets a
    499 response (or a cut stream, if its response had started).

    An id sent by the client must be 1 to 200 characters of `A-Z a-z 0-9 . _ ~ : + = @ -`
    (safe in a URL path, a header and a log line); any other value is answered 400 and the app
    is not called. Two requests that arrive with the same id are both registered: an id names
    what the caller wants stopped, and a gateway that retried keeps one id for both attempts.

    A cancel that arrives before its request (a gateway that cancels at once, while the
    request is still on its way) is remembered for `remember` seconds: requests with that id
    that start meanwhile are answered 499 and their app never runs.

    Args:
        header: the request header that carries a caller's id.
        broker: carries cancels to the other processes of the deployment and theirs here
            (`asgi_cancel.redis.RedisBroker`); None: this process only. Registration stays
            local either way: a request that is not cancelled costs no network round trip.
        remember: seconds a cancel of an id that no request held is remembered (0: never).

    Raises:
        ValueError: `header` is not a header name, or `remember` is not a number of seconds.
    """

    def __init__(
        self,
        *,
        header: str = "x-request-id",
        broker: Broker | None = None,
        remember: float = 2.0,
    ) -> None:
        self.header = header_name("header", header).decode("ascii")
        self.remember = seconds("remember", remember)
        self._tables: dict[int, Table] = {}  # by thread: each changed by its own loop only
        self._lock = threading.Lock()  # for the remembered cancels
        self._remembered: dict[str, float] = {}  # id -> when it is forgotten
        # Running requests' aliases (`alias()`); changed by each request's own loop, as the
        # tables are.
        self._aliases: dict[Stoppable, list[str]] = {}
        self.broker = broker
        self._broker_idle = broker is not None  # not yet started in an event loop
        if broker is not None:
            broker.bind(self)
            if running_library() is not None:
                self.started()  # made inside the loop (uvicorn imports the app there)

    def __contains__(self, request_id: object) -> bool:
        return any(request_id in table for table in list(self._tables.values()))

    def __len__(self) -> int:
        """How many ids are running."""
        ids: set[str] = set()
        for table in list(self._tables.values()):
            ids.update(list(table))
        return len(ids)

    def cancel(self, request_id: str, reason: str = CANCELLED) -> bool:
        """Cancel the running request(s) with this id.

        Safe from any thread. A request running on another thread's event loop has its stop
        handed to that loop; from a thread that runs no event loop, this call waits for it
        (at most 10 seconds). It never blocks an event loop: called on one, it does not wait,
        and a stop handed to another loop counts as cancelled. With a broker, the other
        processes are asked too, without waiting for their answers: in async code, prefer
        `await registry.acancel(...)`, which waits for them and for other loops without
        blocking.

        Args:
            request_id: the id, as `current_token().request_id` reports it.
            reason: what the token's `reason` reports.

        Returns:
            True if a request was cancelled here; False for an unknown id, a request that has
            finished or completed its response, or one that was cancelled already.

        Raises:
            TimeoutError: called from a thread with no event loop, the request's event loop
                did not run the stop within 10 seconds (a blocked loop).
        """
        stopped, handed = stop_in(self._tables, request_id, reason, CANCELLED_STATUS)
        if handed:
            if running_library() is not None:
                stopped = True
            else:
                for future in handed:
                    stopped = future.result(THREAD_TIMEOUT) or stopped
        if self.broker is not None:
            self.broker.cancel_elsewhere_soon(request_id, reason)
        if not stopped:
            self.remember_cancel(request_id)
        return stopped

    async def acancel(self, request_id: str, reason: str = CANCELLED) -> bool:
        """`cancel()` for async code: waits for other threads' event loops without blocking
        its own (at most 10 seconds; a stop still pending then counts as cancelled: it runs
        when that loop is free), and with a broker for the other processes' answers (at most
        its `wait`). True if any of them held the request. What `cancel_endpoint` uses."""
        self.started()
        stopped = await self.stop_here(request_id, reason)
        if self.broker is not None:
            if stopped:  # held here: the others are still told (a retry may run there too)
                self.broker.cancel_elsewhere_soon(request_id, reason)
            else:
                # Remembered before the others' answers: a request with the id that comes here
                # while they are awaited is refused, as it is in the other processes.
                self.remember_cancel(request_id)
                stopped = await self.broker.cancel_elsewhere(request_id, reason)
                if stopped:
                    self.forget_cancel(request_id)
                return stopped
        if not stopped:
            self.remember_cancel(request_id)
        return stopped

    async def stop_here(self, request_id: str, reason: str) -> bool:
        """Cancel the request(s) with this id that run in this process, waiting for other
        threads' event loops without blocking this one. What a broker calls for a cancel from
        another process."""
        stopped, handed = stop_in(self._tables, request_id, reason, CANCELLED_STATUS)
        found = library()
        if not handed or found is None:
            return stopped or bool(handed)
        done, pending = await found.wait_futures(handed, THREAD_TIMEOUT)
        return stopped or bool(pending) or any(future.result() for future in done)

    def alias(self, alias: str) -> bool:
        """Make the current request findable by `alias` too, until it ends.

        For an id the app shows its client instead of the request's own, such as vLLM's
        `chatcmpl-...` (`asgi_cancel.vllm.OpenAIRequestIds` calls this): a cancel by either
        stops the request, in this process or, through the broker, from another. Call it in
        the request's event loop (its handler, or a task it started); not from a worker
        thread.

        Args:
            alias: another id for the request, of the same characters as a request id.

        A cancel by `alias` that came within the last `remember` seconds, before any request
        had it, stops the request now, as it would a request arriving with that id.

        Returns:
            True if `alias` now names the current request; False outside a request of a
            middleware with this registry, once the request has ended, or for a value no
            request id can be (`alias` is then ignored).
        """
        source = current_request()
        if source is None or not isinstance(alias, str) or not valid_request_id(alias):
            return False
        request_id = source.cancel_scope.request_id
        table = self._tables.get(threading.get_ident())
        if request_id is None or table is None:
            return False
        cycle = cast(Stoppable, source)  # the middleware's cycle: both a source and stoppable
        call_soon_threadsafe = table.get(request_id, {}).get(cycle)
        if call_soon_threadsafe is None:  # not registered on this thread, or over
            return False
        if alias != request_id:
            aliases = self._aliases.setdefault(cycle, [])
            if alias not in aliases:
                aliases.append(alias)
                self.register(alias, cycle, call_soon_threadsafe)
                if self.cancelled_before_it_came(alias):
                    # Cancelled by it before it was one: stopped as by a cancel from another
                    # task (soon, not inside the app's own call).
                    call_soon_threadsafe(lambda: cycle.stop(CANCELLED, CANCELLED_STATUS))
        return True

    def remember_cancel(self, request_id: str) -> None:
        """Remember a cancel of an id no request held, for `remember` seconds."""
        if not self.remember:
            return
        now = monotonic()
        with self._lock:
            remembered = self._remembered
            for old in list(remembered)[:64]:  # forget the expired ones, oldest first
                if remembered[old] > now:
                    break
                del remembered[old]
            remembered.pop(request_id, None)
            remembered[request_id] = now + self.remember
            while len(remembered) > MAX_REMEMBERED:
                del remembered[next(iter(remembered))]

    def forget_cancel(self, request_id: str) -> None:
        """Forget a remembered cancel of `request_id` (a request held it after all)."""
        with self._lock:
            self._remembered.pop(request_id, None)

    def cancelled_before_it_came(self, request_id: str) -> bool:
        """Whether a cancel of `request_id` came within the last `remember` seconds, before any
        request with that id (the middleware then answers 499 without running the app)."""
        if not self._remembered:
            return False
        forget_at = self._remembered.get(request_id)
        return forget_at is not None and forget_at > monotonic()

    def started(self) -> None:
        """The registry is used in an event loop: start its broker there (once)."""
        if self._broker_idle and self.broker is not None:
            self._broker_idle = False
            self.broker.start_soon()

    # -- for the middleware ------------------------------------------------------------------
    def register(
        self,
        request_id: str,
        cycle: Stoppable,
        call_soon_threadsafe: Callable[[Callable[[], object]], object],
    ) -> None:
        """Make a running request findable (called in its event loop)."""
        if self._broker_idle:
            self.started()
        thread = threading.get_ident()
        table = self._tables.get(thread)
        if table is None:
            table = self._tables.setdefault(thread, {})
        entries = table.get(request_id)
        if entries is None:
            table[request_id] = {cycle: call_soon_threadsafe}
        else:
            entries[cycle] = call_soon_threadsafe

    def unregister(self, request_id: str, cycle: Stoppable) -> None:
        """The request is over: forget it (called in its event loop, as `register`)."""
        table = self._tables.get(threading.get_ident())
        if table is None:
            return
        forget(table, request_id, cycle)
        if self._aliases:
            for alias in self._aliases.pop(cycle, ()):
                forget(table, alias, cycle)
