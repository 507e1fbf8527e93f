"""Request ids a client can see and cancel by: the id on the response (`X-Request-Id`, the
registry's header) and `CancelRegistry.alias()` (ids the app shows instead of the request's)."""

from __future__ import annotations

import gc
import sys
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token
from asgi_cancel._token import current_request
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from . import helpers
from .helpers import WATCHDOG, noting_cancellation, respond, running, slow_app, until

pytestmark = pytest.mark.anyio


def with_header(value: bytes, path: str = "/", name: bytes = b"x-request-id") -> Scope:
    return http_scope("GET", path, headers=[(name, value)])


def response_headers(conn: ClientConnection) -> list[tuple[bytes, bytes]]:
    start = next(m for m in conn.sent if m["type"] == "http.response.start")
    return [(bytes(name), bytes(value)) for name, value in start["headers"]]


def ids_in(conn: ClientConnection, name: bytes = b"x-request-id") -> list[bytes]:
    return [value for key, value in response_headers(conn) if key.lower() == name]


async def answer_with_the_id(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with its token's id and the one in the scope's state, if any."""
    state = scope.get("state", {}).get("request_id")
    await respond(send, f"{current_token().request_id} {state}".encode())


async def served(app: ASGIApp, scope: Scope, **options: Any) -> ClientConnection:
    return await helpers.served(CancelOnDisconnectMiddleware(app, **options), scope)


@pytest.mark.parametrize(
    ("header", "sent", "status"),
    [
        ("X-Request-Id", b"client-7", 200),
        ("X-Correlation-Id", b"corr-1", 200),
        ("X-Request-Id", b"bad id\n", 400),
    ],
    ids=["sent", "the-registry-header", "refused"],
)
async def test_the_id_the_client_sent_is_on_the_response_unless_refused(
    header: str, sent: bytes, status: int
) -> None:
    name = header.lower().encode()
    scope = with_header(sent, name=name)
    conn = await served(answer_with_the_id, scope, registry=CancelRegistry(header=header))
    assert conn.status == status
    if status == 200:
        assert conn.body == b"%s %s" % (sent, sent)  # the token's and the scope's state's
        assert response_headers(conn) == [(name, sent)]  # under the registry's header only
    else:
        assert ids_in(conn) == []  # a refused id is never echoed


async def test_a_generated_id_is_on_the_response_and_new_each_time() -> None:
    registry = CancelRegistry()
    conns = [await served(answer_with_the_id, http_scope(), registry=registry) for _ in (1, 2)]
    [first], [second] = ids_in(conns[0]), ids_in(conns[1])
    assert (len(first), len(second)) == (24, 24)
    assert first != second
    assert conns[0].body == b"%s %s" % (first, first)  # the token's and the scope's state's


@pytest.mark.parametrize(
    "options",
    [{}, {"timeout": 30.0}, {"registry": CancelRegistry(), "exclude": ("/payments",)}],
    ids=["no-registry", "deadline-only", "excluded-route"],
)
async def test_no_id_on_a_response_without_one(options: dict[str, Any]) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if "exclude" not in options:  # (an excluded route has no token at all)
            assert current_token().request_id is None  # the header is not read either
        await respond(send)

    conn = await served(app, with_header(b"sent-1", "/payments/1"), **options)
    assert conn.status == 200
    assert ids_in(conn) == []


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "generator"])
@pytest.mark.parametrize("own_id", [False, True], ids=["ours-added", "the-apps-kept"])
async def test_the_apps_headers_are_all_sent_unchanged_and_its_own_id_kept(
    own_id: bool, one_shot: bool
) -> None:
    """ASGI allows any iterable of headers: a generator is read once, and none is lost; the
    app's list is not changed in place; an id the app set itself (in any case) is kept."""
    names = [b"content-type", b"X-Request-Id"] if own_id else [b"content-type"]
    headers = [(name, b"app-" + name) for name in names]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        sent = iter(headers) if one_shot else headers
        await send({"type": "http.response.start", "status": 200, "headers": sent})
        await send({"type": "http.response.body", "body": b"ok"})

    conn = await served(app, with_header(b"client-7"), registry=CancelRegistry())
    ours = [] if own_id else [(b"x-request-id", b"client-7")]
    assert response_headers(conn) == [(name, b"app-" + name) for name in names] + ours
    assert headers == [(name, b"app-" + name) for name in names]


async def test_after_the_start_the_body_goes_to_the_servers_send_directly() -> None:
    """The id costs one call on the response start; none per body chunk."""
    server_sends: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        cycle: Any = current_request()
        server_sends.append(cycle.target)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        server_sends.append(cycle.target)
        await send({"type": "http.response.body", "body": b"x"})

    conn = await served(app, http_scope(), registry=CancelRegistry())
    before, after = server_sends
    assert before != conn.send  # the wrapper, until the start
    assert after == conn.send
    assert len(ids_in(conn)) == 1


async def test_the_middlewares_own_answers_carry_the_id() -> None:
    registry = CancelRegistry()
    events: list[str] = []
    middleware = CancelOnDisconnectMiddleware(slow_app(events), registry=registry)
    async with running(middleware, with_header(b"stopped-1")) as conn:
        await until(lambda: "stopped-1" in registry)
        assert registry.cancel("stopped-1") is True
    assert conn.status == 499
    assert ids_in(conn) == [b"stopped-1"]
    before = await served(answer_with_the_id, with_header(b"early-1"), registry=registry)
    registry.cancel("early-1")
    early = await served(answer_with_the_id, with_header(b"early-1"), registry=registry)
    assert (before.status, early.status) == (200, 499)  # cancelled before it came
    assert ids_in(early) == [b"early-1"]
    scope = http_scope(headers=[(b"x-request-id", b"late-1"), (b"x-request-timeout", b"0")])
    late = await served(
        answer_with_the_id, scope, registry=registry, timeout_header="x-request-timeout"
    )
    assert late.status == 504
    assert ids_in(late) == [b"late-1"]


# -- aliases ------------------------------------------------------------------------------------
def aliasing_app(events: list[str], registry: CancelRegistry, alias: str | None) -> ASGIApp:
    """Names itself `alias` too (as vLLM's adapter does), then sleeps until cancelled."""
    if alias is None:
        return slow_app(events)
    return slow_app(events, first=lambda: events.append(f"aliased:{registry.alias(alias)}"))


@pytest.mark.parametrize("aliased", [True, False], ids=["aliased", "control-no-alias"])
async def test_a_request_is_cancelled_by_its_alias(aliased: bool) -> None:
    events: list[str] = []
    registry = CancelRegistry()
    app = aliasing_app(events, registry, "chatcmpl-abc" if aliased else None)
    middleware = CancelOnDisconnectMiddleware(app, registry=registry)
    async with running(middleware, with_header(b"abc")) as conn:
        await until(lambda: "body:" in events)
        assert ("chatcmpl-abc" in registry) is aliased
        assert registry.cancel("chatcmpl-abc") is aliased
        if not aliased:  # the control: it runs on, until cancelled by its own id
            await anyio.sleep(0.05)
            assert "cancelled" not in events
            assert registry.cancel("abc") is True
    assert conn.status == 499
    assert events[: 1 if aliased else 0] == (["aliased:True"] if aliased else [])
    assert "chatcmpl-abc" not in registry
    assert len(registry) == 0  # the alias left with the request


async def test_an_alias_is_refused_outside_a_request_after_it_or_malformed() -> None:
    registry = CancelRegistry()
    assert registry.alias("chatcmpl-1") is False  # no request
    results: list[bool] = []
    done = anyio.Event()

    async def later() -> None:
        await done.wait()
        results.append(registry.alias("too-late"))

    async with anyio.create_task_group() as group:

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            results.append(registry.alias("bad alias"))
            results.append(registry.alias(str(current_token().request_id)))  # its own: a no-op
            results.append(CancelRegistry().alias("other-registry"))
            group.start_soon(later)  # a task in the request's context that outlives it
            await respond(send)

        conn = await served(app, with_header(b"own-1"), registry=registry)
        done.set()
    assert conn.status == 200
    assert results == [False, True, False, False]
    assert len(registry) == 0


async def test_a_cancel_by_an_alias_before_it_was_one_stops_the_request() -> None:
    events: list[str] = []
    registry = CancelRegistry()
    assert registry.cancel("chatcmpl-early") is False  # nothing has that name yet: remembered
    middleware = CancelOnDisconnectMiddleware(
        aliasing_app(events, registry, "chatcmpl-early"), registry=registry
    )
    async with running(middleware, with_header(b"early")) as conn:
        pass
    assert conn.status == 499
    assert events == ["aliased:True", "body:", "cancelled"]
    assert len(registry) == 0


class HypercornLike(helpers.QueueServer):
    """A server the middleware recognises by its `send` (hypercorn's h1 stream)."""

    __module__ = "hypercorn.protocol.http_stream"


@pytest.mark.parametrize("recognised", [True, False], ids=["hypercorn", "control-unknown"])
async def test_a_stopped_stream_is_still_cut_behind_the_id_on_the_response(
    recognised: bool,
) -> None:
    """The id's wrapper of `send` does not hide the server: a stream stopped by id is cut
    (no final body message) where the server is recognised, ended cleanly where not."""
    registry = CancelRegistry()
    events: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.lowlevel.checkpoint()  # the response starts after the app's first step
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        with noting_cancellation(events):
            await anyio.sleep(WATCHDOG * 2)

    server = HypercornLike(helpers.REQUEST_DONE)
    send = server.send if recognised else (lambda message: server.send(message))
    middleware = CancelOnDisconnectMiddleware(app, registry=registry)
    with anyio.fail_after(WATCHDOG):
        async with anyio.create_task_group() as group:
            group.start_soon(middleware, with_header(b"cut-1"), server.receive, send)
            await until(lambda: len(server.sent) == 2)
            assert registry.cancel("cut-1") is True
    assert events == ["cancelled"]
    assert server.sent[0]["headers"] == [(b"x-request-id", b"cut-1")]
    ends = [m for m in server.sent[2:] if not m.get("more_body", False)]
    assert (ends == []) is recognised


@pytest.mark.asyncio_only(reason="on trio a finished cycle waits for the garbage collector")
@pytest.mark.parametrize("sent", [True, False], ids=["sent-id", "generated-id"])
async def test_a_request_with_an_id_is_freed_by_refcount(sent: bool) -> None:
    """The id on the response leaves no reference cycle: the request's cycle (and its token)
    goes as soon as the request ends, not at the garbage collector's next pass."""
    tokens: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        tokens.append(current_token())
        await respond(send)

    async def one_request() -> None:  # its locals are gone when it returns
        scope = with_header(b"freed-1") if sent else http_scope()
        await served(app, scope, registry=CancelRegistry())

    gc.disable()
    try:
        await one_request()
        # getrefcount: the list's reference and the argument's, nothing else (computed
        # outside the assert: pytest's rewriting would hold one more reference).
        count = sys.getrefcount(tokens[0])
        assert count == 2
    finally:
        gc.enable()
