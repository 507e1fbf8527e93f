"""`/metrics` in the Prometheus text exposition format (hand-written: no client library needed)."""

from __future__ import annotations

from .engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


def render(stats: EngineStats, *, engine: str, middleware: bool, cancelled: int) -> str:
    """The exposition text for one scrape."""
    lines = [
        "# HELP example_info The example server's configuration.",
        "# TYPE example_info gauge",
        f'example_info{{engine="{engine}",middleware="{"on" if middleware else "off"}"}} 1',
    ]
    for name, kind, help_text, field in _ENGINE_METRICS:
        full = f"example_engine_{name}"
        lines += [
            f"# HELP {full} {help_text}",
            f"# TYPE {full} {kind}",
            f"{full} {getattr(stats, field)}",
        ]
    lines += [
        "# HELP example_http_requests_cancelled_total Requests CancelOnDisconnectMiddleware "
        "cancelled because the client disconnected.",
        "# TYPE example_http_requests_cancelled_total counter",
        f"example_http_requests_cancelled_total {cancelled}",
    ]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """Samples by name (labels included verbatim), for the demo and the tests."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
