"""A disconnecting `openai` client against a real server: what the engine does afterwards.

Each scenario runs against the server with CancelOnDisconnectMiddleware and without it (the
`--no-middleware` baseline, where a recorder only notes when the client left). The assertions
are on the engine's counters once it is idle: tokens generated, tokens generated after the
client had gone ("wasted"), aborts. Polling only waits for state changes under a watchdog.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest

from example_app.launch import ServerProcess

from .helpers import MODEL, SERVERS, WATCHDOG, delta, stats, wait_for, wait_idle

pytestmark = pytest.mark.timeout(60)


@dataclass
class Server:
    process: ServerProcess
    middleware: bool


@pytest.fixture(
    scope="module",
    params=[(server, middleware) for server in SERVERS for middleware in (True, False)],
    ids=lambda param: f"{param[0]}-{'with' if param[1] else 'without'}-middleware",
)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    name, middleware = request.param
    args = ["--step-time", "0.01", "--max-batch-size", "1", "--log-level", "warning"]
    with ServerProcess(*args, *([] if middleware else ["--no-middleware"]), server=name) as process:
        yield Server(process, middleware)


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    wait_idle(server.process)  # a previous scenario's abandoned generation may still run
    url = f"{server.process.base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="test", max_retries=0, timeout=WATCHDOG) as client:
        yield client


def test_client_timeout_while_queued(server: Server, client: openai.OpenAI) -> None:
    """Timed out in the queue: never generated with the middleware, in full without it."""
    before = stats(server.process)
    blocker, victim = 200, 40  # the blocker holds the only batch slot for ~2 s
    with ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(
            client.completions.create, model=MODEL, prompt="first", max_tokens=blocker
        )
        wait_for(server.process, "running", lambda s: s["requests_running"] == 1)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model=MODEL, prompt="second", max_tokens=victim, timeout=0.2)
        if server.middleware:  # aborted from the queue while the blocker still runs
            sample = wait_for(server.process, "dequeued", lambda s: s["requests_waiting"] == 0)
            assert sample["requests_running"] == 1
        else:
            assert stats(server.process)["requests_waiting"] == 1  # still queued, for nobody
        usage = blocked.result(WATCHDOG).usage
    assert usage is not None
    assert usage.completion_tokens == blocker
    after = wait_idle(server.process)
    assert delta(after, before, "clients_gone") == 1
    wasted = 0 if server.middleware else victim  # without: the whole generation
    assert delta(after, before, "tokens_generated") == blocker + wasted
    assert delta(after, before, "tokens_wasted") == wasted
    assert delta(after, before, "requests_aborted") == server.middleware


def test_client_timeout_while_generating(server: Server, client: openai.OpenAI) -> None:
    before = stats(server.process)
    max_tokens = 100  # ~1 s; the client gives up after 0.25 s
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens, timeout=0.25)
    after = wait_idle(server.process)
    generated = delta(after, before, "tokens_generated")
    wasted = delta(after, before, "tokens_wasted")
    assert delta(after, before, "clients_gone") == 1
    assert delta(after, before, "requests_aborted") == server.middleware
    if server.middleware:
        assert generated < max_tokens
        assert wasted <= 1  # at most the one engine step racing the abort
    else:
        assert generated == max_tokens  # generated to the end for nobody
        assert wasted > max_tokens / 2


def test_closed_stream(server: Server, client: openai.OpenAI) -> None:
    """A stream closed after a few chunks stops the generation either way.

    Without the middleware, Starlette's own `StreamingResponse` listener does it, once the
    response has started, on servers that advertise ASGI spec < 2.4 (hypercorn 2.1, uvicorn
    2.3). It cannot see the time before the response starts, nor a non-streaming request.
    """
    before = stats(server.process)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=300, stream=True
    )
    with stream:
        contents = (chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
        for _ in range(3):
            next(contents)
    after = wait_idle(server.process)
    assert delta(after, before, "clients_gone") == 1
    assert delta(after, before, "requests_aborted") == 1
    assert delta(after, before, "tokens_generated") < 300
    assert delta(after, before, "tokens_wasted") <= 1
