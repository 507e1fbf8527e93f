"""Stop a transformers `generate()` running in a worker thread when the request stops.

Cancelling a request's asyncio task cannot stop a thread: a `model.generate()` started in a
`threading.Thread`, a threadpool endpoint, `run_in_executor` or `asyncio.to_thread` runs to
`max_new_tokens` for a client that left. The request's token can stop it: `CancelCriteria` is a
transformers stopping criterion that ends the generation at its next token once the request
should stop, and `generate_in_thread` is the `TextIteratorStreamer` pattern with that criterion
built in, a reader that ends with the request, and a bounded join.

Nothing here imports transformers or torch: `CancelCriteria` is a stopping criterion by its
call signature (transformers never checks the class), and the tensors it is given make the one
it returns. The `transformers` extra installs what the generation itself needs.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import Any, TypeVar

from ._generation import Generation as Generation
from ._generation import TextQueueStreamer as TextQueueStreamer
from ._threads import request_token, watch_unasked
from ._token import CancelToken
from ._validate import describe, seconds

__all__ = [
    "STILL_RUNNING_AFTER",
    "CancelCriteria",
    "Generation",
    "TextQueueStreamer",
    "generate_in_thread",
]

#: Seconds after a request's cancellation at which a generation that has never called its
#: `CancelCriteria` (not passed to `generate()`, or its thread blocked or still waiting for the
#: model) is logged at WARNING. Read when the criteria is made.
STILL_RUNNING_AFTER = 2.0

_ResultT = TypeVar("_ResultT")


class CancelCriteria:
    """A transformers stopping criterion that stops `generate()` when the request should stop.

    Make it in the request's context (the endpoint, or anything the request's task or its
    threadpool call runs), then hand it to the thread that generates, in
    `stopping_criteria=StoppingCriteriaList([CancelCriteria()])`: a `threading.Thread` and
    `run_in_executor` do not carry the request's context variables, so `current_token()` is
    not there. `generate()` calls it after every new token; once the request's token says the
    work should stop (`token.should_stop`: the client left, and the request is neither inside
    `shield()` nor detached), it returns True for every sequence and the generation ends with
    that token: at most one token (the one being computed) after the cancellation.

    It also counts what the generation costs into the token (`token.usage`: prompt tokens,
    completion tokens, and those generated after the cancellation began), which the cancel log
    line and `CancelMetrics` report. It counts rows times positions, as the engine computes
    them: every sequence of a batch, every beam, padding included. For an encoder-decoder model
    the prompt is the decoder's start. The rows are those it is asked about, unless `rows` says
    otherwise: a beam search (transformers 4.50 on) asks about more candidates than the beams it
    computes (twice as many, or more with several EOS tokens), so give it the batch size times
    `num_beams` there (`generate_in_thread` does when its call gives `num_beams=`).

    Make one per `generate()` call (it counts from that call's first token). Made outside a
    request (no token), it warns (`RuntimeWarning`, at the line that made it) and never stops
    anything: the same code still runs in a script.

    One that `generate()` never calls (not passed to it, or its thread blocked or still waiting
    for the model) cannot stop the generation: `STILL_RUNNING_AFTER` seconds after the
    request's cancellation, a WARNING says so (a timer thread: nothing waits for it). One that
    was called is never reported: its generation stops at its next token, or had ended.

    Args:
        token: the request's token; by default `current_token()` of the context it is made in.
        rows: the rows `generate()` computes per token, when they are not the rows it asks
            about (a beam search: batch size times `num_beams`); None: those it asks about.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
        ValueError: `rows` is neither None nor an int > 0.
    """

    def __init__(self, token: CancelToken | None = None, *, rows: int | None = None) -> None:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"rows must be None or an int > 0, got {describe(rows)}")
        hint = "in a threading.Thread or run_in_executor? make it in the endpoint and hand it over"
        self.token = request_token(token, "CancelCriteria()", hint)
        self.rows = rows  # counted per token instead of the rows asked about, if given
        #: Whether this criterion stopped a generation (the request should stop). A generation
        #: that ended by itself (`max_new_tokens`, EOS) before that is never marked.
        self.stopped = False
        #: When it stopped one (`time.monotonic()`), or None.
        self.stopped_at: float | None = None
        self._asked_to_stop = False
        self._length: int | None = None  # positions seen at the previous call
        if self.token is not None:
            self.token.add_usage()  # the record exists before the thread counts into it
            watch_unasked(
                self.token,
                lambda: self._length is not None,
                after=STILL_RUNNING_AFTER,
                what="a transformers generate()",
                criterion="its CancelCriteria",
            )

    def stop(self) -> None:
        """Stop the generation at its next token, whatever the request does."""
        self._asked_to_stop = True

    @property
    def should_stop(self) -> bool:
        """Whether the generation should stop now (the request should, or `stop()` was called)."""
        token = self.token
        return self._asked_to_stop or (token is not None and token.should_stop)

    def __call__(self, input_ids: Any, scores: Any = None, **kwargs: Any) -> Any:
        rows, length = input_ids.shape[0], input_ids.shape[-1]
        token = self.token
        if token is not None:
            computed = self.rows or rows
            if self._length is None:  # the first call: the prompt and the first new token
                token.add_usage(prompt_tokens=computed * (length - 1), completion_tokens=computed)
            elif length > self._length:
                token.add_usage(completion_tokens=computed * (length - self._length))
        self._length = length
        stop = self.should_stop
        if stop and not self.stopped:
            self.stopped = True
            self.stopped_at = monotonic()
        # A bool per row, on the ids' device: what `StoppingCriteriaList` ORs together.
        return input_ids.new_full((rows,), int(stop)).bool()


def generate_in_thread(
    generate: Callable[..., _ResultT],
    /,
    *args: Any,
    token: CancelToken | None = None,
    join_timeout: float = 5.0,
    rows: int | None = None,
    **kwargs: Any,
) -> Generation[_ResultT]:
    """Start `generate(*args, **kwargs)` in a thread, stopped by the request's token.

    The `TextIteratorStreamer` pattern, made safe: pass the streamer as `streamer=` and iterate
    the returned `Generation` instead of the streamer. A `CancelCriteria` made here, in the
    request's context, is added to `stopping_criteria`, so the generation stops within one
    token once the request should stop; the reading loop ends at once, and a generation that
    raises ends it with the exception (a bare streamer would wait for text forever).

    ```python
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    generation = generate_in_thread(model.generate, **inputs, streamer=streamer, max_new_tokens=400)
    return StreamingResponse(generation, media_type="text/plain")
    ```

    Args:
        generate: `model.generate`, or any callable that takes `stopping_criteria=`.
        *args: passed on to `generate`.
        token: the request's token; by default `current_token()` of the caller's context.
        join_timeout: seconds the reader waits for the thread once reading ends.
        rows: the rows `generate` computes per token, for the usage count (`CancelCriteria`'s
            `rows`). None: the batch times `num_beams` for a beam search given `num_beams=`
            and `input_ids=` here, else the rows `generate` asks its criteria about.
        **kwargs: passed on to `generate` (`streamer=`, `max_new_tokens=`, ...); a
            `stopping_criteria` list given here is extended, not replaced.

    Returns:
        The started `Generation`.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
        ValueError: `join_timeout` is not a finite number of seconds >= 0, or `rows` is
            neither None nor an int > 0.
    """
    join_timeout = seconds("join_timeout", join_timeout)
    criteria = CancelCriteria(token, rows=_beam_rows(kwargs) if rows is None else rows)
    given = kwargs.get("stopping_criteria")
    # A `StoppingCriteriaList` stays one (a copy: the caller's list is left as it was).
    kwargs["stopping_criteria"] = [criteria] if given is None else type(given)([*given, criteria])
    generation = Generation(generate, args, kwargs, criteria=criteria, join_timeout=join_timeout)
    generation.thread.start()
    return generation


def _beam_rows(kwargs: dict[str, Any]) -> int | None:
    """The rows a beam search computes per token (batch size times `num_beams`), when the
    call's own arguments say so: it asks its criteria about more candidates than that."""
    beams, ids = kwargs.get("num_beams"), kwargs.get("input_ids")
    shape = getattr(ids, "shape", None)
    if isinstance(beams, int) and not isinstance(beams, bool) and beams > 1 and shape:
        return int(shape[0]) * beams
    return None
