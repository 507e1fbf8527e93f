"""Generation in worker threads: what a client that leaves costs, without and with asgi-cancel.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        .venv-vllm/bin/python -m benchmarks.threads [--quick] [--model DIR]

Needs torch and transformers (the vLLM venv has them; `transformers serve` also needs
`accelerate`, its `serving` extra) and the tiny local model (`python -m example_app.tiny_model
DIR`, default `.models/tiny-llama`). Each row: a client sends a request, closes its socket once
the engine made 20 tokens; counted from the engine's side (stopping-criteria calls, one per
token): the milliseconds from the close to the generation's end, the tokens made after the
close, and the time to first token of a request sent right after the close, which queues
behind the departed one (one generation at a time). The FastAPI patterns are those of
tests/threads/_app.py; `transformers serve` runs in this process, alone and with the recipe of
docs/threads.md (`serve_recipe`). Bounded: each generation is at most `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ._util import ROOT, emit, fmt, table

PROMPT = "Tell me a long story about a llama that runs on a CPU."
LEAVE_AFTER = 20


def fastapi_rows(model: Path, max_new_tokens: int) -> list[list[object]]:
    from tests.threads._app import ROUTES, Engine, Server
    from tests.threads._measure import depart

    rows: list[list[object]] = []
    with Server(Engine(model)) as server:
        for route in ROUTES:
            for mode, label in (("bare", "alone"), ("mw", "asgi-cancel")):
                next_tokens = 10 if route == "stream-thread" else 0
                measured = depart(
                    server, mode, route, max_new_tokens=max_new_tokens, next_tokens=next_tokens
                )
                rows.append(row(f"FastAPI {route}", label, measured))
    return rows


def row(path: str, label: str, measured: dict[str, Any]) -> list[object]:
    return [
        path,
        label,
        fmt(measured["close_to_stop_ms"]),
        measured["tokens_after_close"],
        fmt(measured.get("next_ttft_ms")),
    ]


# -- transformers serve -----------------------------------------------------------------------
def serve_recipe() -> None:
    """`transformers serve` behind asgi-cancel: call before `Serve(...)` (docs/threads.md)."""
    server: Any = importlib.import_module("transformers.cli.serving.server")
    GenerateManager: Any = importlib.import_module("transformers.cli.serving.utils").GenerateManager

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


class Generations:
    """Every `generate()` in the process, in order: when each token was made, when it ended."""

    def __init__(self, model_class: Any) -> None:
        self.steps: list[list[float]] = []
        self.ended: list[float | None] = []
        generate = model_class.generate
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


def serve_rows(model: Path, max_new_tokens: int) -> list[list[object]]:
    from tests.vllm._harness import free_port, wait_for

    transformers: Any = importlib.import_module("transformers")
    serve_module: Any = importlib.import_module("transformers.cli.serve")
    generations = Generations(transformers.LlamaForCausalLM)
    rows: list[list[object]] = []
    for label in ("alone", "asgi-cancel"):
        if label == "asgi-cancel":
            serve_recipe()
        port = free_port()
        serve = serve_module.Serve(
            str(model), host="127.0.0.1", port=port, device="cpu", non_blocking=True
        )
        wait_for(functools.partial(_listening, port), 60, "transformers serve listening")
        try:
            for stream in (True, False):
                measured = serve_departure(port, generations, model, stream, max_new_tokens)
                kind = "stream" if stream else "non-stream"
                rows.append(row(f"transformers serve {kind}", label, measured))
        finally:
            serve.kill_server()
    return rows


def serve_departure(
    port: int, generations: Generations, model: Path, stream: bool, max_new_tokens: int
) -> dict[str, float]:
    from tests.vllm._harness import RawClient, wait_for

    payload = {
        "model": str(model),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_new_tokens,
        "stream": stream,
    }
    start = len(generations.steps)
    client = RawClient(port).post("/v1/chat/completions", payload)
    wait_for(lambda: len(generations.steps) > start, 60, "the generation's start")
    steps = generations.steps[start]
    wait_for(lambda: len(steps) >= LEAVE_AFTER, 60, "the first tokens")
    closed_at = client.close()
    sent_at = time.monotonic()
    next_payload = {**payload, "max_tokens": 10, "stream": False}
    with RawClient(port).post("/v1/chat/completions", next_payload) as follower:
        wait_for(lambda: generations.ended[start] is not None, 120, "the generation's end")
        wait_for(lambda: len(generations.steps) > start + 1, 120, "the next generation")
        wait_for(lambda: generations.steps[start + 1] != [], 120, "the next first token")
        follower.read_all(60)
    ended = generations.ended[start]
    assert ended is not None
    return {
        "close_to_stop_ms": (ended - closed_at) * 1000,
        "tokens_after_close": sum(1 for at in steps if at > closed_at),
        "next_ttft_ms": (generations.steps[start + 1][0] - sent_at) * 1000,
    }


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "tiny-llama")
    parser.add_argument("--max-new-tokens", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 tokens per generation")
    parser.add_argument("--no-serve", action="store_true", help="skip `transformers serve`")
    args = parser.parse_args(argv)
    max_new_tokens = 300 if args.quick else args.max_new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch and transformers warn on import
        torch: Any = importlib.import_module("torch")
    torch.set_num_threads(1)
    started = time.monotonic()
    rows = fastapi_rows(args.model, max_new_tokens)
    if not args.no_serve:
        rows += serve_rows(args.model, max_new_tokens)
    headers = ["path", "", "close -> stopped (ms)", "tokens after close", "next TTFT (ms)"]
    emit(table(headers, rows))
    emit(
        f"\n{max_new_tokens} max new tokens, client leaves after {LEAVE_AFTER}; "
        f"torch threads 1; {time.monotonic() - started:.0f} s; "
        f"{threading.active_count()} threads left"
    )


if __name__ == "__main__":
    main()
