"""The seam between the HTTP layer and an inference engine, shaped like vLLM's `AsyncLLM`.

The endpoints only ever call what `Engine` lists, so the simulated engine (`sim_engine.py`, the
demo's) and real vLLM (`vllm_engine.py`) serve the same routes, and
`asgi_cancel.vllm.abort_on_cancel` aborts either by request id.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol


@dataclass(frozen=True)
class CompletionOutput:
    """One sequence of a request, cumulative so far (vLLM's default `RequestOutputKind`)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    # "length", "stop", "abort", or None while the sequence is still being generated.
    finish_reason: str | None


@dataclass(frozen=True)
class RequestOutput:
    """What `Engine.generate` yields after each engine step for the request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool


@dataclass(frozen=True)
class Sampling:
    """Engine-independent sampling options; each engine turns them into its own params."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says


@dataclass(frozen=True)
class EngineStats:
    """Counters behind `/metrics`. `tokens_wasted` counts tokens generated after the client left."""

    running: int
    waiting: int
    max_batch_size: int
    requests: int
    finished: int
    aborted: int
    clients_gone: int
    tokens_generated: int
    tokens_wasted: int


@dataclass
class Counters:
    """What an engine counts for `EngineStats`; `stats()` adds what it sees now."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    clients_gone: int = 0
    tokens_generated: int = 0
    tokens_wasted: int = 0

    def stats(self, *, running: int, waiting: int, max_batch_size: int) -> EngineStats:
        return EngineStats(running, waiting, max_batch_size, **asdict(self))


class EngineRequestError(Exception):
    """The engine refused a request (the client's fault: the server answers 400)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class Engine(Protocol):
    """What the endpoints need from an engine. `generate` and `abort` mirror vLLM's `AsyncLLM`."""

    @property
    def name(self) -> str:
        """Short engine name for `/health` and logs ("sim", "vllm")."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens a request may use."""
        ...

    def sampling_params(self, sampling: Sampling) -> object:
        """The engine's own params object for `generate`."""
        ...

    def count_prompt_tokens(self, prompt: str) -> int | None:
        """Prompt length in tokens if cheap to know before `generate`, else None."""
        ...

    def generate(
        self, prompt: str, params: object, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its cumulative output after each step.

        Like vLLM, the request is aborted if the iterating task is cancelled or the iterator is
        closed early.
        """
        ...

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id; ids that are unknown or already finished are ignored."""
        ...

    def client_gone(self, request_id: str) -> None:
        """Record that the request's HTTP client left; later tokens count as wasted."""
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
