"""The OpenAI-compatible FastAPI app, wrapped in `CancelOnDisconnectMiddleware`.

The endpoints hold no cancellation logic beyond `engine_request` (which enters
`asgi_cancel.vllm.abort_on_cancel`): when the client goes, the middleware fires the request's
token, the engine request is aborted by id at once, and the handler task is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager

from fastapi import APIRouter, FastAPI
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from . import metrics
from .cancelling import CancelOptions
from .departures import DepartureRecorder, engine_request
from .engine import Engine, EngineRequestError, RequestOutput
from .json_body import JSONBodyRoute
from .openai_errors import (
    ErrorResponse,
    OpenAIError,
    aborted,
    as_openai_error,
    from_engine_error,
    model_not_found,
    shutting_down,
    validation_handlers,
)
from .openai_request import ChatCompletionRequest, CompletionRequest, max_tokens
from .openai_response import (
    DONE,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    Responder,
    sse,
)

logger = logging.getLogger("example_app")


class Shutdown:
    """How the server tells the app it is stopping, before it waits for requests in flight.

    `begin()` is safe from a signal handler or another thread: the app then aborts its engine
    requests, ends each stream with an error event (a 503 status before the headers) and logs
    one line per request, so the server's graceful shutdown finds nothing left to cut.
    """

    def __init__(self) -> None:
        self._handler: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _attach(self, handler: Callable[[], None]) -> None:
        self._handler, self._loop = handler, asyncio.get_running_loop()

    def begin(self) -> None:
        if self._handler is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._handler)


def create_app(
    engine: Engine,
    *,
    model_name: str,
    cancel: CancelOptions | None,
    shutdown: Shutdown | None = None,
) -> ASGIApp:
    """The ASGI app: OpenAI routes over `engine`, with or without the middleware.

    Args:
        engine: the engine to serve (started and stopped by the app's lifespan).
        model_name: the one model name clients must send (`/v1/models` lists it).
        cancel: run under `CancelOnDisconnectMiddleware` with these options. None (the
            demo's baseline): a `DepartureRecorder` only notes when clients leave.
        shutdown: the server calls its `begin()` when it starts stopping.
    """
    server = _Server(engine, model_name, middleware=cancel is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        if shutdown is not None:
            shutdown._attach(server.begin_shutdown)
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="asgi-cancel example_app",
        lifespan=lifespan,
        exception_handlers=validation_handlers((model_name,)),
        responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
    )
    # OpenAI reads the body itself (any content type, 1 MiB at most, strict JSON).
    generation = APIRouter(route_class=JSONBodyRoute)
    generation.post("/v1/completions", response_model=CompletionResponse)(server.completions)
    generation.post("/v1/chat/completions", response_model=ChatCompletionResponse)(
        server.chat_completions
    )
    app.include_router(generation)
    app.get("/v1/models", response_model=ModelList)(server.models)
    app.get("/v1/models/{model:path}", response_model=ModelCard)(server.model)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    if cancel is None:
        return DepartureRecorder(app)
    return cancel.wrap(app, on_cancelled=server.exposition.on_cancelled)


class _Server:
    def __init__(self, engine: Engine, model_name: str, *, middleware: bool) -> None:
        self.engine = engine
        self.model_name = model_name
        self.middleware = middleware
        self.exposition = metrics.Metrics(engine, middleware=middleware)
        self.started = int(time.time())
        self.in_flight: set[str] = set()
        self.shutting_down = False
        self._aborting: asyncio.Task[None] | None = None

    def begin_shutdown(self) -> None:
        """Abort every engine request in flight; each ends with a shutdown error."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self.in_flight:
            self._aborting = asyncio.create_task(self.engine.abort(list(self.in_flight)))

    @contextmanager
    def _tracked(self, request_id: str) -> Iterator[None]:
        if self.shutting_down:
            raise self._abort_error(request_id, 0)
        self.in_flight.add(request_id)
        try:
            yield
        finally:
            self.in_flight.discard(request_id)

    def _abort_error(self, request_id: str, tokens: int) -> OpenAIError:
        if not self.shutting_down:
            return aborted()
        logger.warning(
            "%s: ended by the server's shutdown after %d tokens (503 server_shutting_down)",
            request_id,
            tokens,
        )
        return shutting_down()

    async def completions(self, body: CompletionRequest) -> Response:
        return await self._generate(body)

    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        return await self._generate(body)

    async def models(self) -> ModelList:
        return ModelList(data=[self._model_card()])

    async def model(self, model: str) -> ModelCard:
        if model != self.model_name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return self._model_card()

    def _model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name, created=self.started, max_model_len=self.engine.max_model_len
        )

    async def health(self) -> dict[str, object]:
        return {"status": "ok", "engine": self.engine.name, "middleware": self.middleware}

    async def metrics(self) -> Response:
        return Response(self.exposition.render(), media_type=metrics.CONTENT_TYPE)

    async def _generate(self, request: CompletionRequest | ChatCompletionRequest) -> Response:
        if request.model != self.model_name:
            raise model_not_found(request.model)
        prompt = request.render()
        engine = self.engine
        budget = max_tokens(request, prompt, engine.max_model_len, engine.count_prompt_tokens)
        chat = isinstance(request, ChatCompletionRequest)
        responder = Responder(
            request, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        )
        try:
            params = engine.sampling_params(request.sampling(budget))
        except EngineRequestError as error:
            raise from_engine_error(error) from None
        if request.stream:
            return await self._stream(prompt, request.include_usage, params, responder)
        return await self._complete(prompt, params, responder)

    async def _complete(self, prompt: str, params: object, responder: Responder) -> Response:
        request_id = responder.response_id
        final: RequestOutput | None = None
        try:
            with self._tracked(request_id):
                async with (
                    engine_request(self.engine, request_id),
                    aclosing(self.engine.generate(prompt, params, request_id)) as outputs,
                ):
                    async for output in outputs:
                        final = output
        except EngineRequestError as error:
            raise from_engine_error(error) from None
        if final is None or final.outputs[0].finish_reason == "abort":
            tokens = 0 if final is None else len(final.outputs[0].token_ids)
            raise self._abort_error(request_id, tokens)
        completion = final.outputs[0]
        body = responder.whole(
            completion.text,
            completion.finish_reason,
            len(final.prompt_token_ids),
            len(completion.token_ids),
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(
        self, prompt: str, include_usage: bool, params: object, responder: Responder
    ) -> Response:
        events = self._events(prompt, include_usage, params, responder)
        # Headers wait for the first output, so an engine error is still an HTTP status, as
        # with OpenAI. (This queue-and-prefill window is also one that Starlette's own
        # StreamingResponse disconnect listener, which starts with the response, cannot see.)
        first = await anext(events)
        return EventStreamResponse(first, events)

    async def _events(
        self, prompt: str, include_usage: bool, params: object, responder: Responder
    ) -> AsyncGenerator[bytes, None]:
        request_id = responder.response_id
        sent = 0
        first = True
        final: RequestOutput | None = None
        with self._tracked(request_id):
            async with (
                engine_request(self.engine, request_id),
                aclosing(self.engine.generate(prompt, params, request_id)) as outputs,
            ):
                try:
                    async for final in outputs:
                        completion = final.outputs[0]
                        if completion.finish_reason == "abort":
                            raise self._abort_error(request_id, len(completion.token_ids))
                        delta, sent = completion.text[sent:], len(completion.text)
                        yield responder.chunks(delta, completion.finish_reason, first=first)
                        first = False
                except Exception as exc:
                    error = as_openai_error(exc)
                    if first:
                        raise error from None  # before the headers: an HTTP error status
                    yield sse(error.response_body())  # after them: an error event, as OpenAI sends
                    return
        if include_usage and final is not None:
            tokens = len(final.outputs[0].token_ids)
            yield responder.usage_chunk(len(final.prompt_token_ids), tokens)
        yield DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response whose events are always closed, so the engine request is always ended.

    Starlette stops iterating when the client leaves (below ASGI spec 2.4) or on cancellation,
    which can leave `events` suspended; closing it runs its cleanup (engine abort) at once.
    """

    def __init__(self, first: bytes, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events
        super().__init__(
            self._chain(first, events),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    @staticmethod
    async def _chain(first: bytes, events: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
        yield first
        async for event in events:
            yield event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
