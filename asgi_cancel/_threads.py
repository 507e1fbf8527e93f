"""What the thread adapters (`asgi_cancel.transformers`, `asgi_cancel.llama_cpp`) share: the
delayed report of a generation that never asked them.

A thread cannot be interrupted: a generation stops only by asking its criterion, which both
engines do after every token. One that has asked it once is wired to the token and stops at its
next token whenever it runs; one that never did (the criterion made but not passed, its thread
blocked or still waiting for the model) cannot be stopped, and is not waited for either. At the
request's cancellation a timer thread starts, so that neither the request nor the event loop
(asyncio or trio) waits; if the criterion has still not been asked when it goes off, one
WARNING says so. A generation that ended before the cancellation is never reported: it asked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from time import monotonic

from ._token import CancelToken

__all__ = ["watch_unasked"]

logger = logging.getLogger("asgi_cancel")


def watch_unasked(
    token: CancelToken, asked: Callable[[], bool], *, after: float, what: str, criterion: str
) -> Callable[[], None]:
    """At `token`'s cancellation, report `what` (the generation) if it has not asked
    `criterion` `after` seconds later, nor before. Returns the unregister function.

    Nothing starts when the request should not stop (`shield()`, `detach()`) or when the
    criterion was already asked.
    """

    def start() -> None:
        if not token.should_stop or asked():
            return
        cancelled_at = monotonic()

        def check() -> None:
            if asked():
                return
            logger.warning(
                "%s has not asked %s %.1fs after its request was cancelled, nor before, so it "
                "cannot stop: is it passed to the call, and is the thread that runs it blocked "
                "or still waiting for the model?",
                what,
                criterion,
                monotonic() - cancelled_at,
                extra={"asgi_cancel": {"unasked": what}},
            )

        timer = threading.Timer(after, check)
        timer.daemon = True
        timer.name = "asgi-cancel-unasked"
        timer.start()

    return token.on_cancel(start)
