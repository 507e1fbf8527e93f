"""Which event loop runs, and the shape both event-loop backends have.

`running_library()` is the one place that tells asyncio and trio apart. Each loop has a backend
module (`_asyncio.py`, `_trio.py`) with the same parts:

- a `Library`: what code outside a request may need from the running loop (an event, a
  shielded block, waiting for other threads' futures), found with `library()`;
- a `Backend` per middleware, which runs requests (the middleware picks it once per call);
- a `Lane` per request: the few event-loop operations its `Cycle` and `CancelScope` use (park
  and wake callers, timers, spawn a task, cancel the app task).

Nothing outside a backend module imports trio or reads asyncio's tasks. Backends are found
through loaders the middleware registers (`register()`), so that this module imports none of
them and trio is imported only where it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from .types import Receive, Scope, Send

if TYPE_CHECKING:
    from ._scope import CancelScope

__all__ = [
    "Backend",
    "Canceller",
    "Event",
    "Lane",
    "Library",
    "Served",
    "Timer",
    "library",
    "register",
    "running_library",
]

_get_running_loop = asyncio.events._get_running_loop
_loaders: dict[str, Callable[[], Library]] = {}
_libraries: dict[str, Library] = {}


def running_library() -> str | None:
    """`"asyncio"` or `"trio"`: the event loop running in this thread; None in a thread that
    runs none (a worker thread). Trio is asked only if it was imported."""
    if _get_running_loop() is not None:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        return "trio"
    return None


def register(name: str, load: Callable[[], Library]) -> None:
    """Say how to load the backend of the loop `name` (called once, by the middleware)."""
    _loaders[name] = load


def library() -> Library | None:
    """The running loop's `Library`, or None in a thread that runs no event loop."""
    name = running_library()
    if name is None:
        return None
    found = _libraries.get(name)
    if found is None:
        found = _libraries[name] = _loaders[name]()
    return found


class Timer(Protocol):
    def cancel(self) -> None:
        """Never call it (nothing happens if it already ran)."""


class Event(Protocol):
    def set(self) -> None: ...

    async def wait(self) -> Any: ...


class Library(Protocol):
    """What the running loop offers code outside a request's own machinery."""

    def event(self) -> Event:
        """A new one-shot event of this loop."""

    def shielded(self) -> AbstractContextManager[object]:
        """A block that this loop's own cancellations wait for (trio's shielded cancel scope;
        asyncio has none: nothing)."""

    async def wait_futures(
        self, futures: Iterable[concurrent.futures.Future[bool]], seconds: float
    ) -> tuple[set[concurrent.futures.Future[bool]], set[concurrent.futures.Future[bool]]]:
        """Wait for futures other threads complete, at most `seconds`, without
        blocking this loop: (done, not done)."""

    def spawn_detached(self, awaitable: Awaitable[object]) -> None:
        """Run `awaitable` in a task no request waits for (best effort)."""


class Canceller(Protocol):
    """What a request's `CancelScope` needs from its event loop: cancel the task it scopes (once,
    when it can be interrupted), take that back, and the timers and tasks around it."""

    def after_shield(self, callback: Callable[[], object]) -> None:
        """Call `callback()` (a deferred cancellation's delivery) as soon as it may land in the
        app, after a `shield()` block in the app's task or in a worker thread."""

    def after_grace(self, callback: Callable[[], object]) -> Timer:
        """Call `callback()` once the grace period has passed and what was due by then ran."""

    def spawn(self, awaitable: Awaitable[object]) -> None:
        """Run `awaitable` in a task of its own, which the request's end waits for."""

    def cancel_app(self) -> bool:
        """Cancel the app task now if it can be interrupted now; returns whether it was.

        If it cannot yet (it waits for a worker thread, runs a framework's shielded cleanup),
        the lane calls its scope's `deliver()` again once it can."""

    def withdraw(self) -> int:
        """Take back the cancellation `cancel_app()` issued; how many others are pending."""

    def cancelled_elsewhere(self) -> bool:
        """Whether someone else is cancelling the app task (a shutdown, a timeout)."""

    def reacting(self) -> bool:
        """Whether the app is cancelling its own work (it listened for the disconnect)."""


class Lane(Canceller, Protocol):
    """One request's event-loop operations, made by its backend."""

    async def park(self) -> None:
        """Wait until `wake()`."""

    def wake(self) -> None:
        """Wake every parked caller, and let the watcher look again."""

    async def checkpoint(self) -> None:
        """Let a cancellation of the app task issued just now land here."""

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        """Call `callback()` in the request's event loop in `delay` seconds."""

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        """Call `callback()` in the request's event loop soon; from any thread."""

    def watch_now(self) -> bool:
        """Start the watcher if it has not started; returns whether it is watching."""

    def watch_ended(self) -> None:
        """The watcher returned: wake the callers parked behind it."""

    def enter(self) -> object:
        """A `turn()` inside the request begins, in the caller's task: what its cancellation
        will reach (trio: a cancel scope entered now). Returns what `leave()` takes."""

    def leave(
        self,
        entered: object,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        """The turn ends (`entered` is what `enter()` returned): whether the loop swallowed
        `exc`, the turn's own cancellation (trio's cancel scope does)."""

    def in_app_task(self) -> bool:
        """Whether the caller runs in the app task itself (not a task it started)."""


class Served(Protocol):
    """What a lane needs from the request it serves: an HTTP cycle (`_cycle.Cycle`) or a
    websocket session (`_session.Session`)."""

    app: Any  # what the app's call returned
    app_task: Any  # the backend's hold on the app task, once it first waited
    real_receive: Receive

    @property
    def options(self) -> GraceOption: ...

    @property
    def cancel_scope(self) -> CancelScope: ...

    def stop(self, reason: str, status: int) -> bool: ...

    def in_app_task(self) -> bool: ...

    def watchable(self) -> bool: ...


class GraceOption(Protocol):
    grace: float


class Backend(Protocol):
    """Runs requests on one kind of event loop, for one middleware."""

    async def run(self, scope: Scope, receive: Receive, send: Send) -> Any:
        """Run one request through the middleware; returns what the app returned."""
