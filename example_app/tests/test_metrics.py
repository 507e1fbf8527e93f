"""`/metrics` through prometheus_client, with the package's `CancelMetrics` hook.

Real cancellations under a real server: each counted once, by route template and phase, and the
metric names the README lists are all there.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from example_app.launch import ServerProcess

from .helpers import MODEL, request, wait_idle

pytestmark = pytest.mark.timeout(120)

DOCUMENTED = {  # README.md names these
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
}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def cancel_two_then_scrape(*serve_args: str) -> Samples:
    """A non-streaming request that times out, a stream closed after a few events.

    With the middleware, the samples are taken once the engine is idle; without it, the timed
    out request generates on for 20 s: they are taken at once.
    """
    args = ("--step-time", "0.01", "--log-level", "warning", *serve_args)
    with ServerProcess(*args, ready_timeout=60) as process:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{process.base_url}/v1/completions", json=body, timeout=0.5)
        messages = [{"role": "user", "content": "hi"}]
        chat = {"model": MODEL, "messages": messages, "max_tokens": 2000, "stream": True}
        url = f"{process.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=chat, timeout=30.0) as response:
            for index, _line in enumerate(response.iter_lines()):
                if index >= 6:
                    break
        if "--no-middleware" not in serve_args:
            wait_idle(process)
        time.sleep(0.3)  # the hook's cleanup observation lands when the handler has returned
        text = request(process.port, "GET", "/metrics")[2].decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_each_cancel_once_by_route_and_phase() -> None:
    found = cancel_two_then_scrape()
    assert DOCUMENTED <= {name for name, _ in found}
    assert found[("example_info", (("engine", "sim"), ("middleware", "on")))] == 1
    assert found[("example_http_requests_cancelled_total", ())] == 2
    assert found[("example_engine_tokens_wasted_total", ())] <= 2  # at most a step each
    cancelled = {
        dict(labels)["route"]: labels
        for (name, labels), value in found.items()
        if name == "asgi_cancel_cancelled_requests_total" and value == 1
    }
    reason = ("reason", "client disconnected")
    assert cancelled == {
        "/v1/completions": (("method", "POST"), ("phase", "before_response"), reason,
                            ("route", "/v1/completions")),
        "/v1/chat/completions": (("method", "POST"), ("phase", "mid_stream"), reason,
                                 ("route", "/v1/chat/completions")),
    }  # fmt: skip
    cleanups = [v for (name, _), v in found.items() if name.endswith("cleanup_seconds_count")]
    assert sorted(cleanups) == [1, 1]


def test_metrics_without_the_middleware_have_no_cancel_series() -> None:
    found = cancel_two_then_scrape("--no-middleware")
    assert found[("example_info", (("engine", "sim"), ("middleware", "off")))] == 1
    assert found[("example_http_requests_cancelled_total", ())] == 0
    assert found[("example_engine_tokens_wasted_total", ())] > 2  # generated for nobody
    assert not any(name.startswith("asgi_cancel_") for name, _ in found)
