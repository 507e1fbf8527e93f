"""A minimal simulated continuous-batching engine (the shape of vLLM's scheduler, no model).

Every `step_time` seconds the engine runs one step: it admits waiting requests while fewer than
`max_batch` run, then gives each running request one token. A request leaves the batch when it
has all its tokens or when it is aborted, which frees its slot at once. Like vLLM v1's
`AsyncLLM.generate()`, `generate()` aborts its request when the task iterating it is cancelled
or the generator is closed: that is the only way the HTTP layer can stop the work.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineRequest:
    request_id: str
    max_tokens: int
    arrived: float
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)
    started: float | None = None
    finished: float | None = None
    aborted: float | None = None

    def record(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "max_tokens": self.max_tokens,
            "arrived": self.arrived,
            "started": self.started,
            "finished": self.finished,
            "aborted": self.aborted,
            "token_times": self.token_times,
        }


class Engine:
    """Fixed step time, bounded batch, FIFO waiting queue, one token per running request."""

    def __init__(self, *, step_time: float = 0.01, max_batch: int = 16) -> None:
        if step_time <= 0 or max_batch < 1:
            raise ValueError("step_time must be > 0 and max_batch >= 1")
        self.step_time = step_time
        self.max_batch = max_batch
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[str, EngineRequest] = {}
        self.requests: dict[str, EngineRequest] = {}
        self.steps = 0
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(self, request_id: str, max_tokens: int) -> AsyncIterator[int]:
        """Yield token numbers 0..max_tokens-1 as the engine produces them."""
        self._ensure_running()
        request = EngineRequest(request_id, max_tokens, time.monotonic())
        self.requests[request_id] = request
        self.waiting.append(request)
        self._work.set()
        try:
            while True:
                token = await request.queue.get()
                if token is None:
                    return
                yield token
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(request_id)  # vLLM v1 aborts here too
            raise

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None or request.finished is not None or request.aborted is not None:
            return
        request.aborted = time.monotonic()
        self.running.pop(request_id, None)
        try:
            self.waiting.remove(request)
        except ValueError:
            pass

    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "unfinished": self.unfinished(),
            "requests": [request.record() for request in self.requests.values()],
        }

    def reset(self) -> None:
        for request_id in list(self.running) + [request.request_id for request in self.waiting]:
            self.abort(request_id)
        self.requests.clear()
        self.steps = 0

    def _ensure_running(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._work.clear()
                await self._work.wait()
            deadline = loop.time() + self.step_time
            while self.waiting and len(self.running) < self.max_batch:
                request = self.waiting.popleft()
                request.started = time.monotonic()
                self.running[request.request_id] = request
            # The "forward pass": a fixed step time, whatever the batch size.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            self.steps += 1
            now = time.monotonic()
            for request in list(self.running.values()):
                token = len(request.token_times)
                request.token_times.append(now)
                request.queue.put_nowait(token)
                if token + 1 >= request.max_tokens:
                    request.finished = now
                    request.queue.put_nowait(None)
                    del self.running[request.request_id]
