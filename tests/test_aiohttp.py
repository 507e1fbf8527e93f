"""`asgi_cancel.aiohttp.cancel_trace_config`: aiohttp calls bound to the request's token.

The upstream is a raw asyncio server on 127.0.0.1 that answers slowly (or streams slowly) and
records when its client, the aiohttp session, closes the connection: what the next hop's own
asgi-cancel would see as its client leaving. The same guarantees as `CancelTransport`.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, detach, shield
from asgi_cancel.aiohttp import UpstreamCancelled, cancel_trace_config
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .helpers import WATCHDOG, leave, respond, until

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


class Upstream:
    """Answers after `delay` s (`/slow`), or streams a chunk every 10 ms (`/stream`), or
    redirects to `redirect_to` if set."""

    def __init__(self, delay: float = 30.0) -> None:
        self.delay = delay
        self.redirect_to: str | None = None
        self.closed = asyncio.Event()
        self.heads: list[str] = []
        self.port = 0

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        self.heads.append(head)
        try:
            if self.redirect_to is not None:
                location = self.redirect_to.encode()
                writer.write(b"HTTP/1.1 302 Found\r\nLocation: %s\r\n" % location)
                writer.write(b"Content-Length: 0\r\n\r\n")
                await writer.drain()
            elif " /stream " in head:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(3000):
                    writer.write(b"6\r\nchunk\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
            else:
                reading = asyncio.ensure_future(reader.read())
                await asyncio.wait([reading], timeout=self.delay)
                if not reading.done():
                    reading.cancel()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            writer.close()

    def header(self, name: str) -> str | None:
        for line in self.heads[0].split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None


async def session(**options: object) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(trace_configs=[cancel_trace_config(**options)])  # type: ignore[arg-type]


async def run_until_cancelled(app: ASGIApp, registry: CancelRegistry, request_id: str) -> None:
    conn = ClientConnection()
    scope = http_scope(headers=[(b"x-request-id", request_id.encode())])
    task = asyncio.get_running_loop().create_task(
        conn.run(CancelOnDisconnectMiddleware(app, registry=registry), scope)
    )
    await until(lambda: request_id in registry)
    await asyncio.sleep(0.05)
    assert registry.cancel(request_id) is True
    await asyncio.wait_for(task, WATCHDOG)
    assert conn.status == 499


@pytest.mark.parametrize("where", ["request-task", "spawned-task"])
@pytest.mark.parametrize("path", ["/slow", "/stream"], ids=["pending", "streaming"])
async def test_an_upstream_call_is_closed_when_the_token_fires(
    anyio_backend: str, where: str, path: str
) -> None:
    outcome: list[str] = []
    async with Upstream() as upstream:
        client = await session()

        async def call() -> None:
            try:
                async with client.get(f"http://127.0.0.1:{upstream.port}{path}") as response:
                    async for _ in response.content.iter_any():
                        outcome.append("chunk")
            except (asyncio.CancelledError, aiohttp.ClientError) as exc:
                outcome.append(type(exc).__name__)
                raise

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if where == "request-task":
                await call()
            else:
                spawned = asyncio.get_running_loop().create_task(call())
                try:
                    await asyncio.sleep(30)
                finally:
                    await asyncio.gather(spawned, return_exceptions=True)

        registry = CancelRegistry()
        await run_until_cancelled(app, registry, "up-1")
        await asyncio.wait_for(upstream.closed.wait(), WATCHDOG)  # the upstream saw us leave
        await client.close()
    assert outcome[-1] in ("CancelledError", "ClientConnectionError", "ClientPayloadError")


async def test_fan_out_from_spawned_tasks_is_closed_too(anyio_backend: str) -> None:
    async with Upstream() as first, Upstream() as second:
        client = await session()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            start = asyncio.get_running_loop().create_task
            calls = [start(client.get(f"http://127.0.0.1:{u.port}/slow")) for u in (first, second)]
            try:
                await asyncio.sleep(30)
            finally:
                await asyncio.gather(*calls, return_exceptions=True)

        await run_until_cancelled(app, CancelRegistry(), "fan-out")
        for upstream in (first, second):
            await asyncio.wait_for(upstream.closed.wait(), WATCHDOG)
        await client.close()


async def call_once(
    upstream: Upstream, copied: dict[str, str] | None = None, **options: object
) -> None:
    client = await session(**options)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async with client.get(f"http://127.0.0.1:{upstream.port}/slow", headers=copied) as answer:
            await answer.read()
        await respond(send, b"", 204)

    conn = ClientConnection()
    scope = http_scope(headers=[(b"x-request-id", b"fw"), (b"x-request-timeout", b"20s")])
    middleware = CancelOnDisconnectMiddleware(
        app, registry=CancelRegistry(), timeout_header="x-request-timeout"
    )
    await asyncio.wait_for(conn.run(middleware, scope), WATCHDOG)
    await client.close()
    assert conn.status == 204


@pytest.mark.parametrize("configured", [True, False], ids=["configured", "nothing-by-default"])
async def test_the_id_and_budget_go_to_the_hosts_configured_and_win(
    anyio_backend: str, configured: bool
) -> None:
    async with Upstream(delay=0) as upstream:
        if configured:  # over the headers the app copied from its client
            copied = {"X-Request-Id": "client-chosen", "X-Request-Timeout": "10m"}
            await call_once(upstream, copied, forward_to=["127.0.0.1"])
        else:
            await call_once(upstream)
    assert upstream.header("x-request-id") == ("fw" if configured else None)
    budget = upstream.header("x-request-timeout")
    assert (budget is not None) is configured
    assert budget is None or 19000 < int(budget.removesuffix("ms")) <= 20000


@pytest.mark.parametrize(
    ("configured", "copied"),
    [(True, None), (False, None), (False, {"X-Request-Id": "client-chosen"})],
    ids=["to-a-host-configured", "away-to-another-host", "away-over-the-apps-own"],
)
async def test_a_redirect_carries_the_id_and_budget_to_the_hosts_configured_only(
    anyio_backend: str, configured: bool, copied: dict[str, str] | None
) -> None:
    """aiohttp sends every hop of a call with the same headers: the hop a redirect leads to
    gets the id and budget only if its own host is configured."""
    async with Upstream(delay=0) as first, Upstream(delay=0) as then:
        first.redirect_to = f"http://127.0.0.1:{then.port}/slow"
        hosts = [f"127.0.0.1:{first.port}"]
        if configured:
            hosts.append(f"127.0.0.1:{then.port}")
        await call_once(first, copied, forward_to=hosts)
    assert first.header("x-request-id") == "fw"
    assert first.header("x-request-timeout") is not None
    assert then.header("x-request-id") == ("fw" if configured else None)
    budget = then.header("x-request-timeout")
    assert (budget is not None) is configured
    assert budget is None or 19000 < int(budget.removesuffix("ms")) <= 20000


@pytest.mark.parametrize("protect", ["detach", "shield"])
async def test_calls_of_a_detached_or_shielded_request_run_to_the_end(
    anyio_backend: str, protect: str
) -> None:
    async with Upstream(delay=0.2) as upstream:
        client = await session()
        got: list[bytes] = []

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            with detach() if protect == "detach" else shield():
                async with client.get(f"http://127.0.0.1:{upstream.port}/slow") as answer:
                    got.append(await answer.read())

        conn = await leave(CancelOnDisconnectMiddleware(app), when=lambda: upstream.heads != [])
        await client.close()
    assert conn.app_exception is None
    assert got == [b"ok"]


async def test_a_call_after_the_request_should_stop_is_refused(anyio_backend: str) -> None:
    client = await session()
    refused: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def late_call() -> None:
            await asyncio.sleep(0.1)  # the client has left by now
            try:
                await client.get("http://127.0.0.1:9/never")
            except UpstreamCancelled as exc:
                refused.append(str(exc))

        spawned = asyncio.get_running_loop().create_task(late_call())
        try:
            await asyncio.sleep(30)
        finally:
            await spawned

    conn = await leave(CancelOnDisconnectMiddleware(app))  # once the middleware listens
    await client.close()
    assert conn.app_exception is None
    assert refused == ["request cancelled: client disconnected"]
