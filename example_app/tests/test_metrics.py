"""`/metrics` through prometheus_client, with the package's `CancelMetrics` hook.

Real cancellations under a real server: each counted once, by route template and phase, and the
metric names the docs use are all still there.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from example_app import metrics
from example_app.launch import ServerProcess

from .conftest import MODEL

pytestmark = pytest.mark.timeout(120)

DOCUMENTED = [  # README.md and docs/ name these
    "example_info",
    "example_engine_requests_running",
    "example_engine_requests_waiting",
    "example_engine_max_batch_size",
    "example_engine_requests_total",
    "example_engine_requests_finished_total",
    "example_engine_requests_aborted_total",
    "example_engine_clients_gone_total",
    "example_engine_tokens_generated_total",
    "example_engine_tokens_wasted_total",
    "example_http_requests_cancelled_total",
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_when_idle(process: ServerProcess) -> str:
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{process.base_url}/metrics", timeout=5.0).text
        parsed = metrics.parse(text)
        busy = parsed["example_engine_requests_running"] + parsed["example_engine_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def cancel_two(process: ServerProcess) -> None:
    """A non-streaming request that times out, and a stream closed after a few events."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{process.base_url}/v1/completions", json=body, timeout=0.5)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{process.base_url}/v1/chat/completions", json=chat, timeout=30.0
    ) as response:
        for index, _line in enumerate(response.iter_lines()):
            if index >= 6:
                break


def test_metrics_count_each_cancel_once_by_route_and_phase() -> None:
    args = ("--step-time", "0.01", "--log-level", "warning")
    with ServerProcess(*args, ready_timeout=60) as process:
        cancel_two(process)
        text = scrape_when_idle(process)
        time.sleep(0.3)  # the hook's cleanup observation lands when the handler has returned
        text = httpx.get(f"{process.base_url}/metrics", timeout=5.0).text
    found = samples(text)
    names = {name for name, _ in found}
    assert set(DOCUMENTED) <= names, sorted(set(DOCUMENTED) - names)
    assert found[("example_info", (("engine", "sim"), ("middleware", "on")))] == 1
    assert found[("example_http_requests_cancelled_total", ())] == 2
    assert found[("example_engine_tokens_wasted_total", ())] <= 2  # at most a step each
    cancelled = {
        labels: value
        for (name, labels), value in found.items()
        if name == "asgi_cancel_cancelled_requests_total"
    }
    reason = ("reason", "client disconnected")
    assert cancelled == {
        (("method", "POST"), ("phase", "before_response"), reason, ("route", "/v1/completions")): 1,
        (("method", "POST"), ("phase", "mid_stream"), reason, ("route", "/v1/chat/completions")): 1,
    }
    counts = [
        value
        for (name, _), value in found.items()
        if name == "asgi_cancel_cancel_cleanup_seconds_count"
    ]
    assert sorted(counts) == [1, 1]


def test_metrics_without_the_middleware_have_no_cancel_series() -> None:
    args = ("--step-time", "0.01", "--log-level", "warning", "--no-middleware")
    with ServerProcess(*args, ready_timeout=60) as process:
        cancel_two(process)
        text = scrape_when_idle(process)
    found = samples(text)
    assert found[("example_info", (("engine", "sim"), ("middleware", "off")))] == 1
    assert found[("example_http_requests_cancelled_total", ())] == 0
    assert found[("example_engine_tokens_wasted_total", ())] > 2  # generated for nobody
    assert not any(name.startswith("asgi_cancel_") for name, _ in found)
