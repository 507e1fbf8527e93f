"""An OpenAI-compatible gateway in front of several example servers, with or without asgi-cancel.

The gateway forwards `/v1/completions` and `/v1/chat/completions` to the least-loaded backend
(fewest requests in flight through this gateway, round-robin among equals), streaming or not,
and answers `/metrics` with the backends' engine counters summed. With the binding
(`bind=True`, the default) it runs under `CancelOnDisconnectMiddleware` and sends upstream
through `asgi_cancel.httpx.CancelTransport`: when its client leaves (or the request is
cancelled by id, or its deadline passes), the upstream request is closed at once, and the
backend's own middleware sees its client, the gateway, leave and aborts its engine request.
The request id (`X-Request-Id`) is forwarded. Without the binding it is a plain httpx proxy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asgi_cancel.httpx import CancelTransport

from . import metrics
from .cancelling import CancelOptions
from .load import BACKEND_HEADER
from .openai_errors import EXCEPTION_HANDLERS, OpenAIError

logger = logging.getLogger("example_app.gateway")

# A generation can run for minutes; the gateway's clients set their own timeouts.
UPSTREAM_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
# Request headers not forwarded: hop-by-hop ones, and those httpx sets for the new request.
_DROPPED_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te"}
)
# Response headers not forwarded: the gateway's server frames the body itself, and adds its
# own `date` and `server`.
_DROPPED_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)


@dataclass
class Backend:
    url: str
    in_flight: int = 0


@dataclass
class _Balancer:
    backends: list[Backend]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self) -> Backend:
        """The backend with the fewest requests in flight; round-robin among equals."""
        start = next(self._turn) % len(self.backends)
        rotated = self.backends[start:] + self.backends[:start]
        return min(rotated, key=lambda backend: backend.in_flight)


def create_gateway(backend_urls: list[str], *, binding: CancelOptions | None) -> ASGIApp:
    """The gateway app over `backend_urls` (e.g. `["http://127.0.0.1:8001"]`).

    Args:
        backend_urls: the example servers to balance over.
        binding: run under `CancelOnDisconnectMiddleware` with these options (every request
            gets an id) and send upstream through `CancelTransport`, which forwards the id and
            the request's remaining budget (in `timeout_header`, in place of the client's).
            None: a plain httpx proxy with no asgi-cancel at all, the comparison's baseline.

    Raises:
        ValueError: no backends.
    """
    if not backend_urls:
        raise ValueError("backend_urls: the gateway needs at least one backend")
    dropped = _DROPPED_REQUEST
    transport: httpx.AsyncBaseTransport = httpx.AsyncHTTPTransport()
    if binding is not None:
        # The id and the budget go to our own backends only (CancelTransport's default is
        # nowhere: an upstream that is not ours learns nothing).
        backends = [urlsplit(url).netloc for url in backend_urls]
        transport = CancelTransport(
            forward_to=backends, timeout_header=binding.timeout_header or None
        )
        if binding.timeout_header:
            dropped |= {binding.timeout_header.lower()}
    client = httpx.AsyncClient(transport=transport, timeout=UPSTREAM_TIMEOUT)
    balancer = _Balancer([Backend(url.rstrip("/")) for url in backend_urls])
    proxy = _Proxy(client, balancer, binding is not None, dropped)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client:
            yield

    routes = [
        Route("/v1/completions", proxy.forward, methods=["POST"]),
        Route("/v1/chat/completions", proxy.forward, methods=["POST"]),
        Route("/v1/models", proxy.forward, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    return app if binding is None else binding.wrap(app, ids=True)


class _Proxy:
    def __init__(
        self,
        client: httpx.AsyncClient,
        balancer: _Balancer,
        bind: bool,
        dropped_request_headers: frozenset[str],
    ) -> None:
        self.client = client
        self.balancer = balancer
        self.bind = bind
        self.dropped_request_headers = dropped_request_headers

    async def health(self, request: Request) -> Response:
        urls = [backend.url for backend in self.balancer.backends]
        return JSONResponse({"status": "ok", "backends": urls, "binding": self.bind})

    async def forward(self, request: Request) -> Response:
        backend = self.balancer.pick()
        headers = [
            (name, value)
            for name, value in request.headers.items()
            if name not in self.dropped_request_headers
        ]
        outgoing = self.client.build_request(
            request.method,
            f"{backend.url}{request.url.path}",
            headers=headers,
            content=await request.body(),
        )
        backend.in_flight += 1
        release = _once(lambda: setattr(backend, "in_flight", backend.in_flight - 1))
        try:
            upstream = await self.client.send(outgoing, stream=True)
        except httpx.TransportError as error:
            release()
            if isinstance(error, asyncio.CancelledError):  # CancelTransport: we were cancelled
                raise
            logger.warning("backend %s: %s", backend.url, error)
            raise _bad_gateway(backend.url) from None
        except BaseException:
            release()
            raise
        response_headers = {
            name: value for name, value in upstream.headers.items() if name not in _DROPPED_RESPONSE
        }
        response_headers[BACKEND_HEADER] = backend.url  # which backend served it (the demo's)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return _UpstreamStream(upstream, response_headers, release)
        try:
            body = await upstream.aread()
        finally:
            await upstream.aclose()
            release()
        return Response(body, status_code=upstream.status_code, headers=response_headers)

    async def metrics(self, request: Request) -> Response:
        """The engine counters and gauges of every backend, summed (the demo reads these)."""
        samples = await asyncio.gather(
            *(self._backend_metrics(backend) for backend in self.balancer.backends)
        )
        registry = CollectorRegistry()
        registry.register(_Summed(samples))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def _backend_metrics(self, backend: Backend) -> dict[str, float]:
        response = await self.client.get(f"{backend.url}/metrics")
        response.raise_for_status()
        return metrics.parse(response.text)


class _Summed(Collector):
    def __init__(self, samples: list[dict[str, float]]) -> None:
        self.samples = samples

    def collect(self) -> list[Metric]:
        names = sorted({name for sample in self.samples for name in sample})
        families: list[Metric] = []
        for name in names:
            if not name.startswith("example_engine_") or "{" in name:
                continue
            total = sum(sample.get(name, 0.0) for sample in self.samples)
            if name.endswith("_total"):
                help_text = "Summed over the gateway's backends."
                families.append(CounterMetricFamily(name, help_text, value=total))
            else:
                families.append(GaugeMetricFamily(name, "Summed over the backends.", value=total))
        return families


class _UpstreamStream(StreamingResponse):
    """A backend's stream passed through; the upstream response is always closed at the end.

    Without the binding, Starlette's own listener (below ASGI spec 2.4) stops the iteration
    when the client leaves, and closing the upstream response closes the backend connection.
    With it, the middleware cancels this task and `CancelTransport` has closed it already.
    """

    def __init__(
        self, upstream: httpx.Response, headers: dict[str, str], release: Callable[[], None]
    ) -> None:
        self.upstream = upstream
        self.release = release
        super().__init__(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers=headers,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
            await self.upstream.aclose()


def _once(callback: Callable[[], object]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            callback()

    return call


def _bad_gateway(url: str) -> OpenAIError:
    return OpenAIError(502, f"The backend {url} could not be reached.", type="server_error")
