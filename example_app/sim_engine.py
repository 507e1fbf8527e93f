"""The demo's engine: a simulated continuous-batching LLM engine that runs anywhere in seconds.

It keeps the parts of a real engine that make abandoned requests expensive: a fixed step time
(one forward pass over the batch), a maximum batch size, a FIFO waiting queue, one token per
running request per step, and `abort(ids)` that frees a request's slot at once. A request whose
client has gone keeps its slot until it finishes or is aborted, and live requests queue behind
it. The "text" is made-up words; the timing is the point.

The API mirrors vLLM's `AsyncLLM`: `generate(prompt, params, request_id)` is an async generator of
cumulative outputs that aborts the request if its consumer is cancelled or closes it early, and
`abort()` takes one id or several.

benchmarks/ (the wasted-work benchmark) serves this engine too: with `keep_timelines=True` it keeps
each request's `Timeline` (when it arrived, started, ended, and every token's time) so that a
client on the same machine can count the tokens generated after it left.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field

from .engine import CompletionOutput, Counters, EngineStats, RequestOutput, Sampling

WORDS = (
    " the", " a", " cancel", " token", " engine", " request", " client", " server", " stream",
    " batch", " slot", " queue", " step", " abort", " disconnect", " middleware", " async",
    " event", " loop", " task", " waits", " runs", " frees", " sends", " reads", " leaves",
    " quickly", " again", " now", " never", " every", " one", " and", " of", " to", " is",
)  # fmt: skip


@dataclass(frozen=True)
class SimParams:
    """`SamplingParams` for the simulated engine."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Timeline:
    """One request's life in `time.monotonic()` seconds, the clock every process here reads."""

    arrived: float
    started: float | None = None
    finished: float | None = None
    aborted: float | None = None
    token_times: list[float] = field(default_factory=list)


class _Request:
    __slots__ = (
        "client_gone",
        "latest",
        "params",
        "prompt_token_ids",
        "ready",
        "request_id",
        "rng",
        "text",
        "timeline",
        "token_ids",
    )

    def __init__(self, request_id: str, prompt: str, params: SimParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tokenize(prompt)
        self.params = params
        self.rng = random.Random(params.seed)
        self.text = ""
        self.token_ids: list[int] = []
        self.client_gone = False
        self.latest: RequestOutput | None = None
        self.ready = asyncio.Event()
        self.timeline = Timeline(time.monotonic())

    def publish(self, finish_reason: str | None) -> None:
        output = CompletionOutput(0, self.text, tuple(self.token_ids), finish_reason)
        self.latest = RequestOutput(
            self.request_id, self.prompt_token_ids, (output,), finish_reason is not None
        )
        self.ready.set()


def tokenize(text: str) -> tuple[int, ...]:
    """Fake tokenizer: one token per whitespace-separated word (at least one, like a BOS)."""
    return tuple(zlib.crc32(word.encode()) % 32_000 for word in text.split()) or (1,)


class SimulatedEngine:
    """A continuous-batching engine simulator with vLLM `AsyncLLM`'s request API.

    Every `step_time` seconds, while there is work, the engine admits waiting requests into free
    batch slots (first come, first served) and then gives each running request one token. A
    request leaves the batch when it reaches `max_tokens` or a stop string, or when aborted.

    Args:
        step_time: seconds per engine step, whatever the batch size (a decode step is
            memory-bound, so its time barely depends on how many slots are busy).
        max_batch_size: requests generating at once; the rest wait in the queue.
        max_model_len: prompt plus completion tokens allowed per request.
        keep_timelines: keep every request's `Timeline` in `timelines` until `reset()` (for
            benchmarks; a long-running server would keep them all).
    """

    name = "sim"

    def __init__(
        self,
        *,
        step_time: float = 0.01,
        max_batch_size: int = 8,
        max_model_len: int = 4096,
        keep_timelines: bool = False,
    ) -> None:
        if not step_time > 0:
            raise ValueError(f"step_time must be > 0 seconds, got {step_time!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len!r}")
        self.step_time = step_time
        self.max_batch_size = max_batch_size
        self._max_model_len = max_model_len
        self._waiting: dict[str, _Request] = {}  # insertion order is arrival order
        self._running: dict[str, _Request] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._keep_timelines = keep_timelines
        self.timelines: dict[str, Timeline] = {}
        self.steps = 0
        self.counters = Counters()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def sampling_params(self, sampling: Sampling) -> SimParams:
        return SimParams(max_tokens=sampling.max_tokens, stop=sampling.stop, seed=sampling.seed)

    def count_prompt_tokens(self, prompt: str) -> int:
        return len(tokenize(prompt))

    async def generate(
        self, prompt: str, params: object, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request and yield its cumulative output after every step that extends it.

        Outputs coalesce if the consumer falls behind (as vLLM's output collector does): each
        one carries all the text so far.
        """
        if not isinstance(params, SimParams):
            raise TypeError(f"params must be SimParams, got {type(params).__name__}")
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = _Request(request_id, prompt, params)
        if self._keep_timelines:
            self.timelines[request_id] = request.timeline
        self._waiting[request_id] = request
        self.counters.requests += 1
        self._work.set()
        try:
            while True:
                await request.ready.wait()
                request.ready.clear()
                output = request.latest
                assert output is not None
                yield output
                if output.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # Like vLLM: a consumer that was cancelled or stopped iterating aborts the request.
            self._abort_now((request_id,))
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests now, waiting or running: their slots are free for the next step."""
        self._abort_now((request_id,) if isinstance(request_id, str) else request_id)

    def _abort_now(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
            if request is not None:
                self.counters.aborted += 1
                request.timeline.aborted = time.monotonic()
                request.publish("abort")

    def client_gone(self, request_id: str) -> None:
        request = self._waiting.get(request_id) or self._running.get(request_id)
        if request is not None and not request.client_gone:
            request.client_gone = True
            self.counters.clients_gone += 1

    def stats(self) -> EngineStats:
        return self.counters.stats(
            running=len(self._running),
            waiting=len(self._waiting),
            max_batch_size=self.max_batch_size,
        )

    def reset(self) -> None:
        """Abort every request and start the counters, `steps` and `timelines` from zero."""
        self._abort_now([*self._waiting, *self._running])
        self.counters = Counters()
        self.steps = 0
        self.timelines.clear()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._abort_now([*self._waiting, *self._running])

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            if not self._waiting and not self._running:
                self._work.clear()
                await self._work.wait()
                next_step = loop.time()
            while self._waiting and len(self._running) < self.max_batch_size:
                request = self._waiting.pop(next(iter(self._waiting)))
                request.timeline.started = time.monotonic()
                self._running[request.request_id] = request
            # The forward pass. A fixed schedule, so a busy event loop does not slow the engine.
            next_step = max(next_step + self.step_time, loop.time())
            await asyncio.sleep(next_step - loop.time())
            self.steps += 1
            now = time.monotonic()
            for request in list(self._running.values()):
                self._generate_token(request, now)

    def _generate_token(self, request: _Request, now: float) -> None:
        index = request.rng.randrange(len(WORDS))
        request.token_ids.append(index)
        request.timeline.token_times.append(now)
        request.text += WORDS[index]
        self.counters.tokens_generated += 1
        if request.client_gone:
            self.counters.tokens_wasted += 1
        finish_reason = None
        for stop in request.params.stop:
            position = request.text.find(stop)
            if position >= 0:
                request.text = request.text[:position]
                finish_reason = "stop"
                break
        if finish_reason is None and len(request.token_ids) >= request.params.max_tokens:
            finish_reason = "length"
        if finish_reason is not None:
            del self._running[request.request_id]
            self.counters.finished += 1
            request.timeline.finished = now
        request.publish(finish_reason)
