"""`asgi_cancel.httpx.CancelTransport`: outgoing requests bound to the request's token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, detach, shield
from asgi_cancel._forwarding import ForwardTo
from asgi_cancel.httpx import CancelTransport, UpstreamCancelled
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import Receive, Scope, Send

from .helpers import WATCHDOG, leave, respond, until

pytestmark = pytest.mark.anyio


class SlowUpstream(httpx.AsyncBaseTransport):
    """Answers after `delay` seconds, with a body streamed one chunk every 10 ms (the first
    request, with a redirect to `redirect_to` if given)."""

    def __init__(
        self, delay: float = 0.0, chunks: int = 3000, redirect_to: str | None = None
    ) -> None:
        self.delay = delay
        self.chunks = chunks
        self.redirect_to = redirect_to
        self.events: list[str] = []
        self.headers: list[httpx.Headers] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        if self.redirect_to is not None and len(self.headers) == 1:
            return httpx.Response(302, headers={"location": self.redirect_to})
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.events.append("send cancelled")
            raise
        return httpx.Response(200, stream=SlowBody(self.events, self.chunks))


class SlowBody(httpx.AsyncByteStream):
    def __init__(self, events: list[str], chunks: int) -> None:
        self.events = events
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            yield b"chunk\n"
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.events.append("read cancelled")
                raise

    async def aclose(self) -> None:
        self.events.append("closed")


def scope_with_id(request_id: str) -> Scope:
    return http_scope(
        headers=[(b"x-request-id", request_id.encode()), (b"x-request-timeout", b"20s")]
    )


async def run_gateway(upstream: SlowUpstream, *, stream: bool, outcome: list[str]) -> None:
    """A gateway whose upstream call runs in a task of its own (not the app task): only the
    transport can stop it when the request is cancelled."""
    registry = CancelRegistry()
    client = httpx.AsyncClient(transport=CancelTransport(upstream), base_url="http://up")

    async def call_upstream() -> None:
        try:
            if stream:
                async with client.stream("GET", "/") as response:
                    async for _ in response.aiter_raw():
                        outcome.append("chunk")
            else:
                await client.get("/")
        except UpstreamCancelled as exc:
            outcome.append(f"upstream cancelled: {exc}")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.get_running_loop().create_task(call_upstream())
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.wait_for(asyncio.shield(task), WATCHDOG)

    conn = ClientConnection()
    run = asyncio.get_running_loop().create_task(
        conn.run(CancelOnDisconnectMiddleware(app, registry=registry), scope_with_id("g1"))
    )
    await until(lambda: "g1" in registry and (not stream or "chunk" in outcome))
    await asyncio.sleep(0.02)
    assert registry.cancel("g1") is True
    await asyncio.wait_for(run, WATCHDOG)
    assert conn.status == 499  # the gateway app sent nothing: the middleware's answer
    await client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["pending", "streaming"])
async def test_an_upstream_call_is_cancelled_when_the_token_fires(stream: bool) -> None:
    upstream = SlowUpstream(delay=0 if stream else 30)
    outcome: list[str] = []
    await run_gateway(upstream, stream=stream, outcome=outcome)
    assert outcome[-1] == "upstream cancelled: request cancelled: cancelled by id"
    if stream:  # the response being read is closed
        assert "closed" in upstream.events
    else:  # the only outcome: no chunk was read, the send was cancelled
        assert (outcome, upstream.events) == (outcome[-1:], ["send cancelled"])


async def forwarded_headers(
    transport: CancelTransport, url: str, location: str | None, copied: dict[str, str] | None
) -> list[httpx.Headers]:
    """The headers an upstream at `url` receives from a request with id `fw` and 20 s left,
    whose app copies `copied` from its client onto the upstream call: one per hop, the
    redirect to `location` (if not None) followed."""
    upstream = SlowUpstream(chunks=2, redirect_to=location)
    transport.transport = upstream
    client = httpx.AsyncClient(transport=transport, follow_redirects=True)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await client.get(url, headers={"x-other": "1", **(copied or {})})
        await response.aclose()
        await respond(send, b"", 204)

    middleware = CancelOnDisconnectMiddleware(
        app, registry=CancelRegistry(), timeout_header="x-request-timeout"
    )
    conn = ClientConnection()
    await asyncio.wait_for(conn.run(middleware, scope_with_id("fw")), WATCHDOG)
    await client.aclose()
    assert conn.status == 204
    return upstream.headers


def remaining_ms(headers: httpx.Headers) -> int:
    return int(headers["x-request-timeout"].removesuffix("ms"))


def internal(scheme: str, host: str, port: int | None) -> bool:
    return host.endswith(".internal")


API = "http://api.example.com/"  # a host no test configures
COPIED = {"x-request-id": "client-chosen", "x-request-timeout": "10m"}
HOPS: dict[str, tuple[ForwardTo, str, str | None, dict[str, str] | None, list[str | None]]] = {
    # forward_to, the call, where its answer redirects (None: nowhere), what the app copied:
    # each hop's id (None: neither an id nor a deadline)
    "host": (["up"], "http://up/", None, None, ["fw"]),
    "host-and-port": (["UP:8000"], "http://up:8000/", None, None, ["fw"]),
    "default-port": (["up:80"], "http://up/", None, None, ["fw"]),
    "predicate": (internal, "https://a.internal/", None, None, ["fw"]),
    # An app that copies its client's headers upstream: the client chooses neither the next
    # hop's id nor a longer deadline.
    "the-gateways-own-win": (["up"], "http://up/", None, COPIED, ["fw"]),
    "default-nowhere": ((), "http://up/", None, None, [None]),
    "other-host": (["up"], API, None, None, [None]),
    "other-port": (["up:8000"], "http://up:9000/", None, None, [None]),
    # httpx copies a request's headers onto the one that follows its redirect: each hop gets
    # them only if its own host is configured, with the deadline that remains then.
    "away-to-another-host": (["up"], "http://up/", API, None, ["fw", None]),
    "away-over-the-apps-own": (["up"], "http://up/", API, COPIED, ["fw", None]),
    "to-a-host-configured": (["up", "b:8000"], "http://up/", "http://b:8000/", None, ["fw", "fw"]),
    "within-the-host": (["up"], "http://up/", "/next", None, ["fw", "fw"]),
    # Not ours to take away: the app's own headers to a host not configured, as without us.
    "the-apps-own-elsewhere": (["up"], "http://a.example.com/", API, COPIED, ["client-chosen"] * 2),
}


@pytest.mark.parametrize(
    ("forward_to", "url", "location", "copied", "ids"), HOPS.values(), ids=HOPS
)
async def test_the_id_and_the_remaining_deadline_go_to_the_hosts_configured_only(
    forward_to: ForwardTo,
    url: str,
    location: str | None,
    copied: dict[str, str] | None,
    ids: list[str | None],
) -> None:
    hops = await forwarded_headers(CancelTransport(forward_to=forward_to), url, location, copied)
    # One id each (`get` joins repeated headers): ours, the app's own, or none.
    assert [headers.get("x-request-id") for headers in hops] == ids
    for headers, request_id in zip(hops, ids, strict=True):
        assert headers["x-other"] == "1"
        if request_id == "fw":
            assert 19000 < remaining_ms(headers) <= 20000
        else:  # none of ours: the app's own if any
            assert headers.get("x-request-timeout") == (request_id and COPIED["x-request-timeout"])


NOT_HOSTS = ["up", ["http://up"], ["up/path"], [""], [42], ["user@up"], ["up:99999"]]


@pytest.mark.parametrize(
    ("options", "match"),
    [({"forward_to": bad}, "forward_to") for bad in NOT_HOSTS]
    + [({option: "X Request Id"}, option) for option in ("request_id_header", "timeout_header")],
)
def test_options_that_are_not_hosts_or_header_names_are_refused(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        CancelTransport(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("protect", ["detach", "shield"])
async def test_upstream_calls_of_a_detached_or_shielded_request_run_to_the_end(
    protect: str,
) -> None:
    """`detach()` and `shield()` mean the same to the transport as to the app task."""
    upstream = SlowUpstream(delay=0.2, chunks=5)
    client = httpx.AsyncClient(transport=CancelTransport(upstream), base_url="http://up")
    got: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        with detach() if protect == "detach" else shield():
            async with client.stream("GET", "/") as response:
                async for chunk in response.aiter_raw():
                    got.append(chunk.decode())
        got.append("done")

    # The client leaves while the upstream call waits for its response.
    conn = await leave(CancelOnDisconnectMiddleware(app), when=lambda: upstream.headers != [])
    await client.aclose()
    assert conn.app_exception is None
    assert got == ["chunk\n"] * 5 + ["done"]
    assert upstream.events == ["closed"]


async def test_outside_a_request_it_passes_through() -> None:
    upstream = SlowUpstream()
    async with httpx.AsyncClient(transport=CancelTransport(upstream)) as client:
        async with client.stream("GET", "http://up/") as response:
            async for _ in response.aiter_raw():
                break
    assert "x-request-id" not in upstream.headers[0]
