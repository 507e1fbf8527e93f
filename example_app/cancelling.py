"""The middleware as the example's servers run it: with its deadlines, and cancel by id."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp

from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    cancel_endpoint,
    require_header,
)
from asgi_cancel.types import OnCancelled

CANCEL_PATH = "/v1/requests"  # POST /v1/requests/{id}/cancel, DELETE /v1/requests/{id}
CANCEL_SECRET_HEADER = "x-cancel-secret"


@dataclass(frozen=True)
class CancelOptions:
    """What `serve` and `gateway` ask of `CancelOnDisconnectMiddleware`.

    Attributes:
        cancel_endpoint: serve `asgi_cancel.cancel_endpoint` under `/v1/requests`:
            `DELETE /v1/requests/{id}`, `id` being the request's `X-Request-Id`, stops that
            request; its client gets a 499.
        secret: if set, the cancel endpoint requires `X-Cancel-Secret: <secret>`. Without one,
            serve it only where nobody but the gateway and operators can connect (the example
            binds 127.0.0.1).
        timeout, timeout_header: the middleware's deadlines: a request past its own is
            cancelled and answered 504 (a started stream is cut).
        redis_url: the Redis that carries cancels by id between the processes of the
            deployment (`asgi_cancel.redis.RedisBroker`); None: this process only.
    """

    cancel_endpoint: bool = False
    secret: str | None = None
    timeout: float | None = None
    timeout_header: str | None = None
    redis_url: str | None = None

    def wrap(
        self, app: Starlette, *, ids: bool = False, on_cancelled: OnCancelled | None = None
    ) -> ASGIApp:
        """`app` under the middleware, with the cancel endpoint mounted if asked for.

        Args:
            app: the app (the endpoint is added to its routes).
            ids: give every request an id, endpoint or not (a gateway forwards it).
            on_cancelled: the middleware's hook.
        """
        registry = None
        if ids or self.cancel_endpoint:
            broker = None
            if self.redis_url is not None:
                from asgi_cancel.redis import RedisBroker  # the redis extra: only when asked

                broker = RedisBroker(self.redis_url)
            registry = CancelRegistry(broker=broker)
        if registry is not None and self.cancel_endpoint:
            authorize = require_header(CANCEL_SECRET_HEADER, self.secret) if self.secret else None
            endpoint = cancel_endpoint(registry, authorize=authorize)
            app.router.routes.append(Mount(CANCEL_PATH, endpoint))
        return CancelOnDisconnectMiddleware(
            app,
            on_cancelled=on_cancelled,
            registry=registry,
            timeout=self.timeout,
            timeout_header=self.timeout_header,
        )
