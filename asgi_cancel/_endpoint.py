"""`cancel_endpoint()`: a mountable ASGI app that cancels requests by id over HTTP."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from ._registry import CANCELLED, CancelRegistry
from ._tracking import route_path
from ._validate import ID_CHARACTERS, MAX_ID_LENGTH, header_name, valid_request_id
from .types import ASGIApp, Receive, Scope, Send

Authorize = Callable[[Scope], bool]


def require_header(name: str, secret: str) -> Authorize:
    """An `authorize` check for `cancel_endpoint`: the request must carry `name: secret`.

    Compared in constant time. Use a secret that only gateways and operators know, and still
    serve the endpoint where only they can reach it (an internal port or path).

    Args:
        name: the header name, e.g. `"x-cancel-secret"`.
        secret: the shared secret.

    Raises:
        ValueError: `name` is not a header name, or `secret` is empty.
    """
    header = header_name("name", name)
    if not isinstance(secret, str) or not secret:
        raise ValueError("require_header needs a non-empty secret")
    expected = secret.encode()

    def authorize(scope: Scope) -> bool:
        for key, value in scope.get("headers", ()):
            if key == header:
                return hmac.compare_digest(bytes(value), expected)
        return False

    return authorize


def cancel_endpoint(registry: CancelRegistry, *, authorize: Authorize | None) -> ASGIApp:
    """An ASGI app that cancels running requests by id: `POST /{id}/cancel` or `DELETE /{id}`.

    Mount it where gateways and operators can reach it and clients cannot, at `/v1/requests`
    for the shape other servers answer (`POST /v1/requests/{id}/cancel`, `DELETE
    /v1/requests/{id}`; Starlette: `Mount("/v1/requests", cancel_endpoint(registry,
    authorize=...))`). Paths are taken relative to `scope["root_path"]`. The endpoint never
    blocks its event loop: a request running on another thread's loop is stopped there, and
    with a broker the other processes answer within its `wait` (`registry.acancel()`).
    Answers, as JSON:

    - 200 `{"id": ..., "cancelled": true}`: the request was running and is now cancelled (its
      client gets a 499, or the end of its stream, once its app has cleaned up);
    - 404 `{"id": ..., "cancelled": false}`: no such request running anywhere the registry
      reaches (unknown, finished, its response already complete, or already cancelled);
    - 400 for an id that no request can have (see `CancelRegistry`);
    - 403 when `authorize(scope)` is false, 405 for another method, 404 for another path.

    A 200 or 404 carries the id in the registry's header (`X-Request-Id: ...`), as the
    responses of the requests themselves do.

    Args:
        registry: the `CancelRegistry` given to `CancelOnDisconnectMiddleware`.
        authorize: a check on the request's scope, e.g. `require_header("x-cancel-secret",
            secret)`; required, pass None explicitly to accept every caller (only behind a
            port that nobody else can reach).
    """
    id_header = registry.header.encode("ascii")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":  # mounted alone: nothing to start or stop
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        parts = [part for part in route_path(scope).split("/") if part]
        method = scope.get("method", "GET")
        if len(parts) == 2 and parts[1] == "cancel":
            allowed = "POST"
        elif len(parts) == 1:
            allowed = "DELETE"
        else:
            await _answer(send, 404, {"error": "not found"})
            return
        if method != allowed:
            await _answer(send, 405, {"error": f"use {allowed}"}, [(b"allow", allowed.encode())])
            return
        if authorize is not None and not authorize(scope):
            await _answer(send, 403, {"error": "forbidden"})
            return
        request_id = parts[0]
        if not valid_request_id(request_id):
            message = f"a request id is 1 to {MAX_ID_LENGTH} of {ID_CHARACTERS}"
            await _answer(send, 400, {"error": message})
            return
        cancelled = await registry.acancel(request_id, CANCELLED)
        content: dict[str, object] = {"id": request_id, "cancelled": cancelled}
        broker = registry.broker
        if not cancelled and broker is not None and not getattr(broker, "connected", True):
            content["broker"] = "unreachable"  # the answer of this process alone
        await _answer(
            send, 200 if cancelled else 404, content, [(id_header, request_id.encode("ascii"))]
        )

    return app


async def _answer(
    send: Send,
    status: int,
    content: dict[str, object],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(content).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
