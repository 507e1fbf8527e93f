"""Real vLLM `AsyncLLM` + `asgi_cancel.vllm` behind the middleware, under uvicorn on 127.0.0.1.

One engine for the module, `max_num_seqs=1`, so that a second request queues behind the first
and n>1 children queue behind each other. Clients are raw sockets that really close. After
each disconnect the engine must have no unfinished request within a bounded time, and the
EngineCore must have generated only a few tokens for it after the disconnect.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ._engine_app import EngineServer
from ._harness import (
    LEAVES_ENGINE_WITHIN,
    MAX_TOKENS_AFTER_DISCONNECT,
    RawClient,
    body_of,
    report,
    status_of,
    tiny_model,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

LONG = 400  # tokens: about 4 s at this model's ~100 tokens/s; no test waits for it to end
TWO_PROMPTS = ["A llama.", "Two llamas."]
MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def server() -> Iterator[EngineServer]:
    with EngineServer(tiny_model(), max_num_seqs=1) as engine_server:
        MEASURED["engine_startup_s"] = round(engine_server.startup_seconds, 1)
        yield engine_server
    report("asyncllm", MEASURED)


@pytest.fixture(autouse=True)
def idle_engine(server: EngineServer) -> Iterator[None]:
    """Each test starts and ends with nothing in the engine."""
    wait_for(lambda: server.unfinished() == 0, 30, "engine idle before the test")
    yield
    wait_for(lambda: server.unfinished() == 0, 30, "engine idle after the test")


def new_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def lines(response: bytes) -> int:
    return response.count(b'"n":')


def request(request_id: str, *, stream: bool, api: str, **extra: Any) -> dict[str, Any]:
    defaults = {"prompts": ["Tell me a long story about a llama."], "max_tokens": LONG}
    return {"id": request_id, "stream": stream, "api": api, **defaults, **extra}


def check_left_engine(server: EngineServer, request_id: str, closed_at: float) -> dict[str, float]:
    """The request left the engine at once after the disconnect; return the measurements."""
    probe = server.probe
    wait_for(lambda: request_id in probe.fired, 2.0, "the middleware firing the token")
    fired = probe.fired[request_id]
    wait_for(
        lambda: server.unfinished() == 0 and probe.scheduler_idle_at(fired) is not None,
        LEAVES_ENGINE_WITHIN,
        "the request leaving the engine",
    )
    aborts = probe.aborts_of(request_id)
    assert aborts, "no abort reached the engine"
    first_abort_at = aborts[0][0]
    # The adapter's abort runs in a task spawned at the disconnect, before the app task is
    # cancelled: it usually reaches the engine first. When an engine output had woken the app
    # task in the same loop iteration as the disconnect, the app's step runs first, and
    # vLLM's own abort (on its CancelledError) precedes the adapter's by that one step (seen
    # once in CI). Either way the adapter's abort must come, at once.
    adapters = [at for at, _, internal in aborts if not internal]
    assert adapters, "the adapter's abort never reached the engine"
    assert adapters[0] - fired < 0.5, (adapters[0] - fired, aborts)
    idle_at = probe.scheduler_idle_at(fired)
    assert idle_at is not None
    time.sleep(0.2)  # anything still generated shows up now
    after = probe.tokens(request_id, after=fired)
    return {
        "close_to_fire_ms": round((fired - closed_at) * 1000, 2),
        "fire_to_abort_ms": round((first_abort_at - fired) * 1000, 2),
        "fire_to_engine_idle_ms": round((idle_at - fired) * 1000, 1),
        "tokens_before": probe.tokens(request_id) - after,
        "tokens_after": after,
    }


def test_disconnect_while_queued_behind_a_long_request(server: EngineServer) -> None:
    probe = server.probe
    long_id, queued_id = new_id("long"), new_id("queued")
    with RawClient(server.port) as long_client:
        long_client.post("/mw/generate", request(long_id, stream=True, api="cm"))
        long_client.read_until(lambda response: lines(response) >= 5)
        queued = RawClient(server.port).post(
            "/mw/generate", request(queued_id, stream=False, api="cm", max_tokens=50)
        )
        wait_for(lambda: probe.scheduler_now() == (1, 1), 30, "the second request queued")
        closed_at = queued.close()
        wait_for(lambda: queued_id in probe.fired, 2.0, "the middleware firing the token")
        fired = probe.fired[queued_id]
        wait_for(lambda: probe.scheduler_now() == (1, 0), LEAVES_ENGINE_WITHIN, "dequeue")
        dequeued_at = probe.scheduler_at(fired, running=1, waiting=0)
        assert dequeued_at is not None
        assert probe.tokens(queued_id) == 0  # never scheduled
        aborts = probe.aborts_of(queued_id)
        assert aborts, "no abort reached the engine"
        assert aborts[0][1:] == ([queued_id], False)  # the adapter's, not vLLM's own
        assert server.unfinished() == 1  # the long request goes on
        assert probe.tokens(long_id, after=fired) > 0
        MEASURED["queued"] = {
            "close_to_fire_ms": round((fired - closed_at) * 1000, 2),
            "fire_to_abort_ms": round((aborts[0][0] - fired) * 1000, 2),
            "fire_to_dequeued_ms": round((dequeued_at - fired) * 1000, 1),
            "tokens_after": 0,
        }
    check_left_engine(server, long_id, long_client.closed_at or 0.0)


@pytest.mark.parametrize(
    ("case", "stream", "api", "extra", "leave_after"),
    [
        ("stream", True, "helper", {}, 20),
        ("non_stream", False, "cm", {}, 20),
        ("n3", False, "cm", {"n": 3, "max_tokens": 300}, 10),
        ("two_prompts_background_tasks", True, "tasks", {"prompts": TWO_PROMPTS}, 10),
    ],
    ids=["stream-helper", "non-stream", "n-3", "two-prompts-in-background-tasks"],
)
def test_disconnect_mid_generation_through_abort_on_cancel(
    server: EngineServer, case: str, stream: bool, api: str, extra: Any, leave_after: int
) -> None:
    """A stream through `asgi_cancel.vllm.generate`, which counts the request into
    `current_token().usage` as the EngineCore saw it: the prompt it was given, the tokens it
    generated (all of them reached the app: vLLM drops none here), and those generated once the
    token fired. A whole answer; n=3, whose other two children wait (max_num_seqs=1), one abort
    of its id; two prompts whose producers are tasks nothing cancels: only the adapter's abort
    reaches them, one abort of both ids."""
    request_id = new_id(case)
    payload = request(request_id, stream=stream, api=api, **extra)
    client = RawClient(server.port).post("/mw/generate", payload)
    if stream:
        client.read_until(lambda response: lines(response) >= leave_after)
    else:
        wait_for(lambda: server.probe.tokens(request_id) >= leave_after, 30, "generation to start")
    if case == "n3":
        assert server.probe.scheduler_now() == (1, 2)
    measured = check_left_engine(server, request_id, client.close())
    assert measured["tokens_after"] <= MAX_TOKENS_AFTER_DISCONNECT, measured
    MEASURED[case] = measured
    probe = server.probe
    if api == "helper":
        wait_for(lambda: request_id in probe.usage, 5, "the request to be over")
        prompt, completion, after_cancel = probe.usage[request_id]
        assert prompt == probe.prompt_tokens(request_id) > 0
        assert completion == probe.tokens(request_id) >= 20
        assert after_cancel == probe.tokens(request_id, after=probe.fired[request_id])
        MEASURED["usage"] = {  # what the engine saw too (asserted above)
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "after_cancel": after_cancel,
        }
    else:
        ids = [f"{request_id}-p0", f"{request_id}-p1"] if api == "tasks" else [request_id]
        adapters = [called for _, called, internal in probe.aborts_of(request_id) if not internal]
        assert adapters == [ids]


def test_background_tasks_without_the_adapter_keep_generating(server: EngineServer) -> None:
    """The same producers, middleware but no adapter: cancelling the app does not reach them."""
    probe = server.probe
    request_id = new_id("orphans")
    payload = request(request_id, stream=True, api="tasks-bare", prompts=TWO_PROMPTS)
    client = RawClient(server.port).post("/mw/generate", payload)
    client.read_until(lambda response: lines(response) >= 10)
    client.close()
    wait_for(lambda: request_id in probe.fired, 2.0, "the middleware firing the token")
    fired = probe.fired[request_id]
    try:
        # Both producers are still generating after the middleware cancelled the app (checked
        # early: with a second to run, the shorter prompt may reach max_tokens on its own).
        time.sleep(0.2)
        assert server.unfinished() == 2
        time.sleep(0.8)
        after = probe.tokens(request_id, after=fired)
        assert probe.aborts_of(request_id) == []
        assert after > 30  # about 100 tokens/s, for nobody
        MEASURED["two_prompts_background_tasks_no_adapter_tokens_in_1s"] = after
    finally:
        server.abort(f"{request_id}-p0", f"{request_id}-p1")


@pytest.mark.parametrize(
    ("stream", "api"),
    [(True, "helper"), (False, "cm"), (True, "tasks")],
    ids=["stream-helper", "non-stream-cm", "stream-tasks"],
)
def test_completed_request_is_never_aborted(server: EngineServer, stream: bool, api: str) -> None:
    request_id = new_id("complete")
    with RawClient(server.port) as client:
        client.post("/mw/generate", request(request_id, stream=stream, api=api, max_tokens=30))
        response = client.read_all()
    assert status_of(response) == 200
    body = body_of(response)
    if stream:
        assert b'"end": "length"' in body
    else:
        assert json.loads(body)["id"] == request_id
    wait_for(lambda: server.unfinished() == 0, 5, "the request to finish")
    time.sleep(0.1)
    assert server.probe.aborts_of(request_id) == []
    assert request_id not in server.probe.fired


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_without_the_middleware_the_engine_generates_for_nobody(
    server: EngineServer, stream: bool
) -> None:
    """The bare app under uvicorn: nothing stops the request when its client leaves."""
    probe = server.probe
    request_id = new_id("bare")
    max_tokens = 300
    client = RawClient(server.port).post(
        "/bare/generate", request(request_id, stream=stream, api="none", max_tokens=max_tokens)
    )
    if stream:
        client.read_until(lambda response: lines(response) >= 20)
    else:
        wait_for(lambda: probe.tokens(request_id) >= 20, 30, "generation to start")
    closed_at = client.close()
    wait_for(lambda: server.unfinished() == 0, 30, "the request to run to its end")
    after = probe.tokens(request_id, after=closed_at)
    assert probe.aborts_of(request_id) == []
    assert after >= max_tokens - 60, after  # it generated nearly everything for nobody
    MEASURED[f"bare_{'stream' if stream else 'non_stream'}"] = {
        "tokens_before": probe.tokens(request_id) - after,
        "tokens_after": after,
        "close_to_engine_idle_ms": round(
            ((probe.scheduler_idle_at(closed_at) or time.monotonic()) - closed_at) * 1000
        ),
    }
