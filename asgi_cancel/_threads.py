"""What the thread adapters (`asgi_cancel.transformers`, `asgi_cancel.llama_cpp`) share: how
they take the request's token, how they say they were made outside a request, and the delayed
report of a generation that never asked them.

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
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from time import monotonic

from ._token import CancelToken, find_token
from ._validate import describe

__all__ = ["request_token", "watch_unasked"]

logger = logging.getLogger("asgi_cancel")

_PACKAGE = Path(__file__).resolve().parent


def _outside_the_package() -> int:
    """The `stacklevel`, for `warnings.warn` in the caller, of the first frame outside
    asgi_cancel: a warning points at the user's line however deep in the adapter it is made
    (`skip_file_prefixes` does this from Python 3.12 on)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and Path(frame.f_code.co_filename).resolve().parent == _PACKAGE:
        frame, level = frame.f_back, level + 1
    return level


def request_token(token: CancelToken | None, what: str, hint: str) -> CancelToken | None:
    """`token`, or the current request's; None (with a `RuntimeWarning` at the caller's line)
    outside a request: the adapter then never stops anything, and the same code runs in a
    script.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
    """
    if token is not None:
        if not isinstance(token, CancelToken):
            raise TypeError(f"token must be a CancelToken or None, got {describe(token)}")
        return token
    found = find_token()
    if found is None:
        warnings.warn(
            f"{what} was made outside a request handled by CancelOnDisconnectMiddleware: it "
            f"never stops the generation ({hint})",
            RuntimeWarning,
            stacklevel=_outside_the_package(),
        )
    return found


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
