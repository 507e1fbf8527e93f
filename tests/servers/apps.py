"""The app module the real-server tests serve: one route table, and the apps built on it
(the websocket routes are in ws_apps.py).

Every endpoint runs on asyncio and trio servers alike (`/hold`, `/queued`, `/digest` and
`/stats`: asyncio only) and records what happens to it (`events.record`), keyed by the `id`
query parameter: `start` (the token's state, the pid; a stream records it once its headers are
sent), then `cancelled` (the exception's name, the token's state) or `done`. The route is the
path's last segment, so `/bare/slow` and `/wrapped/slow` are `/slow`:

- `/hello`: 200 "hello" (the runner's readiness probe; also what an unknown path gets).
- `/slow?t=30&cleanup=0`: sleeps `t` seconds, then 200 "slow done".
- `/stream?n=1500&every=0.02&kind=chunked&cleanup=0`: `n` chunks `chunk(i)`, `every` seconds
  apart; `kind=length` with a Content-Length, `kind=sse` as `data:` events.
- `/bg?work=0.3`: 200 "bg" at once, then works `work` seconds (post-response work, as
  Starlette's `BackgroundTasks`), then records `bg_done` with the token's state.
- `/upload?read=1`: reads the whole body (`read=0`: sleeps first), recording `received`, then
  sleeps; `http.disconnect` handed to it mid-body is recorded as `disconnect_message`.
- `/digest`: waits until `/open` was called, then reads the whole body and answers
  `<length> <sha256>` (the body it has not read yet is what `read_ahead` bounds); `/echo`:
  reads the whole body, answers it back; `/open`: opens the gate of every `/digest`.
- `/thread?t=1`: `time.sleep(t)` in a worker thread (`thread-start`, `thread-end`), then
  "thread done". `/hold`: takes the one slot of a queue forever (`holding`: an engine busy
  with another request); `/queued`: waits for it, then "queued done".
- `/refuse`: 401 after 50 ms, without reading its body (`Expect: 100-continue`).
- `/id`: the request id the middleware gave it; `/whoami`: this process's pid.
- `/inflight`: how many requests of the table are running, this one not counted.
- `/stats`: `{"tasks", "ours", "rss_kib"}`: every asyncio task, those running the middleware's
  or this module's code, VmRSS; `?stacks=1` adds where each of ours waits.
`cleanup=S`: the endpoint spends S seconds (shielded) in its `finally`, cancelled or not.

The apps, each `tests.servers.apps:<name>`:
- `app`: the table under the middleware with `on_cancelled=events.record_hook`; `bare_app`:
  the table alone (the control); `hookless_app`: under the middleware's defaults, `big_app`:
  with `read_ahead=1 MiB` (the soak, shutdown and hostile-client tests). Each records `exit`
  with what the server saw (`returned`, or the exception's name).
- `wire`: one process, both sides: `/bare/...` the table alone, `/wrapped/...` under the
  middleware with a registry and `timeout_header`, `/hung/...` the same behind an outer
  middleware whose `send` never returns once its client left (hypercorn-h2's send, or any
  outer middleware, can do that).
- `backend`: `app` with a registry (its `start` event has the caller's `X-Request-Id`);
  `gateway`: Starlette + httpx with `CancelTransport`, under the middleware, `/slow` and
  `/stream` proxied (whole, or streamed) to the backend on `$CHAIN_BACKEND_PORT`;
  `gateway_aiohttp`: the same with aiohttp and `cancel_trace_config` (its upstream call runs in
  a task of its own, which only the binding can stop); `gateway_middleware_only`: the
  middleware and a plain httpx client; `gateway_plain`: no asgi-cancel at all (the control).
- `cluster`: one process of a deployment that cancels by id through Redis
  (`$ASGI_CANCEL_REDIS_URL`; its `health_timeout` from `$ASGI_CANCEL_REDIS_HEALTH`, 10 s
  without it): `/slow` under the middleware with that registry, the cancel
  endpoint at `/v1/requests/{id}` (DELETE) answering with `x-worker-pid`, the rest bare.
- `metrics`: Starlette routes with templates under the middleware with
  `asgi_cancel.prometheus.CancelMetrics`: `/items/{item_id:int}` (`/slow`),
  `/stream/{name}`, each with `CLEANUP` s of cleanup; `/payments/{n}` excluded by prefix (a
  `/slow` of `CLEANUP` s); `/metrics`; `/v1/requests/{id}/cancel` (POST); `X-Request-Timeout`.

What only some apps need (Starlette, httpx, aiohttp, Redis, Prometheus) is imported when that
app is first called, in the server's process: every other server starts without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import CodeType

import anyio
import anyio.to_thread
import sniffio
import trio

from asgi_cancel import CancelOnDisconnectMiddleware, CancelRegistry, current_token

from . import events
from .events import (
    BIG_READ_AHEAD,
    CLEANUP,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    chunk,
    log_cancellations_to_stderr,
    query_param,
    record,
    record_hook,
    recording_exit,
    request_id,
    respond,
    serve_lifespan,
    token_state,
)

CANCELLED = (asyncio.CancelledError, trio.Cancelled)
OUR_FILES = (__file__, events.__file__)
PID = str(os.getpid()).encode()
Endpoint = Callable[[Scope, Receive, Send, str], Awaitable[None]]

# Bound to the server's loop at their first use (Python 3.10+).
GATE = asyncio.Event()
SLOT = asyncio.Semaphore(1)
inflight = 0


async def sleep(seconds: float) -> None:
    # Not anyio.sleep: its first call imports anyio's backend module, which blocks the event
    # loop for tens of ms, right when the first test closes its connection.
    if sniffio.current_async_library() == "trio":
        await trio.sleep(seconds)
    else:
        await asyncio.sleep(seconds)


async def cleanup(scope: Scope) -> None:
    seconds = float(query_param(scope, "cleanup", "0"))
    if seconds:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(seconds)


async def read_body(receive: Receive, rid: str, *, progress: bool = False) -> bytes | None:
    """The whole body, or None if `http.disconnect` came first (the middleware should have
    cancelled the app instead of handing it over)."""
    body = b""
    more_body = True
    while more_body:
        message = await receive()
        if message["type"] == "http.disconnect":
            record(rid, "disconnect_message", received=len(body))
            return None
        body += message.get("body", b"")
        more_body = message.get("more_body", False)
        if progress:
            record(rid, "received", received=len(body))
    return body


# -- the route table ------------------------------------------------------------------------------
async def hello(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, b"hello")


async def slow(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    try:
        await sleep(float(query_param(scope, "t", "30")))
    finally:
        await cleanup(scope)
    await respond(send, b"slow done")


async def stream(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    kind = query_param(scope, "kind", "chunked")
    count = int(query_param(scope, "n", "1500"))
    every = float(query_param(scope, "every", "0.02"))
    headers = [(b"content-type", b"text/event-stream" if kind == "sse" else b"text/plain")]
    if kind == "length":
        headers.append((b"content-length", b"%d" % sum(len(chunk(i)) for i in range(count))))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    record(rid, "start", **token_state(), pid=os.getpid())
    try:
        for index in range(count):
            body = b"data: " + chunk(index) + b"\n" if kind == "sse" else chunk(index)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await sleep(every)
    finally:
        await cleanup(scope)
    await send({"type": "http.response.body", "body": b""})


async def background(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, b"bg")
    # The response is complete: the client may now leave, this work must not be cancelled.
    await sleep(float(query_param(scope, "work", "0.3")))
    record(rid, "bg_done", **token_state())


async def upload(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    if query_param(scope, "read", "1") == "0":
        await sleep(30)
    if await read_body(receive, rid, progress=True) is not None:
        await sleep(30)
        await respond(send, b"upload done")


async def digest(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await GATE.wait()
    body = await read_body(receive, rid)
    if body is not None:
        await respond(send, f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode())


async def echo(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    body = await read_body(receive, rid)
    if body is not None:
        await respond(send, body)


async def open_gate(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    GATE.set()
    await respond(send, b"open")


def in_thread(rid: str, seconds: float) -> None:
    record(rid, "thread-start")
    time.sleep(seconds)
    record(rid, "thread-end")


async def thread(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await anyio.to_thread.run_sync(in_thread, rid, float(query_param(scope, "t", "1")))
    await respond(send, b"thread done")


async def hold(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    async with SLOT:
        record(rid, "holding")
        await asyncio.sleep(3600)


async def queued(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    async with SLOT:
        await respond(send, b"queued done")


async def refuse(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await sleep(0.05)
    await respond(send, b"refused", status=401)


async def given_id(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, (current_token().request_id or "").encode())


async def whoami(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, PID)


async def running(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, str(inflight - 1).encode())


async def process_stats(scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    await respond(send, json.dumps(stats(bool(query_param(scope, "stacks")))).encode())


ROUTES: dict[str, Endpoint] = {
    "/hello": hello,
    "/slow": slow,
    "/stream": stream,
    "/bg": background,
    "/upload": upload,
    "/digest": digest,
    "/echo": echo,
    "/open": open_gate,
    "/thread": thread,
    "/hold": hold,
    "/queued": queued,
    "/refuse": refuse,
    "/id": given_id,
    "/whoami": whoami,
    "/inflight": running,
    "/stats": process_stats,
}
RECORDS_ITS_OWN_START = {stream}


async def table(scope: Scope, receive: Receive, send: Send) -> None:
    """The route table as one raw ASGI app."""
    global inflight
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    rid = request_id(scope)
    endpoint = ROUTES.get("/" + scope["path"].rsplit("/", 1)[-1], hello)
    if endpoint not in RECORDS_ITS_OWN_START:
        record(rid, "start", **token_state(), pid=os.getpid())
    inflight += 1
    try:
        await endpoint(scope, receive, send, rid)
    except CANCELLED as exc:
        watcher = events.watcher_kind()
        record(rid, "cancelled", exc=type(exc).__name__, watcher=watcher, **token_state())
        raise
    finally:
        inflight -= 1
    record(rid, "done")


# -- /stats: the server process's tasks -----------------------------------------------------------
def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def stats(stacks: bool) -> dict[str, object]:
    tasks = asyncio.all_tasks()
    ours = [task for task in tasks if runs_our_code(task)]
    found: dict[str, object] = {"tasks": len(tasks), "ours": len(ours), "rss_kib": rss_kib()}
    if stacks:  # where each of our tasks waits: the soak's finding, shown
        found["stacks"] = [where(task) for task in ours]
    return found


def awaited(task: asyncio.Task[object]) -> Iterator[tuple[object, CodeType | None]]:
    """The task's await chain, outermost first: each awaitable and its code, if it has one."""
    awaitable: object = task.get_coro()
    while awaitable is not None:
        yield awaitable, getattr(awaitable, "cr_code", None) or getattr(awaitable, "gi_code", None)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)


def runs_our_code(task: asyncio.Task[object]) -> bool:
    """Whether the task's await chain passes through the middleware or this module.

    The server's own connection tasks are not ours: hypercorn keeps idle-timeout tasks of
    connections the clients reset for a long time, with or without the middleware.
    """
    return any(
        code is not None and ("asgi_cancel" in code.co_filename or code.co_filename in OUR_FILES)
        for _, code in awaited(task)
    )


def where(task: asyncio.Task[object]) -> list[str]:
    """`function file:line` per frame of the await chain, down to what is not a coroutine."""
    chain = []
    for awaitable, code in awaited(task):
        if code is None:
            chain.append(repr(awaitable)[:200])
            break
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        line = frame.f_lineno if frame is not None else "-"
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
        chain.append(f"{name} {code.co_filename.rsplit('/', 2)[-1]}:{line}")
    return chain


# -- the apps -------------------------------------------------------------------------------------
def built_on_first_call(build: Callable[[], ASGIApp]) -> ASGIApp:
    """`build()`'s app, built at the first call: in the server's process and event loop, and
    only in the processes that serve it."""
    built: list[ASGIApp] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if not built:
            built.append(build())
        await built[0](scope, receive, send)

    return app


def hung_after_disconnect(inner: ASGIApp) -> ASGIApp:
    """An outer middleware whose send blocks forever once its client has gone."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def hanging_send(message: Message) -> None:
            if gone:
                await sleep(3600)
            await send(message)

        await inner(scope, watching_receive, hanging_send)

    return middleware


def build_wire() -> ASGIApp:
    wrapped = CancelOnDisconnectMiddleware(
        table, registry=CancelRegistry(), timeout_header="x-request-timeout"
    )
    hung = hung_after_disconnect(wrapped)

    async def wire(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path.startswith("/wrapped/"):
            await wrapped(scope, receive, send)
        elif path.startswith("/hung/"):
            await hung(scope, receive, send)
        else:
            await table(scope, receive, send)

    return wire


def build_gateway(kind: str) -> ASGIApp:
    """The gateways of the module's docstring: `kind` is `binding`, `middleware`, `plain` or
    `aiohttp`."""
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Mount, Route

    upstream = f"http://127.0.0.1:{os.environ.get('CHAIN_BACKEND_PORT', '0')}"
    if kind == "aiohttp":
        import aiohttp

        from asgi_cancel.aiohttp import cancel_trace_config

        trace_configs = [cancel_trace_config(forward_to=["127.0.0.1"])]
        session = aiohttp.ClientSession(trace_configs=trace_configs)

        async def proxy_slow(request: Request) -> Response:
            async def call() -> bytes:
                params = dict(request.query_params)
                async with session.get(f"{upstream}/slow", params=params) as answer:
                    return await answer.read()

            # In a task of its own, as a gateway fanning out would: the binding stops it.
            body = await asyncio.get_running_loop().create_task(call())
            return Response(body)

        async def proxy_stream(request: Request) -> Response:
            answer = await session.get(f"{upstream}/stream", params=dict(request.query_params))

            async def chunks() -> AsyncIterator[bytes]:
                async for piece in answer.content.iter_any():
                    yield piece

            return StreamingResponse(chunks(), background=BackgroundTask(answer.release))

    else:
        import httpx

        from asgi_cancel.httpx import CancelTransport

        transport = CancelTransport(forward_to=["127.0.0.1"]) if kind == "binding" else None
        client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(60.0))

        async def proxy_slow(request: Request) -> Response:
            answer = await client.get(f"{upstream}/slow", params=request.query_params)
            return Response(answer.content, status_code=answer.status_code)

        async def proxy_stream(request: Request) -> Response:
            outgoing = client.build_request(
                "GET", f"{upstream}/stream", params=request.query_params
            )
            answer = await client.send(outgoing, stream=True)
            return StreamingResponse(answer.aiter_raw(), background=BackgroundTask(answer.aclose))

    routes = [Route("/slow", proxy_slow), Route("/stream", proxy_stream), Mount("/", table)]
    gateway = Starlette(routes=routes)
    if kind == "plain":
        return gateway
    registry = None if kind == "middleware" else CancelRegistry()
    return CancelOnDisconnectMiddleware(gateway, registry=registry)


def build_cluster() -> ASGIApp:
    from asgi_cancel import cancel_endpoint
    from asgi_cancel.redis import RedisBroker

    url = os.environ["ASGI_CANCEL_REDIS_URL"]
    health = float(os.environ.get("ASGI_CANCEL_REDIS_HEALTH", "10"))  # the broker's health_timeout
    registry = CancelRegistry(broker=RedisBroker(url, wait=2.0, health_timeout=health))
    endpoint = cancel_endpoint(registry, authorize=None)
    middleware = CancelOnDisconnectMiddleware(table, registry=registry)

    async def with_pid(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_pid(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-worker-pid", PID)]}
            await send(message)

        scope["root_path"] = "/v1/requests"
        await endpoint(scope, receive, send_with_pid)

    async def cluster(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path.startswith("/v1/requests/"):
            await with_pid(scope, receive, send)
        elif path == "/slow":
            await middleware(scope, receive, send)
        else:
            await table(scope, receive, send)

    return cluster


class Routed:
    """The table's `path` endpoint with `query` added to the request's query string, for a
    Starlette route: an ASGI app (not a function), so that Starlette routes to it as one. The
    table is given a copy of the scope: the middleware's (its route, its path) is left as is."""

    def __init__(self, path: str, query: str = "") -> None:
        self.path = path
        self.query = query.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = scope.get("query_string", b"")
        query = b"&".join(part for part in (given, self.query) if part)
        await table({**scope, "path": self.path, "query_string": query}, receive, send)


def build_metrics() -> ASGIApp:
    from prometheus_client import CollectorRegistry, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Mount, Route

    from asgi_cancel import cancel_endpoint
    from asgi_cancel.prometheus import CancelMetrics

    registry = CollectorRegistry()

    async def exposition(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain")

    cancel_registry = CancelRegistry()
    routes = [
        Route("/hello", Routed("/hello")),
        Route("/items/{item_id:int}", Routed("/slow", f"cleanup={CLEANUP}")),
        Route("/stream/{name}", Routed("/stream", f"cleanup={CLEANUP}")),
        Route("/payments/{n}", Routed("/slow", f"t={CLEANUP}")),
        Route("/metrics", exposition),
        Mount("/v1/requests", cancel_endpoint(cancel_registry, authorize=None)),  # test port only
    ]
    return CancelOnDisconnectMiddleware(
        Starlette(routes=routes),
        on_cancelled=CancelMetrics(registry=registry, namespace="test"),
        exclude=("/payments/", "/v1/requests/"),
        registry=cancel_registry,
        timeout_header="x-request-timeout",
    )


log_cancellations_to_stderr()
app = recording_exit(CancelOnDisconnectMiddleware(table, on_cancelled=record_hook))
bare_app = recording_exit(table)
hookless_app = recording_exit(CancelOnDisconnectMiddleware(table))
big_app = recording_exit(CancelOnDisconnectMiddleware(table, read_ahead=BIG_READ_AHEAD))
backend = recording_exit(
    CancelOnDisconnectMiddleware(table, on_cancelled=record_hook, registry=CancelRegistry())
)
wire = built_on_first_call(build_wire)
gateway = built_on_first_call(lambda: build_gateway("binding"))
gateway_middleware_only = built_on_first_call(lambda: build_gateway("middleware"))
gateway_plain = built_on_first_call(lambda: build_gateway("plain"))
gateway_aiohttp = built_on_first_call(lambda: build_gateway("aiohttp"))
cluster = built_on_first_call(build_cluster)
metrics = built_on_first_call(build_metrics)
