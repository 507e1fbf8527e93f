"""Stop a llama-cpp-python generation in a worker thread when its request stops.

Cancelling the asyncio task that awaits `asyncio.to_thread(llm.create_completion, ...)` cannot
stop the thread: llama.cpp keeps generating to `max_tokens` after the client left, holding the
model. What the thread can do is look at the request's `CancelToken` between tokens, and
llama-cpp-python asks its `stopping_criteria` after every token. `stopping_criteria()` is that
look: a criterion bound to the request's token, which stops the generation within a token of
the request's stop (the client left, a cancel by id, a deadline), streaming or not;
`logits_processor()` does the same for `create_chat_completion`, which takes no criteria.
`stream()` ends a streamed iterator at once for the thread that consumes it; `server_app()` is
llama-cpp-python's OpenAI server with all of it.

Take both in the request's context (the endpoint, or code that copied its context:
`asyncio.to_thread`, Starlette's `run_in_threadpool`, FastAPI `def` endpoints) and hand them to
the thread: a `threading.Thread` does not carry context variables, so inside one there is no
current token; pass `token=` then.

Nothing here imports llama_cpp until a list is made (`stopping_criteria()`,
`logits_processor()`, `server_app()`): `CancelCriterion` is a plain callable
`(input_ids, logits) -> bool`, as `llama_cpp.StoppingCriteriaList` holds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TYPE_CHECKING, Any, TypeVar

from ._llama_server import server_app as server_app
from ._threads import request_token, watch_unasked
from ._token import CancelToken

if TYPE_CHECKING:
    from llama_cpp import LogitsProcessorList, StoppingCriteriaList

__all__ = [
    "STILL_RUNNING_AFTER",
    "CancelCriterion",
    "CancelLogitsProcessor",
    "logits_processor",
    "server_app",
    "stopping_criteria",
    "stream",
]

#: Seconds after a request's cancellation at which a generation that has never asked its
#: criterion (not passed to the call, or its thread blocked or still waiting for the model) is
#: logged at WARNING. Read when the criterion is made.
STILL_RUNNING_AFTER = 2.0

# How far above the best other token a stopping `CancelLogitsProcessor` puts end-of-sequence.
_EOS_LEAD = 1e4

_ChunkT = TypeVar("_ChunkT")


def _missing(error: ImportError, install: str = "'asgi-cancel[llama-cpp]'") -> ImportError:
    return ImportError(
        f"asgi_cancel.llama_cpp needs packages that are not installed ({error.name} is "
        f"missing): pip install {install}"
    )


def _request_token(token: CancelToken | None, what: str) -> CancelToken | None:
    hint = "in a threading.Thread or run_in_executor, take current_token() in the request and "
    return request_token(token, what, hint + "pass token=")


class CancelCriterion:
    """A llama-cpp-python stopping criterion: True once the request should stop.

    Called by llama.cpp after each token it generates, in the generating thread, it reads the
    request's token (`token.should_stop`: fired, and neither in `shield()` nor `detach()`ed)
    and counts the tokens into `token.usage` (`TokenUsage`: prompt, completion, and
    completion tokens after the cancellation began), which the cancel report, the log and
    `CancelMetrics` show, as `asgi_cancel.vllm` does for vLLM.

    A generation that ends on its own (end of sequence, `max_tokens`, a stop string) is never
    marked stopped: llama-cpp-python asks its criteria once more after the last token, and
    that closing call gets the criterion's last answer, not a new one. One criterion per
    generation: make a new one for each `create_completion` call.

    One that llama.cpp never asks (not passed to the call, or its thread blocked or still
    waiting for the model) cannot stop its generation: `STILL_RUNNING_AFTER` seconds after the
    request's cancellation, a WARNING says so (a timer thread: nothing waits for it). One that
    was asked is never reported: its generation stops at its next token, or had ended.

    Without a token (made outside a request and no `token=`), it warns (`RuntimeWarning`, at
    the line that made it) and never stops anything; it still counts (`generated`).

    Args:
        token: the request's token; by default the current one (`current_token()`), which
            only code in the request's context sees.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
    """

    __slots__ = ("_closed", "_last_length", "generated", "prompt_tokens", "stopped", "token")

    def __init__(self, token: CancelToken | None = None) -> None:
        self.token = _request_token(token, "CancelCriterion()")
        #: Tokens generated so far (one per call of llama.cpp's, the closing call excepted).
        self.generated = 0
        #: The prompt's length in tokens, once the first token is generated.
        self.prompt_tokens: int | None = None
        #: Whether the criterion stopped the generation.
        self.stopped = False
        self._last_length: int | None = None
        self._closed = False
        if self.token is not None:
            # Made here, in the request's thread: counts from the worker land in one record.
            self.token.add_usage()
            watch_unasked(
                self.token,
                self._asked,
                after=STILL_RUNNING_AFTER,
                what="a llama.cpp generation",
                criterion="its stopping criteria or logits processor",
            )

    def __call__(self, input_ids: Sized, logits: object) -> bool:
        length = len(input_ids)
        last = self._last_length
        if last is not None and length != last + 1:
            # llama-cpp-python's closing call after the loop: the ids evaluated, the same as at
            # the last token's call, or more with a draft model (speculative decoding), where
            # each token's call has exactly one more (one drafted token left over looks like
            # a token's call: docs/threads.md). The generation is over; this answer decides
            # finish_reason, so it stays the last.
            self._closed = True
            return self.stopped
        return self._step(length)

    def _step(self, length: int) -> bool:
        """One token generated after `length` tokens evaluated: whether to stop now."""
        if self._last_length is None:
            self.prompt_tokens = length
        self._last_length = length
        self.generated += 1
        token = self.token
        if token is None:
            return False
        if self.generated == 1:
            token.add_usage(prompt_tokens=length, completion_tokens=1)
        else:
            token.add_usage(completion_tokens=1)
        if token.should_stop:
            self.stopped = True
        return self.stopped

    def _asked(self) -> bool:
        # Whether the generation ever reached the criterion (or was closed before it could):
        # llama.cpp asks at every token, so from then on it stops at its next one. Whether it
        # ended is not known in general: a logits processor gets no closing call, and a stream
        # closed by its caller none either.
        return self.generated > 0 or self._closed

    def close(self) -> None:
        """Mark the generation over without llama's closing call (a stream closed early)."""
        self._closed = True

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "closed" if self._closed else "made"
        return f"<{type(self).__name__} {state} generated={self.generated}>"


class CancelLogitsProcessor(CancelCriterion):
    """A llama-cpp-python logits processor that ends the generation when its request stops.

    For `Llama.create_chat_completion`, which takes `logits_processor=` but no
    `stopping_criteria=` (llama-cpp-python 0.3.36); it works for `create_completion` too.
    Called before each token is sampled, it counts as `CancelCriterion` does. Once the request
    should stop, it puts end-of-sequence above every other token, so the generation ends at
    that token, `finish_reason="stop"`.

    Unless a grammar forbids end-of-sequence there (`grammar=`, a JSON `response_format`,
    tools: an object not closed yet). llama-cpp-python applies the grammar after its logits
    processors, so the others keep their order and the grammar picks one of its tokens as it
    would have; leaving it no token of its own aborted the whole process inside llama.cpp.
    Given `llm`, the processor also replaces that generation's sampler (llama-cpp-python's
    private `Llama._sampler`, tested with 0.3.36) by one that picks end-of-sequence, without
    the grammar: the generation ends at the next token. Without `llm`, it ends where the
    grammar first allows it to.

    Args:
        eos_token: the model's end-of-sequence token (`llm.token_eos()`).
        token: the request's token; by default the current one.
        llm: the `llama_cpp.Llama` that generates (`logits_processor()` passes it).

    Raises:
        TypeError: `eos_token` is not an integer, or `token` neither a `CancelToken` nor None.
        ValueError: `eos_token` is negative.
    """

    __slots__ = ("eos_token", "llm")

    def __init__(
        self, eos_token: int, token: CancelToken | None = None, *, llm: Any = None
    ) -> None:
        eos = operator.index(eos_token)  # TypeError for what is not an integer
        if eos < 0:
            raise ValueError(f"eos_token must be a token id >= 0, got {eos_token!r}")
        super().__init__(token)
        self.eos_token = eos
        self.llm = llm

    def __call__(self, input_ids: Sized, scores: Any) -> Any:
        if self._step(len(input_ids)):
            # Above the others by far more than any two logits differ: sampled whatever the
            # temperature, unless a grammar removes it.
            scores[self.eos_token] = scores.max() + _EOS_LEAD
            if self.llm is not None:
                self._end_at_next_token(self.llm)
        return scores

    def _end_at_next_token(self, llm: Any) -> None:
        # The processor runs inside the sampler it replaces: llama-cpp-python holds that one
        # until this token is sampled, then asks `llm._sampler` for the next one. The new one
        # has no processor, so this is done once per generation; the next call makes its own.
        from llama_cpp._internals import LlamaSampler

        ending = LlamaSampler()
        ending.add_logit_bias(llm.n_vocab(), {self.eos_token: float("inf")})
        ending.add_greedy()
        llm._sampler = ending


def stopping_criteria(
    *criteria: Callable[..., bool], token: CancelToken | None = None
) -> StoppingCriteriaList:
    """A `llama_cpp.StoppingCriteriaList` that stops the generation when its request stops.

    Pass it as `stopping_criteria=` to `Llama.create_completion` or `Llama.__call__`,
    streaming or not (`create_chat_completion` takes `logits_processor()` instead). Call it
    in the request's context and hand the list to the thread (see the module's docs); one
    list per call.

    Args:
        *criteria: the request's own criteria, kept in the list before the cancel criterion.
        token: the request's token; by default the current one.

    Returns:
        A `llama_cpp.StoppingCriteriaList`; its last item is the `CancelCriterion`.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
        ImportError: llama-cpp-python is not installed.
    """
    try:
        from llama_cpp import StoppingCriteriaList
    except ImportError as error:
        raise _missing(error) from error
    made: StoppingCriteriaList = StoppingCriteriaList([*criteria, CancelCriterion(token)])
    return made


def logits_processor(
    llm: Any, *processors: Callable[..., Any], token: CancelToken | None = None
) -> LogitsProcessorList:
    """A `llama_cpp.LogitsProcessorList` that ends the generation when its request stops.

    Pass it as `logits_processor=` to `Llama.create_chat_completion` (which has no
    `stopping_criteria=`), streaming or not; `create_completion` takes it too. Call it in the
    request's context and hand the list to the thread; one list per call.

    Args:
        llm: the `llama_cpp.Llama` that generates (for its end-of-sequence token, and its
            sampler when a grammar forbids that token at the cancel).
        *processors: the request's own processors, kept before the cancel processor (one that
            forbids end-of-sequence, `min_tokens`, is overridden once the request stops).
        token: the request's token; by default the current one.

    Returns:
        A `llama_cpp.LogitsProcessorList`; its last item is the `CancelLogitsProcessor`.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
        ImportError: llama-cpp-python is not installed.
    """
    try:
        from llama_cpp import LogitsProcessorList
    except ImportError as error:
        raise _missing(error) from error
    processor = CancelLogitsProcessor(int(llm.token_eos()), token, llm=llm)
    made: LogitsProcessorList = LogitsProcessorList([*processors, processor])
    return made


def _cancel_criterion(criteria: Iterable[object]) -> CancelCriterion | None:
    for criterion in criteria:
        if isinstance(criterion, CancelCriterion):
            return criterion
    return None


def stream(
    chunks: Iterable[_ChunkT],
    *,
    token: CancelToken | None = None,
    criteria: Iterable[object] = (),
) -> Iterator[_ChunkT]:
    """`chunks` (a streamed `create_completion`), ending at once when the request stops.

    For the thread that iterates the stream: once the request should stop, the next step
    closes the underlying generator (llama.cpp stops at the token in progress) and ends,
    without the final chunk, instead of handing on what the criterion lets through. Take it
    in the request's context, like `stopping_criteria()`.

    Args:
        chunks: what `create_completion(..., stream=True)` returned.
        token: the request's token; by default the current one.
        criteria: the list from `stopping_criteria()` given to the same call: its criterion
            is told when the stream ends early, so that a generation closed here before its
            first token is not reported as one that never asked it.

    Raises:
        TypeError: `token` is neither a `CancelToken` nor None.
    """
    return _Stream(iter(chunks), _request_token(token, "stream()"), _cancel_criterion(criteria))


class _Stream(Iterator[_ChunkT]):
    """A class, not a generator function: the token is taken when it is made (in the
    request's context), not at the first `next()` (in the thread)."""

    __slots__ = ("_chunks", "_criterion", "_token")

    def __init__(
        self,
        chunks: Iterator[_ChunkT],
        token: CancelToken | None,
        criterion: CancelCriterion | None,
    ) -> None:
        self._chunks = chunks
        self._token = token
        self._criterion = criterion

    def __next__(self) -> _ChunkT:
        if self._token is not None and self._token.should_stop:
            self.close()
            raise StopIteration
        return next(self._chunks)

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
        if self._criterion is not None:
            self._criterion.close()
