"""asgi_cancel.otel: the request's span gets the cancel event, through the SDK's exporter."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.otel import EVENT, TraceCancellations
from asgi_cancel.testing import ClientConnection, http_scope
from asgi_cancel.types import ASGIApp, Receive, Scope, Send

from .helpers import leave, respond, slow_app, streaming_app, with_watchdog

pytestmark = pytest.mark.anyio


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def traced(app: ASGIApp, exporter: InMemorySpanExporter) -> ASGIApp:
    """What OpenTelemetry's ASGI middleware does: one current span around the request."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def tracing(scope: Scope, receive: Receive, send: Send) -> None:
        with tracer.start_as_current_span(f"{scope['method']} {scope['path']}"):
            await app(scope, receive, send)

    return tracing


@pytest.mark.parametrize(
    ("stream", "phase"), [(False, "before_response"), (True, "mid_stream")], ids=["slow", "stream"]
)
async def test_cancelled_request_span_gets_event_and_attributes(
    exporter: InMemorySpanExporter, stream: bool, phase: str
) -> None:
    events: list[str] = []
    inner = streaming_app(events) if stream else slow_app(events, read=False)
    app = traced(CancelOnDisconnectMiddleware(TraceCancellations(inner), watch_delay=0), exporter)
    conn = ClientConnection()
    scope = http_scope("GET", "/v1/x")
    await leave(
        app, conn, scope, when=lambda: conn.body_chunks >= 2 if stream else conn.receive_calls >= 2
    )
    (span,) = exporter.get_finished_spans()
    assert [event.name for event in span.events] == [EVENT]
    attributes = dict(span.events[0].attributes or {})
    assert attributes["asgi_cancel.reason"] == "client disconnected"
    assert attributes["asgi_cancel.phase"] == phase
    assert 0 < float(attributes["asgi_cancel.elapsed"]) < 5  # type: ignore[arg-type]
    assert dict(span.attributes or {}) == attributes


async def test_span_untouched_when_not_cancelled(exporter: InMemorySpanExporter) -> None:
    async def hello(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.lowlevel.checkpoint()
        await respond(send)

    app = traced(CancelOnDisconnectMiddleware(TraceCancellations(hello)), exporter)
    conn = ClientConnection()
    await with_watchdog(conn.run(app, http_scope("GET", "/")))
    (span,) = exporter.get_finished_spans()
    assert not span.events
    assert not span.attributes


async def test_nothing_without_a_span_or_outside_the_middleware() -> None:
    events: list[str] = []
    await leave(CancelOnDisconnectMiddleware(TraceCancellations(slow_app(events, read=False))))
    assert events == ["cancelled"]

    async def hello(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send)

    exporter = InMemorySpanExporter()
    conn = ClientConnection()
    await with_watchdog(conn.run(traced(TraceCancellations(hello), exporter), http_scope()))
    assert conn.status == 200
    assert not exporter.get_finished_spans()[0].events
