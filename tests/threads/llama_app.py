"""A FastAPI app that runs llama-cpp-python in a worker thread, one generation at a time, for
tests/threads/test_llama_cpp.py under uvicorn. `ASGI_CANCEL_LLAMA_MODEL` is the GGUF file,
`ASGI_CANCEL_LLAMA_MODE` is `alone` (no asgi-cancel), `middleware` (the app task is cancelled,
the thread is not) or `adapter` (with `asgi_cancel.llama_cpp`).

`POST /v1/completions` takes a `Completion`; its `thread` says how the generation reaches its
worker thread (`in_thread`): `to_thread` copies the context (the criteria are made in the
thread), `thread` and `executor` do not (the token is handed over), `ignore` makes the
criteria and never passes them. `POST /v1/completions/sync` is a FastAPI `def` endpoint. `GET
/probe`: the engine's side (`llama_probe`) and the cancel reports' usage.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import llama_cpp
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel

import asgi_cancel.llama_cpp
from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    CancelToken,
    cancel_endpoint,
    current_token,
)
from asgi_cancel.llama_cpp import logits_processor, stopping_criteria, stream
from asgi_cancel.types import CancelledRequest

from . import llama_probe

MODE = os.environ.get("ASGI_CANCEL_LLAMA_MODE", "adapter")
if MODE not in ("alone", "middleware", "adapter"):
    raise ValueError(f"ASGI_CANCEL_LLAMA_MODE must be alone, middleware or adapter, got {MODE!r}")
ADAPTER = MODE == "adapter"
# The tests wait this long for the warning about a thread that ignores the token.
asgi_cancel.llama_cpp.STILL_RUNNING_AFTER = 0.5

llama_probe.install()
LLM = llama_cpp.Llama(
    model_path=os.environ["ASGI_CANCEL_LLAMA_MODEL"],
    n_ctx=4096,
    n_threads=1,
    n_batch=512,
    seed=0,
    verbose=False,
)
LOCK = threading.Lock()  # a Llama is not thread-safe: one generation at a time
CANCELLED: list[dict[str, Any]] = []  # the cancel reports: path, usage, when the request ended


class Completion(BaseModel):
    prompt: str = "hello"
    max_tokens: int = 16
    stream: bool = False
    chat: bool = False
    thread: str = "to_thread"


def generate(body: Completion, token: CancelToken | None, stream_: bool) -> Any:
    """The call a worker thread makes (under the lock); with the adapter, the criteria bound
    to `token`, or to the current request when the thread copied its context."""
    common: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": stream_, "temperature": 0.0}
    passed: list[Any] | None = None
    if body.chat:
        # create_chat_completion takes no stopping_criteria: the processor instead.
        if ADAPTER:
            passed = logits_processor(LLM, token=token)
        messages = [{"role": "user", "content": body.prompt}]
        result = LLM.create_chat_completion(messages=messages, logits_processor=passed, **common)
    else:
        if ADAPTER:
            made = stopping_criteria(token=token)
            passed = None if body.thread == "ignore" else made
        result = LLM.create_completion(body.prompt, stopping_criteria=passed, **common)
    if stream_ and passed is not None:
        return stream(result, token=token or current_token(), criteria=passed)
    return result


def in_thread(body: Completion, work: Callable[[CancelToken | None], Any]) -> asyncio.Future[Any]:
    """Run `work(token)` in a worker thread the way `body.thread` says."""
    token = current_token() if ADAPTER and body.thread != "to_thread" else None
    if body.thread == "to_thread":
        return asyncio.ensure_future(asyncio.to_thread(work, None))
    loop = asyncio.get_running_loop()
    if body.thread == "executor":
        return loop.run_in_executor(None, work, token)
    # A loop future the thread settles, not `asyncio.wrap_future`: the middleware recognises a
    # future chained to a worker thread and waits for it, and this path is the one it cannot see.
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result, error = work(token), None
        except BaseException as exc:
            result, error = None, exc
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, daemon=True).start()
    return future


app = FastAPI()


@app.get("/hello")
async def hello() -> PlainTextResponse:
    return PlainTextResponse("hello")


@app.get("/probe")
async def probe() -> dict[str, Any]:
    counts = ("prompt_tokens", "completion_tokens", "after_cancel")  # of its TokenUsage
    cancelled = [
        {"path": report["path"], "finished_at": report["finished_at"]}
        | {name: getattr(report["usage"], name) for name in counts}
        for report in CANCELLED
    ]
    return {"generations": llama_probe.generations(), "cancelled": cancelled}


@app.post("/v1/completions", response_model=None)
async def completions(body: Completion) -> StreamingResponse | dict[str, Any]:
    if not body.stream:

        def complete(token: CancelToken | None) -> Any:
            with LOCK:
                return generate(body, token, False)

        result: dict[str, Any] = await in_thread(body, complete)
        return result

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()  # unbounded: the thread never blocks

    def produce(token: CancelToken | None) -> None:
        try:
            with LOCK:
                for chunk in generate(body, token, True):
                    loop.call_soon_threadsafe(
                        queue.put_nowait, b"data: %s\n\n" % json.dumps(chunk).encode()
                    )
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    producer = in_thread(body, produce)

    async def events() -> AsyncIterator[bytes]:
        while (event := await queue.get()) is not None:
            yield event
        await producer
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/v1/completions/sync")
def completions_sync(body: Completion) -> dict[str, Any]:
    # A `def` endpoint: Starlette's thread pool copied the request's context into this thread.
    with LOCK:
        result: dict[str, Any] = generate(body, None, False)
        return result


def record(request: CancelledRequest) -> Callable[[], None]:
    report = {"path": request.scope["path"], "usage": request.usage, "finished_at": None}
    CANCELLED.append(report)

    def finished() -> None:  # called once the request is over
        report["finished_at"] = time.monotonic()

    return finished


REGISTRY = CancelRegistry()
app.mount("/v1/requests", cancel_endpoint(REGISTRY, authorize=None))  # 127.0.0.1 only
middleware = CancelOnDisconnectMiddleware(
    app, on_cancelled=record, timeout_header="x-request-timeout", registry=REGISTRY
)
asgi: Any = app if MODE == "alone" else middleware
