"""A disconnecting `openai` client against a real server: what the engine does afterwards.

Each scenario runs against the server with CancelOnDisconnectMiddleware and without it (the
`--no-middleware` baseline, where a recorder only notes when the client left). The assertions
are on the engine's counters read from `/metrics` once the engine is idle: tokens generated,
tokens generated after the client had gone ("wasted"), aborts. Polling only waits for state
changes under a watchdog; no assertion depends on how fast anything happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from example_app import metrics
from example_app.launch import ServerProcess

from .conftest import MODEL, SERVERS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

STEP = 0.01  # seconds per engine step
WATCHDOG = 10.0


@dataclass
class Server:
    process: ServerProcess
    middleware: bool

    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient(timeout=WATCHDOG) as http:
            response = await http.get(f"{self.process.base_url}/metrics")
        return metrics.parse(response.text)

    async def gauge(self, name: str) -> float:
        return (await self.metrics())[f"example_engine_requests_{name}"]

    async def wait_until(self, what: str, check: Callable[[], Awaitable[bool]]) -> None:
        """Poll until `check()` is true: a watchdog for a state change, not a measurement."""
        deadline = time.monotonic() + WATCHDOG
        while not await check():
            if time.monotonic() > deadline:
                raise AssertionError(f"still not {what} after {WATCHDOG} s")
            await asyncio.sleep(0.01)

    async def wait_idle(self) -> dict[str, float]:
        async def idle() -> bool:
            return not (await self.gauge("running") or await self.gauge("waiting"))

        await self.wait_until("idle", idle)
        return await self.metrics()


@pytest.fixture(
    scope="module",
    params=[(server, middleware) for server in SERVERS for middleware in (True, False)],
    ids=lambda param: f"{param[0]}-{'with' if param[1] else 'without'}-middleware",
)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    name, middleware = request.param
    args = ["--step-time", str(STEP), "--max-batch-size", "1", "--log-level", "warning"]
    if not middleware:
        args.append("--no-middleware")
    with ServerProcess(*args, server=name) as process:
        yield Server(process, middleware)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    await server.wait_idle()  # a previous scenario's abandoned generation may still be running
    async with openai.AsyncOpenAI(
        base_url=f"{server.process.base_url}/v1",
        api_key="test",
        max_retries=0,
        timeout=WATCHDOG,
    ) as client:
        yield client


async def is_(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    full = f"example_engine_{name}_total"
    return after[full] - before[full]


async def test_client_timeout_while_queued(server: Server, client: openai.AsyncOpenAI) -> None:
    """A request that times out in the queue: never generated with the middleware, in full
    without it (its slot comes up after the client has gone)."""
    before = await server.metrics()
    blocker = 200  # tokens: holds the only batch slot for ~2 s
    victim = 40
    blocked = asyncio.create_task(
        client.completions.create(model=MODEL, prompt="first", max_tokens=blocker)
    )
    try:
        await server.wait_until("running", lambda: is_(server.gauge("running"), 1))
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(
                model=MODEL, prompt="second", max_tokens=victim, timeout=0.2
            )
        if server.middleware:
            # Aborted from the queue at the disconnect, while the blocker still runs.
            await server.wait_until("dequeued", lambda: is_(server.gauge("waiting"), 0))
            assert await server.gauge("running") == 1
        else:
            assert await server.gauge("waiting") == 1  # still queued for nobody
        completion = await asyncio.wait_for(blocked, WATCHDOG)
    finally:
        blocked.cancel()
    assert completion.usage is not None
    assert completion.usage.completion_tokens == blocker
    after = await server.wait_idle()
    assert delta(after, before, "clients_gone") == 1
    if server.middleware:
        assert delta(after, before, "tokens_generated") == blocker
        assert delta(after, before, "tokens_wasted") == 0
        assert delta(after, before, "requests_aborted") == 1
    else:
        assert delta(after, before, "tokens_generated") == blocker + victim
        assert delta(after, before, "tokens_wasted") == victim  # the whole generation
        assert delta(after, before, "requests_aborted") == 0


async def test_client_timeout_while_generating(server: Server, client: openai.AsyncOpenAI) -> None:
    """A non-streaming request whose client times out mid-generation."""
    before = await server.metrics()
    max_tokens = 100  # ~1 s; the client gives up after 0.25 s
    with pytest.raises(openai.APITimeoutError):
        await client.completions.create(
            model=MODEL, prompt="hello", max_tokens=max_tokens, timeout=0.25
        )
    if server.middleware:
        await server.wait_until("stopped", lambda: is_(server.gauge("running"), 0))
    after = await server.wait_idle()
    generated = delta(after, before, "tokens_generated")
    wasted = delta(after, before, "tokens_wasted")
    assert delta(after, before, "clients_gone") == 1
    if server.middleware:
        assert generated < max_tokens
        assert wasted <= 1  # at most the one engine step racing the abort
        assert delta(after, before, "requests_aborted") == 1
    else:
        assert generated == max_tokens  # generated to the end for nobody
        assert wasted > max_tokens / 2
        assert delta(after, before, "requests_aborted") == 0


async def test_closed_stream(server: Server, client: openai.AsyncOpenAI) -> None:
    """A client that closes a stream after a few chunks stops the generation either way.

    Without the middleware, Starlette's own `StreamingResponse` listener does it: it listens
    for `http.disconnect` once the response has started, on servers that advertise ASGI spec
    < 2.4 (hypercorn 2.1, uvicorn 2.3). What it cannot see is the time before the response
    starts, and non-streaming requests: the two tests above.
    """
    before = await server.metrics()
    max_tokens = 300
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=max_tokens,
        stream=True,
    )
    received = 0
    async with stream:
        async for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break
    await server.wait_until("stopped", lambda: is_(server.gauge("running"), 0))
    after = await server.wait_idle()
    assert delta(after, before, "clients_gone") == 1
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "tokens_generated") < max_tokens
    assert delta(after, before, "tokens_wasted") <= 1
