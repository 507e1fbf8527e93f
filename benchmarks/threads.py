"""Generation in worker threads, without and with asgi-cancel: docs/threads.md's tables.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv-vllm/bin/python -m \\
        benchmarks.threads [--quick] [--parts fastapi serve cb] [--model DIR]
    python -m benchmarks.threads --llama .models/llama_cpp_results.json  # .ci/llama_cpp.sh's

Needs torch, transformers, accelerate and `python -m example_app.tiny_model DIR`. Results go to
benchmarks/results/ (--quick: results/tmp/), tables between docs/threads.md's markers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import warnings
from pathlib import Path
from typing import Any

from ._util import ROOT, emit, facts, fmt, load, loadavg, record, results_dir, save, table
from ._util import write_block as write

DOC = ROOT / "docs" / "threads.md"
PARTS = ("fastapi", "serve", "cb")  # FastAPI's patterns, transformers serve, and its batching
PATHS = {
    "stream-thread": "FastAPI `def` endpoint, `TextIteratorStreamer` + `Thread`",
    "stream-async": "FastAPI `async def` endpoint, the same",
    "generate-sync": "FastAPI `def` endpoint, `generate()` (threadpool)",
    "generate-to-thread": "FastAPI `async def`, `asyncio.to_thread`",
    "generate-executor": "FastAPI `async def`, `run_in_executor`",
}
for _part, _flag in (("serve", ""), ("cb", " --continuous-batching")):
    PATHS[f"{_part} stream"] = f"`transformers serve{_flag}`, streaming"
    PATHS[f"{_part} non-stream"] = f"`transformers serve{_flag}`, non-streaming"
ADDS = {"stream": "`generate_in_thread`", "generate": "`CancelCriteria`"}


def measure(part: str, model: Path, max_new_tokens: int) -> list[dict[str, Any]]:
    """Per path and mode: close -> end of generation (ms), tokens after the close, next TTFT."""
    if part == "fastapi":
        from tests.threads._app import ROUTES, Engine, Server
        from tests.threads._measure import depart

        with Server(Engine(model)) as server:
            return [
                {"path": route, "mode": mode}
                | depart(server, mode, route, max_new_tokens=max_new_tokens, next_tokens=10)
                for route in ROUTES
                for mode in ("bare", "mw")
            ]
    from tests.threads import _serve

    llama = importlib.import_module("transformers").LlamaForCausalLM
    generations = _serve.BatchedGenerations() if part == "cb" else _serve.Generations(llama)
    rows = []
    for mode in ("bare", "mw"):
        with _serve.served(model, recipe=mode == "mw", batched=part == "cb") as port:
            for kind in ("stream", "non-stream"):
                measured = _serve.serve_departure(
                    port, generations, model, kind == "stream", max_new_tokens
                )
                rows.append({"path": f"{part} {kind}", "mode": mode} | measured)
    generations.restore()
    return rows


def render(data: dict[str, Any]) -> str:
    rows = []
    for row in sorted(data["rows"], key=lambda row: list(PATHS).index(row["path"])):
        alone, adds = row["mode"] == "bare", ADDS.get(row["path"].split("-")[0], "the recipe")
        path, mode = (PATHS[row["path"]], "alone") if alone else ("", f"asgi-cancel ({adds})")
        cells = fmt(row["close_to_stop_ms"]), row["tokens_after_close"], fmt(row["next_ttft_ms"])
        rows.append([path, mode, *cells])
    headers = ["path", "", "close -> stopped (ms)", "tokens after the close", "next TTFT (ms)"]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(data["engine"].items()))
    return f"{table(headers, rows)}\n\n" + facts(data).replace("</sub>", f" · {versions}</sub>")


def render_llama(data: dict[str, Any]) -> str:
    """tests/threads/test_llama_cpp.py's rows: tokens after the close / close -> stop (ms), or
    the next request's time to its first chunk (ms)."""
    cells: dict[str, dict[str, str]] = {}
    for row in data["rows"]:
        stop = f"{row['after_close']} / {round(row['stop_ms'])}" if "stop_ms" in row else ""
        cells.setdefault(row["path"], {})[row["mode"]] = stop or fmt(row["next_ttft_ms"])
    header = ["path", "alone", "the middleware only", "with `asgi_cancel.llama_cpp`"]
    modes = ("alone", "middleware", "adapter")
    return table(header, [[path, *(c.get(m, "-") for m in modes)] for path, c in cells.items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "tiny-llama")
    parser.add_argument("--max-new-tokens", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 tokens per generation")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--llama", type=Path, help="the llama.cpp tests' JSON, kept and shown")
    args = parser.parse_args(argv)
    if args.llama:
        save({"benchmark": "llama_cpp", "quick": False, "rows": json.loads(args.llama.read_text())})
        for name, render_table in (("threads", render), ("llama_cpp", render_llama)):
            if (found := load(name, results_dir(False))) is not None:
                write(DOC, name, render_table(found))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch and transformers warn on import
        torch, transformers = (importlib.import_module(m) for m in ("torch", "transformers"))
    torch.set_num_threads(1)
    began, load_before = time.time(), loadavg()
    max_new_tokens = 300 if args.quick else args.max_new_tokens
    rows = [row for part in args.parts for row in measure(part, args.model, max_new_tokens)]
    data = record("threads", args.quick, began, load_before) | {"rows": rows, "skipped": {}}
    data["command"] = f"python -m benchmarks.threads --max-new-tokens {max_new_tokens}"
    data["engine"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    emit(render(data))
    emit(f"results: {save(data)}")
    if not args.quick:
        write(DOC, "threads", render(data))


if __name__ == "__main__":
    main()
