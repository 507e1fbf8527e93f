"""A FastAPI app that runs transformers' `generate()` in worker threads, under uvicorn.

Each documented pattern (the routes of `add_routes`: a `threading.Thread` with a streamer, from
a sync or an async endpoint; Starlette's threadpool; `asyncio.to_thread`; `run_in_executor`) at
`/bare/<route>` (no asgi-cancel), `/middleware/<route>` (the middleware alone: the app task is
cancelled, the thread is not) and `/mw/<route>` (with `asgi_cancel.transformers`). One
generation at a time (a lock, as a single-model server has), so a request queues behind one
whose client left. `Engine` counts from the engine's side: every stopping-criteria call (one
per token) and streamer `put`, timestamped, per request id.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, cancel_endpoint, current_token
from asgi_cancel.transformers import CancelCriteria, generate_in_thread
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from ..vllm._harness import free_port, watch

# transformers has no type hints mypy can read here (and is not the main venv's).
transformers: Any = importlib.import_module("transformers")

ROUTES = (
    "stream-thread",
    "stream-async",
    "generate-sync",
    "generate-to-thread",
    "generate-executor",
)


class Engine:
    """The model, a one-generation lock, and what the engine did, per request id."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: Any = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        self.lock = threading.Lock()
        self.steps: dict[str, list[float]] = defaultdict(list)  # criteria calls: one per token
        self.puts: dict[str, int] = defaultdict(int)  # streamer puts (the prompt's first)
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.fired: dict[str, float] = {}
        self.usage: dict[str, tuple[int, int, int]] = {}

    def inputs(self, prompt: str) -> Any:
        return self.tokenizer([prompt], return_tensors="pt")

    def generate(self, request_id: str, **kwargs: Any) -> Any:
        """`model.generate(**kwargs)` under the lock, with a probe among its criteria."""
        steps = self.steps[request_id]

        def probe(input_ids: Any, scores: Any, **_: Any) -> Any:
            steps.append(time.monotonic())
            return input_ids.new_zeros((input_ids.shape[0],)).bool()

        given = kwargs.pop("stopping_criteria", None) or []
        with self.lock:
            self.started[request_id] = time.monotonic()
            self.prompt_tokens[request_id] = int(kwargs["input_ids"].shape[-1])
            try:
                return self.model.generate(
                    **kwargs,
                    stopping_criteria=transformers.StoppingCriteriaList([*given, probe]),
                    do_sample=False,
                    min_new_tokens=kwargs["max_new_tokens"],  # no early EOS
                )
            finally:
                self.ended[request_id] = time.monotonic()

    def streamer(self, request_id: str) -> Any:
        engine = self

        class Counting(transformers.TextIteratorStreamer):  # type: ignore[misc]
            def put(self, value: Any) -> None:
                engine.puts[request_id] += 1
                super().put(value)

        return Counting(self.tokenizer, skip_prompt=True)

    def tokens_after(self, request_id: str, moment: float) -> int:
        return sum(1 for at in list(self.steps[request_id]) if at > moment)


def build_app(engine: Engine) -> ASGIApp:
    """`/{bare,middleware,mw}/<route>`; POST a JSON body `{"id", "prompt", "max_new_tokens"}`."""
    api = FastAPI()

    def add_routes(prefix: str, adapter: bool) -> None:
        def arguments(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            if prefix != "/bare":
                watch(current_token(), body["id"], engine.fired, engine.usage)
            inputs = {**engine.inputs(body["prompt"]), "max_new_tokens": body["max_new_tokens"]}
            return body["id"], inputs

        def criteria() -> dict[str, Any]:
            return {"stopping_criteria": [CancelCriteria()]} if adapter else {}

        @api.post(f"{prefix}/stream-thread")
        def stream_thread(body: dict[str, Any]) -> StreamingResponse:
            request_id, kwargs = arguments(body)
            streamer = engine.streamer(request_id)
            if adapter:
                generation = generate_in_thread(
                    engine.generate, request_id, streamer=streamer, **kwargs
                )
                return StreamingResponse(generation, media_type="text/plain")
            kwargs["streamer"] = streamer
            threading.Thread(target=engine.generate, args=(request_id,), kwargs=kwargs).start()
            return StreamingResponse(streamer, media_type="text/plain")

        @api.post(f"{prefix}/stream-async")
        async def stream_async(body: dict[str, Any]) -> StreamingResponse:
            return stream_thread(body)  # made in the request's task: its context, its token

        @api.post(f"{prefix}/generate-sync")
        def generate_sync(body: dict[str, Any]) -> dict[str, int]:
            request_id, kwargs = arguments(body)
            output = engine.generate(request_id, **kwargs, **criteria())
            return {"tokens": int(output.shape[-1])}

        @api.post(f"{prefix}/generate-to-thread")
        async def generate_to_thread(body: dict[str, Any]) -> dict[str, int]:
            request_id, kwargs = arguments(body)
            output = await asyncio.to_thread(engine.generate, request_id, **kwargs, **criteria())
            return {"tokens": int(output.shape[-1])}

        @api.post(f"{prefix}/generate-executor")
        async def generate_executor(body: dict[str, Any]) -> dict[str, int]:
            request_id, kwargs = arguments(body)
            # run_in_executor does not copy the context: the criteria is made here, in it.
            call = functools.partial(engine.generate, request_id, **kwargs, **criteria())
            output = await asyncio.get_running_loop().run_in_executor(None, call)
            return {"tokens": int(output.shape[-1])}

    add_routes("/bare", adapter=False)
    add_routes("/middleware", adapter=False)
    add_routes("/mw", adapter=True)
    registry = CancelRegistry()
    api.mount("/v1/requests", cancel_endpoint(registry, authorize=None))  # 127.0.0.1 only
    wrapped = CancelOnDisconnectMiddleware(
        api, registry=registry, timeout_header="x-request-timeout"
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        chosen = api if scope.get("path", "").startswith("/bare/") else wrapped
        await chosen(scope, receive, send)

    return app


class Server:
    """uvicorn serving `build_app(engine)` on 127.0.0.1, in a thread of this process (so that
    the tests read the engine's counts directly)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.port = free_port()
        config = uvicorn.Config(
            build_app(engine), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("uvicorn did not start within 30 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
