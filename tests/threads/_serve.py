"""`transformers serve` in this process, with and without the recipe of docs/threads.md, and a
client that leaves it mid-generation, counted from the engine's side. Shared by
tests/threads/test_transformers_serve.py and benchmarks/threads.py."""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..vllm._harness import RawClient, free_port, wait_for
from ._measure import LEAVE_AFTER, PROMPT


def serve_recipe() -> Callable[[], None]:
    """`transformers serve` behind asgi-cancel: call before `Serve(...)` (docs/threads.md).

    Returns what undoes it (the tests run the server alone after it)."""
    server: Any = importlib.import_module("transformers.cli.serving.server")
    utils: Any = importlib.import_module("transformers.cli.serving.utils")
    GenerateManager, CBGenerateManager = utils.GenerateManager, utils.CBGenerateManager

    from asgi_cancel import CancelOnDisconnectMiddleware
    from asgi_cancel.transformers import CancelCriteria

    build_server = server.build_server
    server.build_server = lambda *args, **kwargs: CancelOnDisconnectMiddleware(
        build_server(*args, **kwargs)
    )
    # Streaming stops once the middleware cancels the response (transformers' own
    # streamer.cancel()); a non-streaming generate() in its thread needs the token.
    generate_non_streaming = GenerateManager.generate_non_streaming

    async def stopped_by_the_token(
        self: Any, model: Any, processor: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        inputs = {**inputs, "stopping_criteria": [CancelCriteria()]}  # made in the request
        # Shielded: transformers' inference thread sets the result of the future it was given
        # without checking that it was cancelled (an InvalidStateError in the log).
        return await asyncio.shield(
            generate_non_streaming(self, model, processor, inputs, *args, **kwargs)
        )

    GenerateManager.generate_non_streaming = stopped_by_the_token
    # --continuous-batching: the request awaits its result from the batch; cancelled, it takes
    # itself out of the batch (as the streaming route's streamer.cancel() does).
    batched_non_streaming = CBGenerateManager.generate_non_streaming

    async def taken_out_of_the_batch(
        self: Any,
        model: Any,
        processor: Any,
        inputs: dict[str, Any],
        gen_config: Any,
        request_id: str,
    ) -> Any:
        try:
            return await batched_non_streaming(
                self, model, processor, inputs, gen_config, request_id=request_id
            )
        except asyncio.CancelledError:
            self._cb.cancel_request(request_id)
            raise

    CBGenerateManager.generate_non_streaming = taken_out_of_the_batch

    def undo() -> None:
        server.build_server = build_server
        GenerateManager.generate_non_streaming = generate_non_streaming
        CBGenerateManager.generate_non_streaming = batched_non_streaming

    return undo


class Generations:
    """Every `generate()` in the process, in order: when each token was made, when it ended."""

    def __init__(self, model_class: Any) -> None:
        self.steps: list[list[float]] = []
        self.ended: list[float | None] = []
        self.model_class = model_class
        self.generate = generate = model_class.generate
        generations = self

        def probe_generate(model: Any, *args: Any, **kwargs: Any) -> Any:
            steps: list[float] = []
            generations.steps.append(steps)
            generations.ended.append(None)
            index = len(generations.steps) - 1

            def probe(input_ids: Any, scores: Any, **_: Any) -> Any:
                steps.append(time.monotonic())
                return input_ids.new_zeros((input_ids.shape[0],)).bool()

            config = kwargs.get("generation_config")
            if config is not None and config.max_new_tokens:
                config.min_new_tokens = config.max_new_tokens  # no early EOS (a random model)
            given = list(kwargs.pop("stopping_criteria", None) or [])
            try:
                return generate(model, *args, stopping_criteria=[*given, probe], **kwargs)
            finally:
                generations.ended[index] = time.monotonic()

        model_class.generate = probe_generate

    def restore(self) -> None:
        self.model_class.generate = self.generate


# --continuous-batching with a small KV cache: by default it is sized from the free memory (~20 GB
# on a 2-core machine: the kernel killed the process).
CONTINUOUS_BATCHING = {"continuous_batching": True, "cb_block_size": 32, "cb_num_blocks": 256}


@contextmanager
def served(model: Path, *, recipe: bool, batched: bool) -> Iterator[int]:
    """`serving()` alone or with `serve_recipe()`, with or without continuous batching."""
    undo = serve_recipe() if recipe else None
    try:
        with serving(model, **(CONTINUOUS_BATCHING if batched else {})) as port:
            yield port
    finally:
        if undo is not None:
            undo()


@contextmanager
def serving(model: Path, **options: Any) -> Iterator[int]:
    """`transformers serve` on 127.0.0.1 in this process (`Serve(..., non_blocking=True)`):
    yield its port, kill it on the way out. `options` go to `Serve`."""
    serve_module: Any = importlib.import_module("transformers.cli.serve")
    port = free_port()
    serve = serve_module.Serve(
        str(model), host="127.0.0.1", port=port, device="cpu", non_blocking=True, **options
    )
    try:
        wait_for(functools.partial(_listening, port), 60, "transformers serve listening")
        yield port
    finally:
        serve.kill_server()
        del serve
        with warnings.catch_warnings():
            # --continuous-batching leaves its thread's event loop unclosed (transformers 5.19):
            # collected here, not in a later test's teardown.
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def serve_departure(
    port: int,
    generations: Generations | BatchedGenerations,
    model: Path,
    stream: bool,
    max_new_tokens: int,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """POST /v1/chat/completions, close the socket once the engine made `LEAVE_AFTER` tokens,
    send the next request at once; measure the departed generation and the next one's time to
    first token."""
    payload = {
        "model": str(model),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_new_tokens,
        "stream": stream,
    }
    start = len(generations.steps)
    client = RawClient(port).post("/v1/chat/completions", payload)
    wait_for(lambda: len(generations.steps) > start, timeout, "the generation's start")
    steps = generations.steps[start]
    wait_for(lambda: len(steps) >= LEAVE_AFTER, timeout, "the first tokens")
    closed_at = client.close()
    sent_at = time.monotonic()
    next_payload = {**payload, "max_tokens": 10, "stream": False}
    with RawClient(port).post("/v1/chat/completions", next_payload) as follower:
        wait_for(lambda: generations.ended[start] is not None, timeout, "the generation's end")
        wait_for(lambda: len(generations.steps) > start + 1, timeout, "the next generation")
        wait_for(lambda: generations.steps[start + 1] != [], timeout, "the next first token")
        follower.read_all(timeout)
    ended = generations.ended[start]
    assert ended is not None
    return {
        "tokens": len(steps),
        "tokens_after_close": sum(1 for at in steps if at > closed_at),
        "close_to_stop_ms": round((ended - closed_at) * 1000, 1),
        "next_ttft_ms": round((generations.steps[start + 1][0] - sent_at) * 1000, 1),
    }


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


class BatchedGenerations:
    """The same record for `transformers serve --continuous-batching`, whose requests never call
    `generate()`: one entry per request the batch manager decodes, in the order of its first
    token; a request ends when it finishes or is cancelled out of the batch. EOS is off (a
    random model), so a request runs to its `max_new_tokens` unless stopped."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []
        self.ended: list[float | None] = []
        self.index: dict[str, int] = {}
        requests: Any = importlib.import_module(
            "transformers.generation.continuous_batching.requests"
        )
        scheduler: Any = importlib.import_module(
            "transformers.generation.continuous_batching.scheduler"
        )
        self.patched = [
            (requests.RequestState, "update_and_check_completion"),
            (scheduler.Scheduler, "clear_cancelled_requests"),
        ]
        self.originals = [getattr(owner, name) for owner, name in self.patched]
        update, clear = self.originals
        generations = self

        def probe_update(state: Any, token_id: int, logprob: float | None) -> bool:
            state._eos_token_ids = []
            index = generations.index.get(state.request_id)
            if index is None:
                index = generations.index[state.request_id] = len(generations.steps)
                generations.steps.append([])
                generations.ended.append(None)
            generations.steps[index].append(time.monotonic())
            done: bool = update(state, token_id, logprob)
            if done:
                generations.ended[index] = time.monotonic()
            return done

        def probe_clear(self: Any) -> list[Any]:
            cancelled: list[Any] = clear(self)
            for state in cancelled:
                index = generations.index.get(state.request_id)
                if index is not None:
                    generations.ended[index] = time.monotonic()
            return cancelled

        requests.RequestState.update_and_check_completion = probe_update
        scheduler.Scheduler.clear_cancelled_requests = probe_clear

    def restore(self) -> None:
        for (owner, name), original in zip(self.patched, self.originals, strict=True):
            setattr(owner, name, original)
