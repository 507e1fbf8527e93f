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

from .helpers import leave, respond, slow_app, with_watchdog

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
    inner = slow_app(events, read=False, stream=stream)
    app = traced(CancelOnDisconnectMiddleware(TraceCancellations(inner), watch_delay=0), exporter)
    conn = ClientConnection()
    scope = http_scope("GET", "/v1/x")
    await leave(
        app, conn, scope, when=lambda: conn.body_chunks >= 1 if stream else conn.receive_calls >= 2
    )
    (span,) = exporter.get_finished_spans()
    assert [event.name for event in span.events] == [EVENT]
    attributes = dict(span.events[0].attributes or {})
    assert attributes["asgi_cancel.reason"] == "client disconnected"
    assert attributes["asgi_cancel.phase"] == phase
    assert 0 < float(attributes["asgi_cancel.elapsed"]) < 5  # type: ignore[arg-type]
    assert dict(span.attributes or {}) == attributes


async def test_span_untouched_unless_cancelled_and_nothing_without_a_span(
    exporter: InMemorySpanExporter,
) -> None:
    async def hello(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.lowlevel.checkpoint()
        await respond(send)

    statuses = []
    for app in (CancelOnDisconnectMiddleware(TraceCancellations(hello)), TraceCancellations(hello)):
        conn = ClientConnection()  # inside the middleware, then outside it
        await with_watchdog(conn.run(traced(app, exporter), http_scope("GET", "/")))
        statuses.append(conn.status)
    assert statuses == [200, 200]
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    assert not any(span.events or span.attributes for span in spans)
    events: list[str] = []
    await leave(CancelOnDisconnectMiddleware(TraceCancellations(slow_app(events, read=False))))
    assert events == ["cancelled"]  # no span to add to: cancelled all the same
