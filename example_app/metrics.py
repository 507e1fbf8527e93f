"""`/metrics` through `prometheus_client`, with the package's `CancelMetrics` hook.

Each app has its own registry (tests build several apps in one process): the engine's counters
and gauges, read from `Engine.stats()` at each scrape; `example_info{engine,middleware}`;
`example_http_requests_cancelled_total`; and, with the middleware, `asgi_cancel.prometheus`'s
`asgi_cancel_cancelled_requests_total` and `asgi_cancel_cancel_cleanup_seconds` by method,
route template, reason and phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asgi_cancel.prometheus import CancelMetrics
from asgi_cancel.types import CancelledRequest

from .engine import Engine

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (name, type, help, EngineStats field)
_ENGINE_METRICS = (
    ("requests_running", "gauge", "Requests in the engine's running batch.", "running"),
    ("requests_waiting", "gauge", "Requests queued for a batch slot.", "waiting"),
    ("max_batch_size", "gauge", "Batch slots (0 if the engine does not say).", "max_batch_size"),
    ("requests_total", "counter", "Requests submitted to the engine.", "requests"),
    ("requests_finished_total", "counter", "Requests that ran to completion.", "finished"),
    ("requests_aborted_total", "counter", "Requests aborted before completion.", "aborted"),
    (
        "clients_gone_total",
        "counter",
        "Requests whose HTTP client left before the request finished.",
        "clients_gone",
    ),
    ("tokens_generated_total", "counter", "Tokens generated.", "tokens_generated"),
    (
        "tokens_wasted_total",
        "counter",
        "Tokens generated after the request's HTTP client had gone.",
        "tokens_wasted",
    ),
)


class _EngineCollector(Collector):
    """The engine's own counters, read at scrape time (the engine keeps them, not us)."""

    def __init__(self, engine: Engine, middleware: bool) -> None:
        self.engine = engine
        self.middleware = "on" if middleware else "off"

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "example_info", "The example server's configuration.", labels=["engine", "middleware"]
        )
        info.add_metric([self.engine.name, self.middleware], 1)
        yield info
        stats = self.engine.stats()
        for name, kind, help_text, field in _ENGINE_METRICS:
            value = getattr(stats, field)
            if kind == "counter":
                yield CounterMetricFamily(f"example_engine_{name}", help_text, value=value)
            else:
                yield GaugeMetricFamily(f"example_engine_{name}", help_text, value=value)


class Metrics:
    """The app's registry, and the middleware's `on_cancelled` hook that feeds it."""

    def __init__(self, engine: Engine, *, middleware: bool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, middleware))
        self.cancelled = Counter(
            "example_http_requests_cancelled",
            "Requests CancelOnDisconnectMiddleware cancelled because the client disconnected.",
            registry=self.registry,
        )
        # The package's hook (`asgi-cancel[prometheus]`): by method, route, reason and phase.
        self.cancel_metrics = CancelMetrics(registry=self.registry) if middleware else None

    def on_cancelled(self, request: CancelledRequest) -> Callable[[], None] | None:
        self.cancelled.inc()
        if self.cancel_metrics is None:
            return None
        return self.cancel_metrics(request)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse(text: str) -> dict[str, float]:
    """Samples by name (labels included verbatim), for the demo and the tests."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
