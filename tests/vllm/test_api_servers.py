"""`vllm serve --api-server-count 2`: two API server processes on one engine, each with the
middleware, a `CancelRegistry` and the Redis broker (`tests.vllm.cancel_by_id`), a real
`redis-server` (`tests/redis_server.py`).

vLLM accepts each connection in the least loaded API server, and aggregates the API servers'
Prometheus samples, so `/metrics` (answered by either) covers the engine. The route matrix's
cells run here too; then a cancel by id, issued on the broker from this test process (its own
registry and broker, as a gateway would hold them) or through the cancel endpoint of either
API server, aborts the engine request in whichever API server holds it, and an unknown id is
answered "not held" within the broker's bound.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from asgi_cancel import CancelRegistry
from asgi_cancel.redis import RedisBroker

from ..redis_server import RedisServer, running_redis
from ._harness import LEAVES_ENGINE_WITHIN, RawClient, import_vllm, report, wait_for
from ._openai import MAX_NUM_SEQS, OpenAIServer, serve
from ._routes import CELL_IDS, CELLS, ROUTES, aborted, events, leave_runs, payload, start

import_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SECRET = uuid.uuid4().hex
MIDDLEWARE = "tests.vllm.cancel_by_id.ProbedCancelByIdMiddleware"
MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def server(redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    log = tmp_path_factory.mktemp("vllm-api-servers") / "server.log"
    env = {"ASGI_CANCEL_REDIS_URL": redis.url, "ASGI_CANCEL_SECRET": SECRET}
    with serve(
        log,
        middleware=(MIDDLEWARE,),
        api_server_count=2,
        env=env,
        extra=("--enable-request-id-headers",),
    ) as instance:
        instance.variant = "asgi-cancel, --api-server-count 2"
        MEASURED["server_startup_s"] = round(instance.startup_seconds, 1)
        yield instance
        MEASURED["stale gauges refreshed by a 1-token request"] = instance.pokes
    report("api_server_count_2", MEASURED)


@pytest.fixture(autouse=True)
def idle_server(server: OpenAIServer) -> Iterator[None]:
    server.wait_idle(30, "server idle before the test")
    yield
    server.wait_idle(30, "server idle after the test")


@pytest.mark.parametrize(("route", "stream"), CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("moment", ["queued", "mid"])
def test_client_leaves(server: OpenAIServer, route: str, stream: bool, moment: str) -> None:
    leave_runs(server, route, moment, stream=stream, into=MEASURED)


# -- cancel by id across the API servers ------------------------------------------------------
PROBE_LINE = re.compile(r"probe pid=(\d+) path=\S+ header=(\S+) token=(\S+)")


def probes(server: OpenAIServer) -> dict[str, tuple[int, str]]:
    """X-Request-Id -> (the API server's pid, `current_token().request_id`), from the log."""
    return {match[2]: (int(match[1]), match[3]) for match in PROBE_LINE.finditer(server.log_text())}


def probed(server: OpenAIServer, request_id: str) -> bool:
    return request_id in probes(server)


def long_streams(server: OpenAIServer, count: int) -> tuple[dict[str, RawClient], dict[str, int]]:
    """`count` running streams, opened until both API servers hold some; their ids and pids."""
    clients: dict[str, RawClient] = {}
    while True:
        request_id, client = start(server, "completions", stream=True)
        clients[request_id] = client
        client.read_until(lambda response: events(response) >= 2)
        wait_for(functools.partial(probed, server, request_id), 5, "the probe's line")
        holders = {rid: probes(server)[rid][0] for rid in clients}
        if len(clients) >= count and len(set(holders.values())) == 2:
            return clients, holders
        assert len(clients) < MAX_NUM_SEQS, f"one API server took every connection: {holders}"


def broker_cancel(redis: RedisServer, request_id: str, **options: Any) -> tuple[bool, float]:
    """Cancel `request_id` on the broker from this test process (its own registry and broker,
    as a gateway would hold them): whether a process held it, and the seconds to the answer."""

    async def cancel() -> tuple[bool, float]:
        broker = RedisBroker(redis.url)
        registry = CancelRegistry(broker=broker, **options)
        registry.started()
        started = time.monotonic()
        held = await registry.acancel(request_id)
        answered = time.monotonic() - started
        await broker.aclose()
        return held, answered

    return asyncio.run(cancel())


def cancel_through_the_endpoint(
    server: OpenAIServer, request_id: str, method: str = "POST"
) -> httpx.Response:
    """`POST /v1/requests/{id}/cancel` or `DELETE /v1/requests/{id}`, in whichever API server
    vLLM gives the connection to (the least loaded)."""
    path = f"/v1/requests/{request_id}" + ("/cancel" if method == "POST" else "")
    headers = {"x-cancel-secret": SECRET}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=10)


def test_request_ids_are_vllms_own(server: OpenAIServer) -> None:
    """`current_token().request_id` is the `X-Request-Id` that vLLM builds its ids on."""
    request_id, client = start(server, "completions", stream=False, max_tokens=4)
    with client:
        client.read_all()
    wait_for(lambda: request_id in probes(server), 5, "the probe's line")
    assert probes(server)[request_id][1] == request_id
    assert f"Added request cmpl-{request_id}-0" in server.log_text()


@pytest.mark.parametrize("via", ["broker", "endpoint"])
def test_a_cancel_by_id_aborts_the_request_in_either_api_server(
    server: OpenAIServer, redis: RedisServer, via: str
) -> None:
    """On the broker, or `DELETE /v1/requests/{id}` of either API server: the request is held
    by one of the two, and aborted whichever it is (the endpoint's answer records which API
    server answered)."""
    clients, holders = long_streams(server, 2)
    api_servers = sorted(set(holders.values()))
    outcomes: dict[str, dict[str, Any]] = {}
    for request_id, client in clients.items():
        started = time.monotonic()
        if via == "broker":
            held, _ = broker_cancel(redis, request_id)
            assert held is True, request_id
        else:
            answer = cancel_through_the_endpoint(server, request_id, "DELETE")
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"id": request_id, "cancelled": True}
            assert answer.headers["x-request-id"] == request_id
        answered = time.monotonic() - started
        # Within LEAVES_ENGINE_WITHIN of asking, the answer's time included.
        within = LEAVES_ENGINE_WITHIN - answered
        engine_id = f"cmpl-{request_id}-0"
        wait_for(functools.partial(aborted, server, engine_id), within, "abort")
        outcomes[request_id] = {
            "answered_ms": round(answered * 1000, 1),
            "to_abort_logged_ms": round((time.monotonic() - started) * 1000, 1),
            "held_by": f"api server {api_servers.index(holders[request_id])}",
        }
        if via == "endpoint":
            served_by = re.findall(
                rf"cancel pid=(\d+) path=/v1/requests/{request_id}\b", server.log_text()
            )
            outcomes[request_id]["same_api_server"] = served_by == [str(holders[request_id])]
        # The stream ends for its client (cut: its response had started).
        client.read_all(timeout=10)
        client.close()
    server.wait_idle(LEAVES_ENGINE_WITHIN, "all aborted")
    MEASURED[f"cancel by id, {via}"] = {"api_servers": len(api_servers), "per_request": outcomes}


def test_cancel_by_id_aborts_a_non_streaming_request(
    server: OpenAIServer, redis: RedisServer
) -> None:
    generated = server.generated()
    request_id, client = start(server, "completions", stream=False)
    wait_for(lambda: server.generated() - generated >= 20, 30, "generation to start")
    before = server.metrics()
    started = time.monotonic()
    held, _ = broker_cancel(redis, request_id)
    response = client.read_all(timeout=30)
    client.close()
    server.wait_idle(30, "the request to end")
    after = server.metrics()
    MEASURED["cancel by id, non-streaming"] = {
        "held": held,
        "client_got": response.split(b"\r\n", 1)[0].decode(errors="replace"),
        "aborted": aborted(server, f"cmpl-{request_id}-0"),
        "finished_normally": after["vllm:request_success_total"]
        - before["vllm:request_success_total"],
        "tokens_after_cancel": after["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"],
        "to_engine_idle_s": round(time.monotonic() - started, 2),
    }
    assert held
    assert aborted(server, f"cmpl-{request_id}-0"), MEASURED["cancel by id, non-streaming"]


def test_unknown_id_is_answered_not_held_within_the_bound(
    server: OpenAIServer, redis: RedisServer
) -> None:
    held, answered = broker_cancel(redis, f"unknown-{uuid.uuid4().hex[:12]}", remember=0)
    assert held is False
    assert answered < 1.0 + 0.5  # the broker's `wait` (1 s), at most; every process answers
    denied = cancel_through_the_endpoint(server, f"unknown-{uuid.uuid4().hex[:8]}", "DELETE")
    assert denied.status_code == 404
    MEASURED["unknown id"] = {"answered_ms": round(answered * 1000, 1), "endpoint": 404}


# -- cancel by the id the client sees (asgi_cancel.vllm.OpenAIRequestIds) ---------------------
# The `id` of a response body or streamed chunk, as vLLM 0.32 names requests.
VISIBLE_ID = re.compile(rb'"id": ?"((?:chatcmpl-|cmpl-|resp_)[A-Za-z0-9._~:+=@-]+)"')
VISIBLE_ROUTES = ("chat", "completions", "responses")
# What vLLM names a request whose body says `request_id: X` (and no X-Request-Id header).
NAMED_FROM_BODY = {"chat": "chatcmpl-{}", "completions": "cmpl-{}", "responses": "{}"}


def response_header(response: bytes, name: bytes) -> str:
    head = response.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode()
    raise AssertionError(f"no {name!r} header in {head!r}")


def stream_without_an_id(
    server: OpenAIServer, route: str, headers: dict[str, str] | None = None
) -> tuple[RawClient, bytes, str]:
    """A stream whose client sent no id: it knows its request by the chunks' `id` only."""
    client = RawClient(server.port).post(ROUTES[route], payload(route, stream=True), headers)
    response = client.read_until(
        lambda received: VISIBLE_ID.search(received) is not None and events(received) >= 3
    )
    found = VISIBLE_ID.search(response)
    assert found is not None
    return client, response, found[1].decode()


def stopped(server: OpenAIServer, client: RawClient, visible: str) -> bytes:
    """The engine request `visible` aborted and the engine idle; what its client received."""
    wait_for(lambda: aborted(server, visible), LEAVES_ENGINE_WITHIN, f"{visible} aborted")
    response = client.read_all(timeout=10)
    client.close()
    server.wait_idle(LEAVES_ENGINE_WITHIN, "the request aborted")
    return response


@pytest.mark.parametrize(
    ("route", "named_by"),
    [*((route, "chunk-id") for route in VISIBLE_ROUTES), ("chat", "x-request-id")],
)
def test_the_id_in_a_stream_cancels_its_engine_request(
    server: OpenAIServer, route: str, named_by: str
) -> None:
    """The `id` of the stream's chunks; or, with `--enable-request-id-headers`, vLLM's own
    `X-Request-Id` (a fresh uuid: none was sent), kept on the response: both name the request."""
    client, response, visible = stream_without_an_id(server, route)
    asked = visible
    if named_by == "x-request-id":
        asked = response_header(response, b"x-request-id")
        assert asked not in visible  # vLLM's header is not the id it named the request
    started = time.monotonic()
    answer = cancel_through_the_endpoint(server, asked)
    answered = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == asked
    stopped(server, client, visible)
    by_route = MEASURED.setdefault("cancel by the id in the stream, answered ms", {})
    by_route[route if named_by == "chunk-id" else named_by] = round(answered * 1000, 1)


@pytest.mark.parametrize("route", VISIBLE_ROUTES)
def test_the_id_named_from_the_body_cancels_a_whole_answer(
    server: OpenAIServer, route: str
) -> None:
    """Not streaming: the body's `request_id` says what vLLM will name the request."""
    mine = f"mine-{uuid.uuid4().hex[:12]}"
    visible = NAMED_FROM_BODY[route].format(mine)
    generated = server.generated()
    client = RawClient(server.port).post(
        ROUTES[route], payload(route, stream=False) | {"request_id": mine}
    )
    wait_for(lambda: server.generated() - generated >= 20, 30, "generation to start")
    answer = cancel_through_the_endpoint(server, visible)
    assert answer.status_code == 200, answer.text
    response = stopped(server, client, visible)
    assert response.startswith(b"HTTP/1.1 499"), response[:200]


def test_control_without_the_aliases_the_visible_ids_find_nothing(server: OpenAIServer) -> None:
    """The same stream with `OpenAIRequestIds` skipped: 404 for the body's id and vLLM's
    header, and the engine generates on; the client leaving still aborts it."""
    client, response, visible = stream_without_an_id(
        server, "chat", headers={"x-test-no-aliases": "1"}
    )
    for unknown in (visible, response_header(response, b"x-request-id")):
        answer = cancel_through_the_endpoint(server, unknown)
        assert answer.status_code == 404, answer.text
        assert answer.json() == {"id": unknown, "cancelled": False}
    generated = server.generated()
    wait_for(lambda: server.generated() - generated >= 20, 30, "generation to go on")
    assert not aborted(server, visible)
    client.close()
    wait_for(lambda: aborted(server, visible), LEAVES_ENGINE_WITHIN, "aborted at the disconnect")
    server.wait_idle(LEAVES_ENGINE_WITHIN, "the request aborted")
