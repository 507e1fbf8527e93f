"""`Generation`, exported by `asgi_cancel.transformers`: one `generate()` in a thread of its
own, bound to the request's token through its `CancelCriteria`. Its reader (the streamer's
queue) ends with the request, at once, or with the generation's exception; then a bounded join,
never in an event loop's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._backend import running_library

if TYPE_CHECKING:
    from .transformers import CancelCriteria

__all__ = ["Generation", "TextQueueStreamer"]

logger = logging.getLogger("asgi_cancel")

_ResultT = TypeVar("_ResultT")


class TextQueueStreamer(Protocol):
    """What `generate_in_thread` reads of a streamer: transformers' `TextIteratorStreamer`."""

    text_queue: queue.Queue[Any]
    stop_signal: object

    def put(self, value: Any) -> None:
        """Take the next tokens (called by `generate()`)."""

    def end(self) -> None:
        """Flush the last text and put `stop_signal` (called by `generate()` when it ends)."""


_CANCELLED = object()  # put in the streamer's queue when the request should stop
_ENDED = object()  # put there when the thread's `generate()` returned or raised


class Generation(Generic[_ResultT]):
    """One `generate()` running in a thread of its own, bound to the request's token.

    Made by `generate_in_thread`. Iterate it (in a sync endpoint, a `StreamingResponse`, any
    worker thread) for the streamer's text; the iteration ends when the generation ends, when
    the request should stop (at the disconnect itself, without waiting for a token), or with
    the generation's exception. Either way it then waits for the thread at most `join_timeout`
    seconds: a generation that ignores the token is logged and left behind, never waited on
    without a bound. Closed in an event loop's thread, it returns at once and a thread of its
    own does that wait: the loop is never blocked on the generation.
    """

    def __init__(
        self,
        generate: Callable[..., _ResultT],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        criteria: CancelCriteria,
        join_timeout: float,
    ) -> None:
        self.criteria = criteria
        self.join_timeout = join_timeout
        self.streamer: TextQueueStreamer | None = kwargs.get("streamer")
        #: Whether the thread was still running after the bounded join that follows the end
        #: of reading (it ignored the token): reported once, at WARNING.
        self.left_running = False
        self._result: _ResultT | None = None
        self._error: BaseException | None = None
        self._unregister: Callable[[], None] | None = None
        self.thread = threading.Thread(
            target=self._run,
            args=(generate, args, kwargs),
            name="asgi-cancel-generate",
            daemon=True,
        )
        token = criteria.token
        if token is not None and self.streamer is not None:
            self._unregister = token.on_cancel(self._wake_reader)
            if token.cancelled:  # fired while registering from a worker thread: wake it here
                self._wake_reader()

    def _run(self, generate: Callable[..., _ResultT], args: tuple[Any, ...], kwargs: Any) -> None:
        try:
            self._result = generate(*args, **kwargs)
        except BaseException as exc:  # handed to whoever reads or joins
            self._error = exc
        finally:
            if self.streamer is not None:
                self.streamer.text_queue.put(_ENDED)  # the reader wakes even if `end()` never ran

    def _wake_reader(self) -> None:
        # In the event loop, at the disconnect: a reader blocked on the queue wakes now; one in
        # a shield reads on (the generation too) and ends when the generation does.
        if self.criteria.should_stop and self.streamer is not None:
            self.streamer.text_queue.put(_CANCELLED)

    @property
    def stopped(self) -> bool:
        """Whether the request's cancellation (or `stop()`) stopped the generation."""
        return self.criteria.stopped

    def stop(self) -> None:
        """Stop the generation at its next token (the reader stops at once)."""
        self.criteria.stop()
        if self.streamer is not None:
            self.streamer.text_queue.put(_CANCELLED)

    def __iter__(self) -> Iterator[str]:
        streamer = self.streamer
        if streamer is None:
            raise ValueError("iterating a Generation needs streamer= (a TextIteratorStreamer)")
        text_queue, stop_signal = streamer.text_queue, streamer.stop_signal
        ended = False  # the thread said so: it may still be alive for a moment, finishing
        try:
            while True:
                item = text_queue.get()
                if item is _CANCELLED:
                    if self.criteria.should_stop:
                        break
                    continue  # a cancellation seen inside shield(): read on
                if item is _ENDED:
                    ended = True
                    break
                if item is not stop_signal:  # after `end()`'s stop signal, the thread's end
                    yield item
        finally:
            if not ended and self.thread.is_alive() and not self.criteria.should_stop:
                # The reader left early (closed): nobody reads what the thread would generate.
                self.criteria.stop()
            if running_library() is None:
                self._join()
            else:
                # Closed in an event loop's thread (Starlette's iterator wrapper, collected
                # there after a disconnect): the join, up to a token or `join_timeout`, would
                # stall every request of the loop. A thread of its own waits instead.
                threading.Thread(
                    target=self._join, name="asgi-cancel-generate-join", daemon=True
                ).start()
        self._raise_error()

    def _join(self) -> None:
        """Reading has ended: wait for the thread at most `join_timeout`; one still running
        then ignores the token, and is reported and left behind."""
        self.result(self.join_timeout, raising=False)
        if self.thread.is_alive():
            self.left_running = True
            logger.warning(
                "a generate() thread still runs %gs after its request %s "
                "(it does not check CancelCriteria?); left running",
                self.join_timeout,
                "stopped" if self.criteria.should_stop else "ended",
            )

    def result(self, timeout: float | None = None, *, raising: bool = True) -> _ResultT | None:
        """Wait for the thread at most `timeout` seconds (None: until it ends); return what
        `generate()` returned (None if it is still running, or was stopped by an error), or
        raise its exception.

        Args:
            timeout: seconds to wait at most, or None.
            raising: re-raise the generation's exception (False: return None instead).
        """
        self.thread.join(timeout)
        if self.thread.is_alive():
            return None
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        if raising:
            self._raise_error()
        return self._result

    def _raise_error(self) -> None:
        error = self._error
        if error is None:
            return
        self._error = None
        if not self.criteria.should_stop:
            raise error
        # Nobody waits for the outcome of a stopped generation; its error still shows.
        logger.warning("a stopped generate() raised", exc_info=error)
