"""Cancel by id across vLLM's API server processes: a `--middleware` class for `vllm serve`.

```console
$ ASGI_CANCEL_REDIS_URL=redis://127.0.0.1:6379/0 ASGI_CANCEL_SECRET=... \\
    vllm serve MODEL --api-server-count 2 --middleware tests.vllm.cancel_by_id.CancelByIdMiddleware
```

vLLM builds each `--middleware` class as `cls(app)`, with no arguments, once in every API server
process: a subclass that passes the options is how the middleware is configured there. Each
process gets its own `CancelRegistry` (a registry holds one process's requests) on the same
Redis broker, so a cancel issued in any process, or anywhere else on the broker, stops the
request in whichever API server holds it. Request ids are vLLM's: its `X-Request-Id` header,
which vLLM builds its engine ids on (`cmpl-{id}-0`, `chatcmpl-{id}`); and the ids vLLM shows
its clients (`chatcmpl-...`, `cmpl-...`, `resp_...`, the `X-Request-Id` it answers with) name
the request too (`asgi_cancel.vllm.OpenAIRequestIds`). The cancel endpoint is served by the
middleware itself, at `POST /v1/requests/{id}/cancel` and `DELETE /v1/requests/{id}` (vLLM
mounts no other app).

`ProbedCancelByIdMiddleware` is the tests' variant: it also logs, for every request, the API
server's pid, the `X-Request-Id` header and `current_token().request_id`; and a request with
`x-test-no-aliases: 1` skips `OpenAIRequestIds` (the tests' control).
"""

from __future__ import annotations

import logging
import os

from asgi_cancel import (
    CancelOnDisconnectMiddleware,
    CancelRegistry,
    cancel_endpoint,
    current_token,
    require_header,
)
from asgi_cancel.redis import RedisBroker
from asgi_cancel.types import ASGIApp, Receive, Scope, Send
from asgi_cancel.vllm import OpenAIRequestIds

from .server_log import log_to_stderr

CANCEL_PREFIX = "/v1/requests"


class CancelByIdMiddleware(CancelOnDisconnectMiddleware):
    """`CancelOnDisconnectMiddleware` with a registry on the Redis broker at
    `$ASGI_CANCEL_REDIS_URL`, vLLM's ids as aliases, and the cancel endpoint at
    `/v1/requests/{id}` (callers send `x-cancel-secret: $ASGI_CANCEL_SECRET`)."""

    def __init__(self, app: ASGIApp) -> None:
        registry = CancelRegistry(broker=RedisBroker(os.environ["ASGI_CANCEL_REDIS_URL"]))
        super().__init__(self.with_aliases(app, registry), registry=registry)
        secret = require_header("x-cancel-secret", os.environ["ASGI_CANCEL_SECRET"])
        self.cancel_endpoint = cancel_endpoint(registry, authorize=secret)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CANCEL_PREFIX + "/"):
            await self.cancel_endpoint({**scope, "root_path": CANCEL_PREFIX}, receive, send)
            return
        await super().__call__(scope, receive, send)

    @staticmethod
    def with_aliases(app: ASGIApp, registry: CancelRegistry) -> ASGIApp:
        return OpenAIRequestIds(app, registry)


logger = logging.getLogger("tests.vllm.cancel_by_id")


class ProbedCancelByIdMiddleware(CancelByIdMiddleware):
    """`CancelByIdMiddleware` that logs `probe pid=... header=... token=...` per request."""

    def __init__(self, app: ASGIApp) -> None:
        log_to_stderr("asgi_cancel", logger.name)

        async def probe(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"].startswith("/v1/"):
                header = dict(scope.get("headers", ())).get(b"x-request-id", b"").decode()
                token = current_token()
                logger.info(
                    "probe pid=%d path=%s header=%s token=%s",
                    os.getpid(),
                    scope["path"],
                    header or "-",
                    None if token is None else token.request_id,
                )
            await app(scope, receive, send)

        super().__init__(probe)

    @staticmethod
    def with_aliases(app: ASGIApp, registry: CancelRegistry) -> ASGIApp:
        aliasing = OpenAIRequestIds(app, registry)

        async def unless_told(scope: Scope, receive: Receive, send: Send) -> None:
            headers = dict(scope.get("headers", ())) if scope["type"] == "http" else {}
            chosen = app if headers.get(b"x-test-no-aliases") == b"1" else aliasing
            await chosen(scope, receive, send)

        return unless_told

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CANCEL_PREFIX + "/"):
            logger.info("cancel pid=%d path=%s", os.getpid(), scope["path"])
        await super().__call__(scope, receive, send)
