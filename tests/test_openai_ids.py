"""`asgi_cancel.vllm.OpenAIRequestIds` against an app shaped like vLLM's OpenAI server: the
ids it shows its client cancel the request. The real-vLLM proof is in
tests/vllm/test_api_servers.py."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import anyio
import pytest
from starlette.requests import Request

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send
from asgi_cancel.vllm import OpenAIRequestIds

from .helpers import respond, running, served, until

pytestmark = pytest.mark.anyio


@dataclass
class RequestResponseMetadata:  # what vLLM 0.32 stores on raw_request.state
    request_id: str


def vllm_like(events: list[str], *, header: bytes | None = None) -> ASGIApp:
    """Names the request `chatcmpl-{X-Request-Id or body request_id}` on `request.state`, as
    vLLM's chat handler does, answers with `header` as `X-Request-Id` (vLLM's
    `--enable-request-id-headers`) and streams until cancelled."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        body = json.loads(await request.body() or b"{}")
        base = request.headers.get("x-request-id") or body.get("request_id", "random-1")
        request.state.request_metadata = RequestResponseMetadata(f"chatcmpl-{base}")
        events.append("named")
        headers = [(b"content-type", b"text/event-stream")]
        if header is not None:
            headers.append((b"x-request-id", header))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            while True:
                chunk = json.dumps({"id": f"chatcmpl-{base}"}).encode()
                event = b"data: " + chunk + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await anyio.sleep(0.01)
        except anyio.get_cancelled_exc_class():
            events.append("cancelled")
            raise

    return app


def posting(app: ASGIApp, body: dict[str, str]) -> AbstractAsyncContextManager[ClientConnection]:
    """`app` serving a POST of `body` for a client that stays while the block runs."""
    conn = ClientConnection(body=json.dumps(body).encode())
    return running(app, http_scope("POST", "/v1/chat/completions"), conn)


@pytest.mark.parametrize("wrapped", [True, False], ids=["aliased", "control-unwrapped"])
async def test_the_body_id_cancels_the_request(wrapped: bool) -> None:
    events: list[str] = []
    registry = CancelRegistry()
    app = vllm_like(events)
    inner = OpenAIRequestIds(app, registry) if wrapped else app
    middleware = CancelOnDisconnectMiddleware(inner, registry=registry)
    async with posting(middleware, {"request_id": "body-7"}) as conn:
        await until(lambda: "named" in events)
        assert registry.cancel("chatcmpl-body-7") is wrapped
        if not wrapped:  # the control: not found, and it streams on
            chunks = conn.body_chunks
            await until(lambda: conn.body_chunks > chunks + 2)
            assert "cancelled" not in events
            conn.disconnect()
    assert events == ["named", "cancelled"]
    assert "chatcmpl-body-7" not in registry


async def test_the_header_vllm_answers_with_cancels_the_request() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    app = OpenAIRequestIds(vllm_like(events, header=b"vllm-own-uuid"), registry)
    middleware = CancelOnDisconnectMiddleware(app, registry=registry)
    async with posting(middleware, {}) as conn:
        await conn.wait_for_body_chunks(1)
        assert "chatcmpl-random-1" in registry
        assert registry.cancel("vllm-own-uuid") is True
    assert events == ["named", "cancelled"]
    ids = [value for name, value in conn.sent[0]["headers"] if name == b"x-request-id"]
    assert ids == [b"vllm-own-uuid"]  # vLLM's header kept, ours not added


async def test_headers_given_as_a_one_shot_iterable_all_reach_the_client() -> None:
    """ASGI allows any iterable of headers: read once for the id, they are all still sent."""
    registry = CancelRegistry()
    headers = [(b"content-type", b"text/plain"), (b"x-request-id", b"vllm-own-2")]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": iter(headers)})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = CancelOnDisconnectMiddleware(OpenAIRequestIds(app, registry), registry=registry)
    conn = await served(middleware, http_scope("POST"))
    assert list(conn.sent[0]["headers"]) == headers


async def test_outside_a_request_with_an_id_everything_passes_through() -> None:
    seen: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope.get("state"))
        await respond(send)

    wrapped = OpenAIRequestIds(app, CancelRegistry())
    for outer in (wrapped, CancelOnDisconnectMiddleware(wrapped)):
        assert (await served(outer, http_scope())).status == 200
    assert all(type(state) is not dict or state == {} for state in seen)
    assert not any(type(state).__name__ == "_AliasingState" for state in seen)


def test_the_registry_must_be_a_registry() -> None:
    with pytest.raises(ValueError, match="registry"):
        OpenAIRequestIds(respond, None)  # type: ignore[arg-type]
