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
docs/threads.md (`serve_recipe`, tests/threads/_serve.py); `--continuous-batching` adds its
batched server (tokens counted by its batch manager; the next request joins the batch rather
than queue). Bounded: each generation is at most `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import importlib
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ._util import ROOT, emit, fmt, table

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


# -- transformers serve (tests/threads/_serve.py) ------------------------------------------------
def serve_rows(model: Path, max_new_tokens: int, **options: Any) -> list[list[object]]:
    from tests.threads._serve import (
        BatchedGenerations,
        Generations,
        serve_departure,
        serve_recipe,
        serving,
    )

    transformers: Any = importlib.import_module("transformers")
    batched = bool(options.get("continuous_batching"))
    generations: Any = (
        BatchedGenerations() if batched else Generations(transformers.LlamaForCausalLM)
    )
    rows: list[list[object]] = []
    suffix = ", continuous batching" if batched else ""
    for label in ("alone", "asgi-cancel"):
        undo = serve_recipe() if label == "asgi-cancel" else None
        try:
            with serving(model, **options) as port:
                for stream in (True, False):
                    measured = serve_departure(port, generations, model, stream, max_new_tokens)
                    kind = "stream" if stream else "non-stream"
                    rows.append(row(f"transformers serve {kind}{suffix}", label, measured))
        finally:
            if undo is not None:
                undo()
    generations.restore()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "tiny-llama")
    parser.add_argument("--max-new-tokens", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 tokens per generation")
    parser.add_argument("--no-serve", action="store_true", help="skip `transformers serve`")
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="also `transformers serve --continuous-batching`",
    )
    parser.add_argument("--no-fastapi", action="store_true", help="skip the FastAPI rows")
    args = parser.parse_args(argv)
    max_new_tokens = 300 if args.quick else args.max_new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch and transformers warn on import
        torch: Any = importlib.import_module("torch")
    torch.set_num_threads(1)
    started = time.monotonic()
    rows = [] if args.no_fastapi else fastapi_rows(args.model, max_new_tokens)
    if not args.no_serve:
        rows += serve_rows(args.model, max_new_tokens)
    if args.continuous_batching:
        # A small KV cache: by default sized from the free memory (~20 GB here: OOM-killed).
        cb = {"continuous_batching": True, "cb_block_size": 32, "cb_num_blocks": 256}
        rows += serve_rows(args.model, max_new_tokens, **cb)
    headers = ["path", "", "close -> stopped (ms)", "tokens after close", "next TTFT (ms)"]
    emit(table(headers, rows))
    emit(
        f"\n{max_new_tokens} max new tokens, client leaves after {LEAVE_AFTER}; "
        f"torch threads 1; {time.monotonic() - started:.0f} s; "
        f"{threading.active_count()} threads left"
    )


if __name__ == "__main__":
    main()
