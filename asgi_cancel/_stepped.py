"""`HandStepped`: a coroutine run without a task, stepped by hand as a task would step it.

What the asyncio lane runs the request's watcher (`_watcher.watch`) in, on the servers whose
`receive()` awaits nothing but futures of the running loop (`_servers.steppable()`): it saves
the task a watcher would otherwise need, and its creation, registration, cancellation and the
wait for its end. tests/servers/test_disconnect.py checks it on every server that gets it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any

__all__ = ["HandStepped"]

# What its steps run in: no request's context variables, and none kept alive by its futures.
_NO_CONTEXT = contextvars.Context()


class HandStepped:
    """Run `coroutine` without a task: `step()` takes its first step, and each future it
    awaits takes the next once done. `close()` stops it where it waits, as a cancellation
    would, unless its next step is already due (then that step ends it)."""

    __slots__ = ("coroutine", "loop", "waits_on")

    def __init__(self, loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, None]):
        self.loop = loop
        self.coroutine: Coroutine[Any, Any, None] | None = coroutine
        self.waits_on: asyncio.Future[Any] | None = None

    def step(self, _: object = None) -> None:
        coroutine = self.coroutine
        if coroutine is None:  # closed after its future's callback was due
            return
        self.waits_on = None
        try:
            waits_on = coroutine.send(None)
        except (StopIteration, asyncio.CancelledError):  # it returned, or was stopped
            self.coroutine = None
            return
        if waits_on is None:  # a bare yield (asyncio.sleep(0)): on with the next iteration
            self.loop.call_soon(self.step, context=_NO_CONTEXT)
            return
        # An asyncio future, as a task gets it: mark it taken, go on once it is done.
        waits_on._asyncio_future_blocking = False
        waits_on.add_done_callback(self.step, context=_NO_CONTEXT)
        self.waits_on = waits_on

    def close(self) -> None:
        waits_on = self.waits_on
        if waits_on is not None and waits_on.done():
            return  # its next step is due (uvicorn answers the watcher once the response ends)
        coroutine, self.coroutine, self.waits_on = self.coroutine, None, None
        if waits_on is not None:
            waits_on.remove_done_callback(self.step)
        if coroutine is not None:
            coroutine.close()
