"""What llama.cpp did, from the engine side: each generation's forward passes, timed.

Installed by the test servers (`install()` patches `llama_cpp.Llama` for the whole process),
read through their `GET /probe` route. Counted at `Llama.eval`, the call that runs the model:
one per generated token after the prompt's, whoever asked for it and whatever the client got.
Generations are told apart at `Llama.generate`, which every completion runs through; the apps
run one generation at a time (a lock, as llama-cpp-python's own server does).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from time import monotonic
from typing import Any

_generations: list[dict[str, Any]] = []
_current: dict[str, Any] | None = None


def install() -> None:
    import llama_cpp

    llama = llama_cpp.Llama
    if getattr(llama, "_asgi_cancel_probe", False):
        return
    generate = llama.generate
    evaluate = llama.eval

    @functools.wraps(generate)
    def probed_generate(self: Any, tokens: Sequence[int], **kwargs: Any) -> Iterator[int]:
        global _current
        record: dict[str, Any] = {
            "prompt_tokens": len(tokens),
            "started": monotonic(),
            "ended": None,
            "evals": [],
        }
        _generations.append(record)
        _current = record
        try:
            yield from generate(self, tokens, **kwargs)
        finally:
            record["ended"] = monotonic()

    @functools.wraps(evaluate)
    def probed_eval(self: Any, tokens: Sequence[int]) -> None:
        evaluate(self, tokens)
        if _current is not None:
            _current["evals"].append(monotonic())

    llama.generate = probed_generate
    llama.eval = probed_eval
    llama._asgi_cancel_probe = True


def generations() -> list[dict[str, Any]]:
    """Every generation so far, oldest first: prompt_tokens, started, ended (None while it
    runs, or while an abandoned stream waits to be collected), evals (monotonic times)."""
    return list(_generations)
