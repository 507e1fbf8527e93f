"""Prometheus metrics of cancelled requests, through the middleware's `on_cancelled` hook.

Needs the `prometheus` extra (`pip install 'asgi-cancel[prometheus]'`, i.e.
`prometheus_client`). Nothing here runs for a request that is not cancelled.

```python
from asgi_cancel import CancelOnDisconnectMiddleware
from asgi_cancel.prometheus import CancelMetrics

app = CancelOnDisconnectMiddleware(app, on_cancelled=CancelMetrics())
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import monotonic

from ._extras import missing_extra

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise missing_extra("prometheus", exc) from exc

from ._report import method_of, phase, route_template
from .types import CancelledRequest

__all__ = ["DEFAULT_BUCKETS", "CancelMetrics", "route_template"]

DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""The cleanup histogram's buckets, in seconds from the disconnect to the end of the app's
cleanup: an engine abort is a few ms, a cleanup that flushes or rolls back can take seconds."""
# Any other method (a client can send anything) is counted as "other": a bounded label.
_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE", "WEBSOCKET")
)
LABELS = ("method", "route", "reason", "phase")


class CancelMetrics:
    """An `on_cancelled` hook that counts cancelled requests and times their cleanup.

    Three metrics, each labelled by `method`, `route` (the router's template such as
    `/v1/items/{item_id}`, never the raw path; `"unmatched"` when no Starlette/FastAPI route
    matched), `reason` (`"client disconnected"`, ...) and `phase` (`"before_response"` or
    `"mid_stream"`; for a websocket session, whose `method` is `"WEBSOCKET"`, `"handshake"` or
    `"session"`): every label takes values from a bounded set.

    - `<namespace>_cancelled_requests_total`: a counter, incremented once per cancelled
      request, at the disconnect.
    - `<namespace>_cancel_cleanup_seconds`: a histogram of the time from the disconnect to
      the app having returned (its cleanup done), observed once when the request ends.
    - `<namespace>_cancelled_tokens_total`: what an engine spent on cancelled requests, in
      tokens, with one more label `kind`: `prompt`, `completion` (all generated), and
      `after_cancel` (generated once the cancellation had begun); counted when the request
      ends, where a binding counts the engine's outputs (`asgi_cancel.vllm.generate`,
      `asgi_cancel.vllm.counted`).

    Multiprocess mode (gunicorn or uvicorn `--workers N`) works as for any
    `prometheus_client` metric: set `PROMETHEUS_MULTIPROC_DIR` before the workers start and
    serve a `MultiProcessCollector` registry on `/metrics`.

    Args:
        registry: where the metrics are registered; the default registry unless given.
            `None` registers them nowhere (as in `prometheus_client`).
        namespace: the metric names' prefix. Default `"asgi_cancel"`.
        buckets: the histogram's bucket bounds, in seconds.

    Raises:
        ValueError: the metrics are already registered in `registry` (one instance per
            registry and namespace).
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = REGISTRY,
        namespace: str = "asgi_cancel",
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self.cancelled = Counter(
            "cancelled_requests",
            "HTTP requests cancelled because their client left (or as the reason says).",
            LABELS,
            namespace=namespace,
            registry=registry,
        )
        self.cleanup = Histogram(
            "cancel_cleanup_seconds",
            "Seconds from the cancellation to the app having finished its cleanup.",
            LABELS,
            namespace=namespace,
            registry=registry,
            buckets=tuple(buckets),
        )
        self.tokens = Counter(
            "cancelled_tokens",
            "Tokens an engine spent on cancelled requests (kind: prompt, completion, "
            "after_cancel).",
            (*LABELS, "kind"),
            namespace=namespace,
            registry=registry,
        )

    def __call__(self, request: CancelledRequest) -> Callable[[], None]:
        method = method_of(request.scope)
        labels = (
            method if method in _METHODS else "other",
            route_template(request.scope),
            request.reason,
            phase(request.response_started, request.scope["type"]),
        )
        usage = request.usage
        self.cancelled.labels(*labels).inc()
        cancelled_at = monotonic()
        histogram = self.cleanup.labels(*labels)

        def finished() -> None:
            histogram.observe(monotonic() - cancelled_at)
            if usage.prompt_tokens or usage.completion_tokens:
                for kind, count in (
                    ("prompt", usage.prompt_tokens),
                    ("completion", usage.completion_tokens),
                    ("after_cancel", usage.after_cancel),
                ):
                    self.tokens.labels(*labels, kind).inc(count)

        return finished
