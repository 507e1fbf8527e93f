"""Turn a request's cancellation into vLLM engine aborts: `abort_on_cancel` and `generate`.

Cancelling the task that iterates `AsyncLLM.generate()` already aborts that one request. This
adapter covers what a task cancellation does not reach: generators iterated in other tasks
(merged prompts, background producers), requests still queued in the scheduler, and handlers
run under vLLM's `with_cancellation`, whose inner task can outlive its wrapper. It aborts by
request id the moment the client disconnects, from the disconnect itself.

`OpenAIRequestIds` makes the ids vLLM's OpenAI server shows its clients (`chatcmpl-...`,
`cmpl-...`, `resp_...`, its `X-Request-Id`) cancel their requests by id.

Nothing here imports vLLM: an engine is anything with `generate` and `abort` (`EngineClient`),
so `vllm.v1.engine.async_llm.AsyncLLM`, vLLM's `EngineClient` and test doubles all fit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from ._openai_ids import OpenAIRequestIds as OpenAIRequestIds
from ._token import CancelToken, find_token

__all__ = ["EngineClient", "OpenAIRequestIds", "abort_on_cancel", "counted", "generate"]

_OutputT_co = TypeVar("_OutputT_co", covariant=True)


class EngineClient(Protocol[_OutputT_co]):
    """The two methods of a vLLM engine client the adapter uses.

    `vllm.v1.engine.async_llm.AsyncLLM` (also exported as `vllm.AsyncLLMEngine`) and any
    `vllm.engine.protocol.EngineClient` match it.
    """

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, /
    ) -> AsyncIterator[_OutputT_co]:
        """Start a request and iterate its outputs (vLLM: `RequestOutput`)."""
        ...

    def abort(self, request_id: Iterable[str], /) -> Awaitable[None]:
        """Abort requests by the ids given to `generate` (n>1 children included)."""
        ...


@asynccontextmanager
async def abort_on_cancel(
    engine: EngineClient[object], *request_ids: str
) -> AsyncIterator[CancelToken | None]:
    """Abort `request_ids` in `engine` the moment the current request's client disconnects.

    Enter it before the generation starts and leave it when the outputs are consumed. When
    `CancelOnDisconnectMiddleware` sees the disconnect, one `engine.abort([ids...])` starts
    at once, from the disconnect itself, before the app task sees its cancellation; the
    middleware awaits it before the request ends, so it completes even while the surrounding
    task is being cancelled. It reaches generators iterated in any task (n>1, merged prompts,
    background producers) and requests still queued in the scheduler.

    Like every binding, it aborts only when the request should stop (`token.should_stop`):
    inside `shield()` and in a detached request (`detach()`) the engine requests run to the
    end (inside a shield, the app's own cancellation at the block's exit still reaches what
    the app task iterates). On a normal exit nothing is aborted: a finished request is never
    aborted. A block entered
    after the disconnect (inside `shield()`, or during the middleware's grace period) aborts
    its ids when it exits with an exception, since an abort on entry would precede them.

    Outside a request handled by the middleware (no `current_token()`), it does nothing and
    yields None: the same code runs unchanged in scripts and tests, and vLLM's own abort on
    `CancelledError` still applies.

    Args:
        engine: a vLLM `AsyncLLM` or anything with `generate` and `abort` (`EngineClient`).
        *request_ids: the ids passed to `engine.generate`: one per prompt (an n>1 request
            needs only its one id: vLLM aborts its children with it). Use ids unique per
            request: vLLM aborts every running request that shares an id.

    Yields:
        The request's `CancelToken`, or None outside a request.

    Raises:
        TypeError: a request id is not a `str`.
    """
    async with _aborting(engine, request_ids) as (token, _):
        yield token


class _Abort:
    """One `engine.abort(ids)`, run by the token at the disconnect; remembers that it ran."""

    __slots__ = ("done", "engine", "ids")

    def __init__(self, engine: EngineClient[object], ids: list[str]) -> None:
        self.engine = engine
        self.ids = ids
        self.done = False

    async def run(self) -> None:
        try:
            await self.engine.abort(self.ids)
        finally:
            self.done = True


@asynccontextmanager
async def _aborting(
    engine: EngineClient[object], request_ids: tuple[str, ...]
) -> AsyncIterator[tuple[CancelToken | None, _Abort | None]]:
    for request_id in request_ids:
        if not isinstance(request_id, str):
            raise TypeError(f"request ids must be str, got {request_id!r}")
    token = find_token()
    if token is None or not request_ids:
        yield token, None
        return
    abort = _Abort(engine, list(request_ids))
    if token.cancelled:
        # Entered after the disconnect (in a shield, in the grace period): an abort now would
        # precede the request, so abort what the block started if it ends by an exception.
        try:
            yield token, None
        except BaseException:
            token.on_cancel(abort.run)  # runs at once; the middleware awaits it
            raise
        return
    unregister = token.on_cancel(lambda: abort.run() if token.should_stop else None)
    try:
        yield token, abort
    finally:
        unregister()


async def generate(
    engine: EngineClient[_OutputT_co],
    prompt: Any,
    sampling_params: Any,
    request_id: str,
    **kwargs: Any,
) -> AsyncIterator[_OutputT_co]:
    """`engine.generate(...)` inside `abort_on_cancel(engine, request_id)`.

    A drop-in for `engine.generate` in an app behind `CancelOnDisconnectMiddleware`: the
    request is aborted when the client disconnects, whichever task iterates it. After the
    disconnect it also aborts a request that reached the engine too late for the first abort,
    at its first output, so an iteration that nobody cancels still ends at once (with vLLM's
    final output, `finish_reason="abort"`).

    Args:
        engine: a vLLM `AsyncLLM` or anything with `generate` and `abort`.
        prompt: as for `engine.generate`.
        sampling_params: as for `engine.generate` (vLLM `SamplingParams`).
        request_id: as for `engine.generate`: unique per request.
        **kwargs: passed on to `engine.generate` (e.g. `lora_request`, `priority`).

    Yields:
        The engine's outputs, unchanged (counted: `counted()`).
    """
    start: Callable[..., AsyncIterator[_OutputT_co]] = engine.generate
    async with _aborting(engine, (request_id,)) as (token, abort):
        aborted_late = False
        outputs = start(prompt, sampling_params, request_id, **kwargs)
        async for output in counted(outputs, sampling_params):
            if (
                token is not None
                and token.should_stop
                and not aborted_late
                and (abort is None or abort.done)
                and not getattr(output, "finished", False)
            ):
                # Still running although the abort has run (or none was sent): the request
                # reached the engine after it.
                aborted_late = True
                await engine.abort([request_id])
            yield output


async def counted(
    outputs: AsyncIterator[_OutputT_co], sampling_params: Any
) -> AsyncIterator[_OutputT_co]:
    """`outputs` of one `engine.generate()`, unchanged, with their tokens counted into the
    current request's token (`token.usage`: prompt, completion, and completion tokens after
    the cancellation began), for the cancel report, the log and `CancelMetrics`.

    `generate()` counts its outputs this way; with `abort_on_cancel`, iterate
    `counted(engine.generate(...), sampling_params)`. Outside a request it counts nothing.
    vLLM's `RequestOutput` is read duck-typed (`prompt_token_ids`, `outputs[i].token_ids`);
    `sampling_params.output_kind` says whether each output carries the new tokens only
    (`DELTA`, as vLLM's streaming routes ask) or all of them so far.
    """
    token = find_token()
    if token is None:
        async for output in outputs:
            yield output
        return
    kind = getattr(getattr(sampling_params, "output_kind", None), "name", "CUMULATIVE")
    delta = kind == "DELTA"
    counted_so_far = 0
    prompt_counted = False
    async for output in outputs:
        if not prompt_counted:
            prompt_counted = True
            token.add_usage(prompt_tokens=len(getattr(output, "prompt_token_ids", None) or ()))
        choices = getattr(output, "outputs", None) or ()
        tokens = sum(len(getattr(choice, "token_ids", None) or ()) for choice in choices)
        if delta:
            token.add_usage(completion_tokens=tokens)
        elif tokens > counted_so_far:
            token.add_usage(completion_tokens=tokens - counted_so_far)
            counted_so_far = tokens
        yield output
