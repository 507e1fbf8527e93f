"""A real `AsyncLLM` behind a small ASGI app under uvicorn, on one loop in its own thread.

vLLM's `AsyncLLM` binds its output handler to the event loop that first calls `generate`, so
the engine, the app and uvicorn share one loop in one thread for the whole test module; tests
talk to it over real sockets on 127.0.0.1 and read what happened from `Probe`.

`/mw/generate` is the app behind `CancelOnDisconnectMiddleware`; `/bare/generate` is the very
same app without it, for the comparison.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from asgi_cancel import CancelOnDisconnectMiddleware, current_token
from asgi_cancel.types import ASGIApp, Receive, Scope, Send
from asgi_cancel.vllm import abort_on_cancel, generate

from ..helpers import read_body
from ._harness import import_vllm, watch

T = TypeVar("T")

_async_llm = import_vllm("vllm.v1.engine.async_llm")
_arg_utils = import_vllm("vllm.engine.arg_utils")
_sampling = import_vllm("vllm.sampling_params")


@dataclass
class Probe:
    """Everything the engine did, timestamped with `time.monotonic()` (one clock per process).

    It wraps the engine's `abort` (every call, the adapter's and vLLM's own) and the EngineCore
    client's `get_output_async` (every token the EngineCore produced, even for a request the
    front end already dropped, and the scheduler's counts after each step).
    """

    aborts: list[tuple[float, list[str], bool]] = field(default_factory=list)
    outputs: list[tuple[float, str, int]] = field(default_factory=list)
    scheduler: list[tuple[float, int, int]] = field(default_factory=list)
    fired: dict[str, float] = field(default_factory=dict)
    # The prompt tokens of every request sent to the EngineCore, by internal id.
    prompts: dict[str, int] = field(default_factory=dict)
    # What `current_token().usage` said once the request was over (prompt, completion, after).
    usage: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def attach(self, engine: Any) -> None:
        original_abort = engine.abort

        async def abort(request_id: str | Iterable[str], internal: bool = False) -> None:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            self.aborts.append((time.monotonic(), ids, internal))
            await original_abort(ids, internal)

        engine.abort = abort
        core = engine.engine_core
        original_add = core.add_request_async

        async def add_request_async(request: Any) -> None:
            self.prompts[request.request_id] = len(request.prompt_token_ids or ())
            await original_add(request)

        core.add_request_async = add_request_async
        original_get = core.get_output_async

        async def get_output_async() -> Any:
            outputs = await original_get()
            now = time.monotonic()
            for output in outputs.outputs:
                if output.new_token_ids:
                    self.outputs.append((now, output.request_id, len(output.new_token_ids)))
            stats = outputs.scheduler_stats
            if stats is not None:
                self.scheduler.append((now, stats.num_running_reqs, stats.num_waiting_reqs))
            return outputs

        core.get_output_async = get_output_async

    # -- queries (plain reads of lists the loop thread appends to) ------------------------------
    def tokens(self, request_id: str, *, after: float = 0.0) -> int:
        """Tokens the EngineCore generated for `request_id` (its n>1 children too)."""
        return sum(
            count
            for at, internal, count in list(self.outputs)
            if request_id in internal and at > after
        )

    def prompt_tokens(self, request_id: str) -> int:
        """Prompt tokens the EngineCore was given for `request_id`."""
        return sum(count for internal, count in self.prompts.items() if request_id in internal)

    def aborts_of(self, request_id: str) -> list[tuple[float, list[str], bool]]:
        return [entry for entry in list(self.aborts) if any(request_id in i for i in entry[1])]

    def scheduler_idle_at(self, after: float) -> float | None:
        """When the EngineCore first reported no running and no waiting request after `after`."""
        return self.scheduler_at(after, running=0, waiting=0)

    def scheduler_at(self, after: float, *, running: int, waiting: int) -> float | None:
        """When the EngineCore first reported these counts after `after`."""
        for at, now_running, now_waiting in list(self.scheduler):
            if at > after and (now_running, now_waiting) == (running, waiting):
                return at
        return None

    def scheduler_now(self) -> tuple[int, int]:
        _, running, waiting = self.scheduler[-1] if self.scheduler else (0.0, 0, 0)
        return (running, waiting)


def build_app(engine: Any, probe: Probe) -> ASGIApp:
    """POST /{mw,bare}/generate with a JSON body:

    `id`, `prompts` (list), `max_tokens`, `n`, `stream` (NDJSON, one line per output), and
    `api`: "helper" (`asgi_cancel.vllm.generate`), "cm" (`abort_on_cancel` around the
    iteration), "tasks" (`abort_on_cancel` around producer tasks, one per prompt, that
    nothing cancels), "tasks-bare" (the same producers without the adapter), "none".
    """

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = json.loads(await read_body(receive))
        request_id: str = request["id"]
        prompts: list[str] = request["prompts"]
        api: str = request.get("api", "cm")
        params = _sampling.SamplingParams(
            max_tokens=request["max_tokens"],
            n=request.get("n", 1),
            ignore_eos=True,
            seed=0,
            output_kind=_sampling.RequestOutputKind.DELTA,
        )
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-p{i}" for i in range(len(prompts))]
        )
        if not scope["path"].startswith("/bare/"):  # /bare: no middleware, no token
            watch(current_token(), request_id, probe.fired, probe.usage)

        stream: bool = request.get("stream", False)
        if stream:
            headers = [(b"content-type", b"application/x-ndjson")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        counts: dict[str, int] = {}

        async def emit(output: Any) -> None:
            for completion in output.outputs:
                key = f"{output.request_id}/{completion.index}"
                counts[key] = counts.get(key, 0) + len(completion.token_ids)
                if stream:
                    line = {"id": key, "n": counts[key], "end": completion.finish_reason}
                    body = json.dumps(line).encode() + b"\n"
                    await send({"type": "http.response.body", "body": body, "more_body": True})

        async def merge() -> None:
            queue: asyncio.Queue[Any] = asyncio.Queue()

            async def produce(prompt: str, one_id: str) -> None:
                async for output in engine.generate(prompt, params, one_id):
                    queue.put_nowait(output)
                queue.put_nowait(None)

            # Background producers, deliberately left running if this task is cancelled: the
            # shape of a fan-out that a task cancellation does not reach.
            for prompt, one_id in zip(prompts, ids, strict=True):
                producers.add(asyncio.get_running_loop().create_task(produce(prompt, one_id)))
            remaining = len(ids)
            while remaining:
                output = await queue.get()
                if output is None:
                    remaining -= 1
                else:
                    await emit(output)

        adapter = abort_on_cancel(engine, *ids) if api in ("cm", "tasks") else nullcontext()
        async with adapter:
            if api in ("tasks", "tasks-bare"):
                await merge()
            elif api in ("helper", "cm", "none"):
                one = (prompts[0], params, ids[0])
                outputs = generate(engine, *one) if api == "helper" else engine.generate(*one)
                async for output in outputs:
                    await emit(output)
            else:
                raise ValueError(api)

        if stream:
            await send({"type": "http.response.body", "body": b""})
        else:
            payload = json.dumps({"id": request_id, "tokens": counts}).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

    producers: set[asyncio.Task[None]] = set()
    wrapped = CancelOnDisconnectMiddleware(app)

    async def router(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/bare/"):
            await app(scope, receive, send)
        else:
            await wrapped(scope, receive, send)

    return router


class EngineServer:
    """Start with `with EngineServer(model, max_num_seqs=1) as server:`; one per test module."""

    def __init__(self, model: Path, *, max_num_seqs: int, startup_timeout: float = 300.0) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.startup_timeout = startup_timeout
        self.probe = Probe()
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self.startup_seconds = 0.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)

    def __enter__(self) -> EngineServer:
        started = time.monotonic()
        self._thread.start()
        if not self._ready.wait(self.startup_timeout):
            raise AssertionError(f"vLLM engine not up within {self.startup_timeout} s")
        if self._error is not None:
            raise AssertionError("vLLM engine failed to start") from self._error
        self.startup_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def call(self, function: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30.0) -> T:
        """Run `function()` on the engine's loop and return its result."""
        assert self.loop is not None
        future: Future[T] = asyncio.run_coroutine_threadsafe(function(), self.loop)
        return future.result(timeout)

    def unfinished(self) -> int:
        async def count() -> int:
            return int(self.engine.output_processor.get_num_unfinished_requests())

        return self.call(count)

    def abort(self, *request_ids: str) -> None:
        """Clean up after a test that deliberately left requests running."""
        self.call(lambda: self.engine.abort(list(request_ids)))

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # reported to the test thread
            self._error = error
            self._ready.set()
        finally:
            self.engine = None
            with warnings.catch_warnings():
                # vLLM 0.32 leaves its zmq.Context to the garbage collector after shutdown();
                # collect it here, quietly, not at interpreter exit as an unraisable warning.
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        args = _arg_utils.AsyncEngineArgs(
            model=str(self.model),
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            max_num_seqs=self.max_num_seqs,
            seed=0,
            disable_log_stats=False,  # scheduler stats with every EngineCore output: the probe
            enable_log_requests=True,  # "Aborted request(s) ..." in the captured log
        )
        engine = _async_llm.AsyncLLM.from_engine_args(args)
        try:
            self.engine = engine
            self.probe.attach(engine)
            # Warm up, so that the first test does not pay for the first request.
            warm = _sampling.SamplingParams(max_tokens=4, ignore_eos=True)
            async for _ in engine.generate("warm up", warm, "warm-up"):
                pass
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            config = uvicorn.Config(
                build_app(engine, self.probe), lifespan="off", log_level="warning", access_log=False
            )
            server = uvicorn.Server(config)
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
            self._ready.set()
            await self._stop.wait()
            server.should_exit = True
            await asyncio.wait_for(serving, 30)
        finally:
            engine.shutdown()
